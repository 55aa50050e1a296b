"""asgd (GPU A-SGD, Paine et al. 2013): push every n_push steps, fetch every n_fetch steps."""

from __future__ import annotations

import torch

from gpu_worker.schemes.base import WorkerScheme


class AsgdWorker(WorkerScheme):
    """Downpour-style client: accumulate gradients, push them every n_push steps; between
    fetches, step the local replica with plain SGD so it does not compute on the same weights."""

    def __init__(self, trainer) -> None:
        super().__init__(trainer)
        sp = trainer.spec.scheme_params
        self.n_push = max(1, sp.n_push)
        self.n_fetch = max(1, sp.n_fetch)
        self.lr = trainer.spec.optimizer.lr
        self.accrued = {n: torch.zeros_like(p) for n, p in self.params.items()}

    def start(self) -> None:
        self.client.pull(self.params)

    def after_backward(self, step: int) -> int:
        grads = self.trainer.grads()
        for name, g in grads.items():
            self.accrued[name].add_(g)
        if (step + 1) % self.n_push == 0:
            self.client.push(self.accrued, step)
            for acc in self.accrued.values():
                acc.zero_()
        if (step + 1) % self.n_fetch == 0:
            self.client.pull(self.params)
        else:
            for name, p in self.params.items():
                p.add_(grads[name], alpha=-self.lr)
        return step + 1

    def finish(self) -> None:
        if any(bool(acc.any()) for acc in self.accrued.values()):
            self.client.push(self.accrued, self.trainer.steps_done)
        self.client.pull(self.params)
