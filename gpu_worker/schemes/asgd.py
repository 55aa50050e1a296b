"""asgd (GPU A-SGD, Paine et al. 2013): push every n_push steps, fetch every n_fetch steps."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from gpu_worker.schemes.base import Replica, WorkerScheme


class AsgdWorker(WorkerScheme):
    """Downpour-style client: accumulate gradients, push them every n_push steps; between
    fetches, step the local replica with plain SGD so it does not compute on the same weights.

    The exchange after step t (its push, then its fetch) runs in the background while step t + 1
    computes on the local replica, and the fetched weights are installed after step t + 1's
    backward, before its local update: Downpour's asynchronous fetch. The replica so trains on
    weights one exchange older than a blocking fetch would give, and the loop waits only for
    what the exchange takes beyond a step's compute (docs/performance.md, "A training step")."""

    def __init__(self, replica: Replica) -> None:
        super().__init__(replica)
        sp = replica.spec.scheme_params
        self.n_push = max(1, sp.n_push)
        self.n_fetch = max(1, sp.n_fetch)
        self.lr = replica.spec.optimizer.lr
        self.accrued = {n: torch.zeros_like(p) for n, p in self.params.items()}
        # The gradient an exchange is pushing, and the weights it fetches: the loop does not
        # touch either while the exchange runs.
        self.sending = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.fetched = {n: torch.empty_like(p) for n, p in self.params.items()}
        self._exchanges = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asgd-exchange")
        self._pending: Future[bool] | None = None

    def start(self) -> None:
        self.client.pull(self.params)

    def after_backward(self, step: int) -> int:
        grads = self.replica.grads()
        for name, g in grads.items():
            self.accrued[name].add_(g)
        self._settle()
        for name, p in self.params.items():
            p.add_(grads[name], alpha=-self.lr)
        push, fetch = (step + 1) % self.n_push == 0, (step + 1) % self.n_fetch == 0
        if push:
            self.sending, self.accrued = self.accrued, self.sending
            for acc in self.accrued.values():
                acc.zero_()
        if push or fetch:
            self._pending = self._exchanges.submit(self._exchange, step, push, fetch)
        return step + 1

    def _exchange(self, step: int, push: bool, fetch: bool) -> bool:
        """In the background: push the sending gradient, then fetch the weights; True if fetched."""
        if push and fetch:
            self.client.push_pull(self.sending, step, self.fetched)  # one call per shard
        elif push:
            self.client.push(self.sending, step)
        elif fetch:
            self.client.pull(self.fetched)
        return fetch

    def _settle(self) -> None:
        """Wait for the exchange in flight (its errors surface here) and install what it fetched."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.result():
            for name, p in self.params.items():
                p.copy_(self.fetched[name])

    def finish(self, steps_done: int) -> None:
        self._settle()
        self._exchanges.shutdown()
        if any(bool(acc.any()) for acc in self.accrued.values()):
            self.client.push(self.accrued, steps_done)
        self.client.pull(self.params)
