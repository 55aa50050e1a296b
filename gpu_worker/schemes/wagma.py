"""wagma (WAGMA-SGD, Li et al. 2021): each worker keeps its own model and averages it with a
small group after every local step; groups follow a butterfly schedule; every tau steps a
global synchronous average. The group round is wait-avoiding: see ps_server/schemes/wagma.py."""

from __future__ import annotations

import torch

from gpu_worker.schemes.base import Replica, WorkerScheme
from gpu_worker.schemes.group_schedule import default_group_size, group_of
from gradps.optimizer import ScheduledOptimizer


class WagmaWorker(WorkerScheme):
    def __init__(self, replica: Replica) -> None:
        super().__init__(replica)
        a = replica.assignment
        sp = replica.spec.scheme_params
        self.world, self.rank, self.ids = a.world, a.rank, a.workers
        self.group_size = sp.group_size or default_group_size(self.world)
        self.tau = sp.tau or 10
        self.optimizer = ScheduledOptimizer(list(self.params.values()), replica.spec.optimizer, replica.total_steps)

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
        if frontier <= step + 1:
            return step + 1
        # A late worker skips the rounds it missed and rejoins at the newest step. When that step
        # is a global round, the others are already waiting in it: deposit now rather than after
        # computing another gradient, so a straggler holds the global round up as little as it can.
        if frontier % self.tau == 0:
            self._take_global(frontier)
            return frontier + 1
        return frontier

    def _take_global(self, step: int) -> None:
        average, _, _ = self._average(step, is_global=True)
        for name, p in self.params.items():
            p.copy_(average[name])

    def finish(self, steps_done: int) -> None:
        """The final model is the global average; rank 0 publishes it to the shards for export."""
        self._take_global(self.replica.total_steps)
        if self.rank == 0:
            self.client.register(self.params, overwrite=True)
