"""ssp (Ho et al. 2013): apply pushes at once; a worker at clock c pulls only when the slowest
live worker's clock is at least c - s. s = 0 waits like sync; s = infinity is asgd."""

from __future__ import annotations

from gradps.v1 import shard_pb2
from ps_server.run_state import Part, RunState
from ps_server.saved_state import Saved
from ps_server.schemes.asgd import AsgdRule


class SspRule(AsgdRule):
    """Clocks are counted per worker as pushes applied (AsgdRule.clock: after step t, t + 1)."""

    def __init__(self, run: RunState) -> None:
        super().__init__(run)
        self.staleness = run.spec.scheme_params.staleness

    def load(self, saved: Saved) -> None:
        # asgd takes a checkpoint without clocks (one written before asgd kept them); ssp's
        # bound needs them, and its checkpoints always held them.
        if "clock" not in saved.fields:
            raise KeyError("clock")
        super().load(saved)

    def pull_ready(self, parts: list[Part], request: shard_pb2.PullRequest) -> bool:
        return super().pull_ready(parts, request) and self.slowest_clock() >= request.clock - self.staleness
