"""sync: bulk-synchronous SGD; one averaged update per step from every live worker."""

from __future__ import annotations

import torch

from ps_server.run_state import PartKey, Push, PushRejected
from ps_server.schemes.base import ShardRule


class SyncRule(ShardRule):
    """Sum each part's gradients for step t; when every live worker has pushed, apply the mean.

    A part's version is the number of steps applied, so the pull for step t waits for
    version >= t. A dead worker leaves the count when the coordinator sends the new membership.
    """

    def __init__(self, run) -> None:
        super().__init__(run)
        # Per part: (sum of gradients, workers that contributed) for the part's current step.
        self.pending: dict[PartKey, tuple[torch.Tensor, set[int]]] = {}

    def push(self, push: Push) -> int:
        for key in push.grads:
            version = self.run.parts[key].version
            if push.step > version:
                raise PushRejected(f"step {push.step} is ahead of part {key[0]}/{key[1]} at step {version}")
        for key, grad in push.grads.items():
            part = self.run.parts[key]
            if push.step < part.version:
                continue  # that step was applied without this (late) worker
            total, contributors = self.pending.get(key, (None, set()))
            if push.worker_id in contributors:
                continue
            total = grad.clone() if total is None else total.add_(grad)
            contributors.add(push.worker_id)
            self.pending[key] = (total, contributors)
            self._maybe_apply(key)
        return 0

    def membership_changed(self) -> None:
        for key in list(self.pending):
            self._maybe_apply(key)

    def _maybe_apply(self, key: PartKey) -> None:
        total, contributors = self.pending[key]
        if not self.run.live_workers <= contributors:
            return
        part = self.run.parts[key]
        part.optimizer.apply(total.div_(len(contributors)))
        part.version += 1
        del self.pending[key]
