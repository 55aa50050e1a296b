"""sync: bulk-synchronous SGD; one averaged update per step from every live worker."""

from __future__ import annotations

import torch

from gradps.codecs import SparsePart
from gradps.errors import NotNow
from gradps.placement import PartKey
from ps_server.run_state import Part, Push, RunState
from ps_server.saved_state import Saved, part_of
from ps_server.schemes.base import ShardRule


class SyncRule(ShardRule):
    """Sum each part's gradients per step; when every live worker has pushed step t, apply the mean.

    A part's version is the number of steps completed, so the pull for step t waits for
    version >= t. A dead worker leaves the count when the coordinator sends the new membership.
    With b backup workers (Chen et al. 2016) a step completes once all but b live workers have
    pushed it: the mean of those; a late push of a completed step is left out. A push holds all
    of a worker's parts on this shard, so its parts complete on the same workers' gradients.
    """

    # How many steps ahead of a part's version a push may be (pseudosync pushes without waiting).
    max_ahead = 0
    # push() also takes SparsePart gradients (the shard decodes with decode_summand): it only sums.
    sums_sparse_parts = True
    pulls_race_updates = False
    # Whether the run's `backup_workers` applies (pseudosync waits for every live worker).
    takes_backup_workers = True

    def __init__(self, run: RunState) -> None:
        super().__init__(run)
        # Per part and step: (sum of gradients, workers that contributed).
        self.pending: dict[PartKey, dict[int, tuple[torch.Tensor, set[int]]]] = {}
        # Live workers a step may complete without.
        self.backup = run.spec.scheme_params.backup_workers if self.takes_backup_workers else 0

    def push(self, push: Push) -> int:
        for key in push.grads:
            version = self.run.parts[key].version
            if push.step > version + self.max_ahead:
                raise NotNow(f"step {push.step} is ahead of part {key[0]}/{key[1]} at step {version}")
        completed = []
        for key, grad in push.grads.items():
            part = self.run.parts[key]
            if push.step < part.version:
                continue  # that step was completed without this (late) worker
            steps = self.pending.setdefault(key, {})
            total, contributors = steps.get(push.step, (None, set()))
            if push.worker_id in contributors:
                continue
            total = _add_into(total, grad)
            contributors.add(push.worker_id)
            steps[push.step] = (total, contributors)
            completed += self._complete_ready(key)
        self._complete(completed)
        return 0

    def step(self) -> int:
        # Steps completed on every part: a checkpoint at step t is a step boundary.
        return min((p.version for p in self.run.parts.values()), default=0)

    def save(self, saved: Saved) -> None:
        # Partial sums of steps not yet complete (a late worker's, or with backup workers).
        saved.fields["pending"] = [
            [*key, step, sorted(contributors), saved.put(total)]
            for key, steps in self.pending.items()
            for step, (total, contributors) in steps.items()
        ]

    def load(self, saved: Saved) -> None:
        for name, index, step, contributors, tensor in saved.fields["pending"]:
            steps = self.pending.setdefault(part_of([name, index]), {})
            steps[int(step)] = (saved.get(tensor), {int(w) for w in contributors})

    def membership_changed(self) -> None:
        self._complete([c for key in list(self.pending) for c in self._complete_ready(key)])

    def _complete_ready(self, key: PartKey) -> list[tuple[Part, int, torch.Tensor]]:
        """Complete the part's steps in order while all but `backup` live workers have
        contributed: each as (part, step, mean gradient)."""
        part = self.run.parts[key]
        steps = self.pending[key]
        completed = []
        while part.version in steps:
            total, contributors = steps[part.version]
            if len(self.run.live_workers - contributors) > self.backup:
                break
            del steps[part.version]
            completed.append((part, part.version, total.div_(len(contributors))))
            part.version += 1
        return completed

    def _complete(self, completed: list[tuple[Part, int, torch.Tensor]]) -> None:
        """What the steps' exact mean gradients do: sync applies them to the weights, every part
        completed by one push in one fused step."""
        self.run.optimizer.apply([(part.key, mean, 1.0) for part, _, mean in completed])


def _add_into(total: torch.Tensor | None, grad: torch.Tensor | SparsePart) -> torch.Tensor:
    """total + grad, in place; the first gradient of a step becomes the sum.

    `grad` is the shard's own freshly decoded tensor, so it is taken, not copied. A SparsePart
    (topk, randk decoded by `decode_summand`) adds its k values with one index_add_: no full-size
    decoded tensor for any but the step's first sparse gradient, whose dense form is the sum.
    """
    if isinstance(grad, SparsePart):
        return grad.to_dense() if total is None else grad.add_to(total)
    return grad if total is None else total.add_(grad)
