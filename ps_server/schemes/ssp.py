"""ssp (Ho et al. 2013): apply pushes at once; a worker at clock c pulls only when the slowest
live worker's clock is at least c - s. s = 0 waits like sync; s = infinity is asgd."""

from __future__ import annotations

from gradps.v1 import shard_pb2
from ps_server.run_state import Part, Push, RunState
from ps_server.saved_state import Saved
from ps_server.schemes.asgd import AsgdRule


class SspRule(AsgdRule):
    """Clocks are counted per worker as pushes applied (a worker's clock after step t is t + 1)."""

    def __init__(self, run: RunState) -> None:
        super().__init__(run)
        self.staleness = run.spec.scheme_params.staleness
        self.clock: dict[int, int] = {}

    def push(self, push: Push) -> int:
        staleness = super().push(push)
        self.clock[push.worker_id] = max(self.clock.get(push.worker_id, 0), push.step + 1)
        return staleness

    def save(self, saved: Saved) -> None:
        super().save(saved)
        saved.fields["clock"] = sorted(self.clock.items())

    def load(self, saved: Saved) -> None:
        super().load(saved)
        self.clock = {int(worker): int(clock) for worker, clock in saved.fields["clock"]}

    def slowest_clock(self) -> int:
        return min((self.clock.get(w, 0) for w in self.run.live_workers), default=0)

    def pull_ready(self, parts: list[Part], request: shard_pb2.PullRequest) -> bool:
        return super().pull_ready(parts, request) and self.slowest_clock() >= request.clock - self.staleness
