"""ssp (Ho et al. 2013): push every step; pull when the slowest live worker is within s clocks."""

from __future__ import annotations

from gpu_worker.schemes.base import WorkerScheme


class SspWorker(WorkerScheme):
    """A worker's clock after step t is t + 1; its pull waits on the shards until the slowest
    live worker's clock is at least (t + 1) - s."""

    def start(self) -> None:
        self.client.pull(self.params)

    def after_backward(self, step: int) -> int:
        self.client.push_pull(self.replica.grads(), step, self.params, clock=step + 1)  # one call per shard
        return step + 1
