"""wagma (WAGMA-SGD, Li et al. 2021): each worker keeps its own model and averages it with a
small group after every local step; groups follow a butterfly schedule; every tau steps the group
is every worker. Every round is wait-avoiding (ps_server/schemes/wagma.py): only the first round
and the final global average wait for everyone. Evaluation measures the consensus of the workers' models."""

from __future__ import annotations

import copy

import torch

from gpu_worker.schemes.base import Replica, WorkerScheme
from gpu_worker.schemes.group_schedule import default_group_size, group_of
from gradps.optimizer import ScheduledOptimizer
from gradps.optimizer_spec import model_averaged


class WagmaWorker(WorkerScheme):
    def __init__(self, replica: Replica) -> None:
        super().__init__(replica)
        a = replica.assignment
        sp = replica.spec.scheme_params
        self.world, self.rank, self.ids = a.world, a.rank, a.workers
        self.group_size = sp.group_size or default_group_size(self.world)
        self.tau = sp.tau or 10
        local = model_averaged(replica.spec.optimizer, self.world)
        self.optimizer = ScheduledOptimizer(list(self.params.values()), local, replica.total_steps)
        self._consensus: torch.nn.Module | None = None  # a copy of the model, for evaluation

    def start(self) -> None:
        """The initial weights; for a worker that starts past step 0 (it joins the running run,
        or the run resumed), the consensus of the workers' latest models as the shards hold them.
        A run's first round waits for every live worker, as its final one does: a worker slower to
        start (loading its data, finishing the run before) would otherwise find the others' rounds
        ahead and skip every step they made meanwhile (up to 60 of 550 in `gradps compare`'s run)."""
        if self.replica.start_step:
            self._take_consensus(self.params)
        else:
            self.client.pull(self.params)
            self._take_average(0, wait=True)

    def went_back(self, step: int) -> None:
        """The run went back to its checkpoint at `step` (a shard restarted): the consensus of the
        deposits there. The shards' parts hold the registered model, not a trained one: wagma
        exchanges models, never gradients."""
        self._take_consensus(self.params)

    def _average(self, step: int, everyone: bool, wait: bool = False) -> tuple[dict[str, torch.Tensor], int, int]:
        """The round of `step`: this worker's group, or (`everyone`) every worker; `wait` for every
        live member's deposit (the final model only)."""
        ranks = range(self.world) if everyone else group_of(self.rank, step, self.world, self.group_size)
        members = sorted(self.ids[r] for r in ranks)
        average, frontier = self.client.group_average(self.params, step, members, is_global=wait)
        return average, frontier, len(members)

    def after_backward(self, step: int) -> int:
        grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in self.params.items()}
        is_global = step % self.tau == 0
        average, frontier, size = self._average(step, everyone=is_global)
        for name, p in self.params.items():
            if is_global:
                p.copy_(average[name])
            else:  # w <- (S * m + w) / (S + 1)
                p.mul_(1.0 / (size + 1)).add_(average[name], alpha=size / (size + 1))
            p.grad = grads[name]
        self.optimizer.updates = step  # the schedule follows the run's step: a late or resumed worker skipped some
        self.optimizer.step()
        if frontier <= step + 1:
            return step + 1
        # A late worker skips the rounds it missed and rejoins at the newest step. When that step
        # averages every worker, take that average now: the consensus, rather than a stale model
        # (but not at the last step, whose average `finish` waits for everyone to fix).
        if frontier % self.tau == 0 and frontier < self.replica.total_steps:
            self._take_average(frontier, wait=False)
            return frontier + 1
        return frontier

    def _take_average(self, step: int, wait: bool) -> None:
        average, _, _ = self._average(step, everyone=True, wait=wait)
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(average[name])

    def eval_model(self) -> torch.nn.Module:
        """The consensus the shards form from every worker's latest model, rather than this
        replica: what a user would deploy from the run at this point."""
        if self._consensus is None:
            self._consensus = copy.deepcopy(self.replica.model)
        self._take_consensus(dict(self._consensus.named_parameters()))
        return self._consensus

    def _take_consensus(self, into: dict[str, torch.Tensor]) -> None:
        """Copy into `into` the average of every live worker's latest deposit (nothing deposited)."""
        average, _ = self.client.group_average(self.params, 0, sorted(self.ids), is_global=False, consensus=True)
        with torch.no_grad():
            for name, values in average.items():
                into[name].copy_(values)

    def finish(self, steps_done: int) -> None:
        """The final model is the global average, for which every live worker waits; rank 0
        publishes it to the shards for export."""
        self._take_average(self.replica.total_steps, wait=True)
        if self.rank == 0:
            self.client.register(self.params, overwrite=True)

    def holds_final_model(self) -> bool:
        return True  # every replica took the final global average
