"""wagma (WAGMA-SGD, Li et al. 2021): each worker keeps its own model and averages it with a
small group after every local step; groups follow a butterfly schedule; every tau steps a
global synchronous average. The group round is wait-avoiding: see ps_server/schemes/wagma.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.schemes.base import WorkerScheme
from gpu_worker.schemes.group_schedule import default_group_size, group_of
from ps_server.optimizer import ScheduledOptimizer


@dataclass(frozen=True)
class Rejoin:
    """Where a worker goes after a round: the step it computes next, and whether it first
    deposits for the global round `global_step` (it is late, and that round is near)."""

    step: int
    global_step: int | None = None


def rejoin(step: int, frontier: int, last_frontier: int, tau: int) -> Rejoin:
    """The step after `step`'s round, given the newest step anyone deposited (`frontier`, now and
    at this worker's previous round).

    A worker that is not behind goes on to step + 1. A late one skips the rounds it missed (their
    results were fixed with its stale model already) and rejoins at the frontier. The others only
    ever wait for it in a global round, so it deposits for the next global round at once when the
    others will get there before it could finish one more step: they advanced
    `frontier - last_frontier` steps during its last one.
    """
    if frontier <= step + 1:
        return Rejoin(step + 1)
    next_global = -(-frontier // tau) * tau
    if next_global - frontier < max(1, frontier - last_frontier):
        return Rejoin(next_global + 1, global_step=next_global)
    return Rejoin(frontier)


class WagmaWorker(WorkerScheme):
    def __init__(self, trainer) -> None:
        super().__init__(trainer)
        a = trainer.assignment
        sp = trainer.spec.scheme_params
        self.world, self.rank, self.ids = a.world, a.rank, a.workers
        self.group_size = sp.group_size or default_group_size(self.world)
        self.tau = sp.tau or 10
        self.optimizer = ScheduledOptimizer(list(self.params.values()), trainer.spec.optimizer, trainer.total_steps)
        # The frontier seen at the previous round: how fast the others move, in steps per step of ours.
        self.last_frontier = 0

    def start(self) -> None:
        self.client.pull(self.params)

    def _average(self, step: int, is_global: bool) -> tuple[dict[str, torch.Tensor], int, int]:
        ranks = range(self.world) if is_global else group_of(self.rank, step, self.world, self.group_size)
        members = sorted(self.ids[r] for r in ranks)
        average, frontier = self.client.group_average(self.params, step, members, is_global)
        return average, frontier, len(members)

    def after_backward(self, step: int) -> int:
        grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in self.params.items()}
        is_global = step % self.tau == 0
        average, frontier, size = self._average(step, is_global)
        for name, p in self.params.items():
            if is_global:
                p.copy_(average[name])
            else:  # w <- (S * m + w) / (S + 1)
                p.mul_(1.0 / (size + 1)).add_(average[name], alpha=size / (size + 1))
            p.grad = grads[name]
        self.optimizer.step()
        where = rejoin(step, frontier, self.last_frontier, self.tau)
        self.last_frontier = frontier
        if where.global_step is not None:
            self._take_global(where.global_step)
            self.last_frontier = where.global_step
        return where.step

    def _take_global(self, step: int) -> None:
        average, _, _ = self._average(step, is_global=True)
        for name, p in self.params.items():
            p.copy_(average[name])

    def finish(self) -> None:
        """The final model is the global average; rank 0 publishes it to the shards for export."""
        self._take_global(self.trainer.total_steps)
        if self.rank == 0:
            self.client.register(self.params, overwrite=True)
