"""pseudosync: the shard reduces each step's global gradient G_t = mean_i g_t^i and serves it;
the workers apply it (as a predicted gradient) to their identical replicas."""

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

    def __init__(self, run: RunState) -> None:
        super().__init__(run)
        self.reduced: dict[PartKey, dict[int, torch.Tensor]] = {}

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

    def load(self, saved: Saved) -> None:
        super().load(saved)
        for name, index, step, tensor in saved.fields["reduced"]:
            self.reduced.setdefault(part_of([name, index]), {})[int(step)] = saved.get(tensor)

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
