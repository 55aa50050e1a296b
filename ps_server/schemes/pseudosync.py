"""pseudosync: the shard reduces each step's global gradient G_t = mean_i g_t^i and serves it;
the workers apply it (as a predicted gradient) to their identical replicas.

The replica lives on the workers: rank 0 hands it in at the start of every checkpoint step (a
RegisterTensors with replica_step), and the shard checkpoints that step only once it holds it.
Every checkpoint is then a cut the workers can go back to, taking the replica from the shards:
after a shard's restart, to let a new worker in (its replica must be the others'), or to resume.
"""

from __future__ import annotations

import torch

from gradps.errors import NotNow
from gradps.placement import PartKey
from gradps.v1 import shard_pb2
from ps_server.run_state import Part, RunState
from ps_server.saved_state import Saved, part_of
from ps_server.schemes.base import ShardRule
from ps_server.schemes.sync import SyncRule

# Reduced gradients kept per part: workers are at most a step or two apart.
_KEEP_STEPS = 4


class PseudosyncRule(SyncRule):
    """Same exact reduction as sync, but the mean is stored, not applied: a part's version counts
    the steps reduced, and a pull with `gradient` waits for version > gradient_step."""

    max_ahead = 1
    # Every live worker's gradient is reduced: backup workers are sync's alone.
    takes_backup_workers = False
    takes_replicas = True

    def __init__(self, run: RunState) -> None:
        super().__init__(run)
        self.reduced: dict[PartKey, dict[int, torch.Tensor]] = {}
        # The step at whose start the parts' values are rank 0's replica (0: never handed in).
        self.replica_step = 0

    def hand_in(self, step: int) -> None:
        self.replica_step = step

    def cut_ready(self) -> bool:
        # A checkpoint at step t holds the replica of step t: the workers can go back there.
        return self.replica_step == self.step()

    def _complete(self, completed: list[tuple[Part, int, torch.Tensor]]) -> None:
        for part, step, mean in completed:
            history = self.reduced.setdefault(part.key, {})
            history[step] = mean
            for old in [s for s in history if s <= step - _KEEP_STEPS]:
                del history[old]

    def save(self, saved: Saved) -> None:
        super().save(saved)
        # The global gradients served to the workers' predictors.
        saved.fields["reduced"] = [
            [*key, step, saved.put(mean)] for key, history in self.reduced.items() for step, mean in history.items()
        ]
        saved.fields["replica_step"] = self.replica_step

    def load(self, saved: Saved) -> None:
        super().load(saved)
        for name, index, step, tensor in saved.fields["reduced"]:
            self.reduced.setdefault(part_of([name, index]), {})[int(step)] = saved.get(tensor)
        self.replica_step = int(saved.fields.get("replica_step", 0))

    def pull_ready(self, parts: list[Part], request: shard_pb2.PullRequest) -> bool:
        if not request.gradient:
            return ShardRule.pull_ready(self, parts, request)
        for p in parts:
            if p.version <= request.gradient_step:
                return False
            if request.gradient_step not in self.reduced.get(p.key, {}):
                raise NotNow(f"the gradient of step {request.gradient_step} is no longer kept")
        return True

    def pull_values(self, part: Part, request: shard_pb2.PullRequest) -> torch.Tensor:
        if request.gradient:
            return self.reduced[part.key][request.gradient_step]
        return part.values
