"""sync: push step t's gradient, then wait for the weights of step t+1."""

from __future__ import annotations

from gpu_worker.schemes.base import WorkerScheme


class SyncWorker(WorkerScheme):
    """Every worker computes on the same weights; the shards apply one mean update per step."""

    def start(self) -> None:
        self.client.pull(self.params, min_version=0)

    def after_backward(self, step: int) -> int:
        # One round trip per shard: the push, then the weights of step t+1 once the step completes.
        self.client.push_pull(self.replica.grads(), step, self.params, min_version=step + 1)
        return step + 1

    def finish(self, steps_done: int) -> None:
        """The replica already holds the final global weights after the last pull."""

    def holds_final_model(self) -> bool:
        return True  # every replica pulled the weights of the last step
