"""pseudosync: update with a predicted gradient while the current step's reduction runs.

    g_t^i <- grad(w_t);  push g_t^i without waiting;  the shards reduce G_t = mean_i g_t^i
    h_t = a_t * G_{t-1} + (1 - a_t) * h_{t-1}          (predicted gradient, exponential smoothing)
    w_{t+1} <- opt(w_t, h_t)

a_t adapts from how well history predicted the newest global gradient: c = cos(h_{t-1}, G_{t-1});
a good prediction (c near 1) trusts history more (smaller a), a poor one less:
a_t = clip((a_{t-1} + (1 - c)) / 2, a_min, 1). Every quantity is global, so replicas stay
bit-identical. `fixed_alpha` keeps a fixed; a = 1 is the plain one-step-delayed gradient.

An optimizer that keeps its own moving average of gradients (SGD momentum, Adam's first moment)
already smooths them: a second, adaptive smoothing in front of it compounds the lag (at momentum
0.9 the run never reached 95% on digits; adaptive with the momentum lowered by 1 - a took 530
steps; a = 1 took 230, as sync's 110-210). So with such an optimizer a = 1 unless a fixed a
is asked for.

The replica lives here alone, so rank 0 hands it in at the start of every cut (gradps/cuts.py:
the shards checkpoint that step once they hold it, ps_server/schemes/pseudosync.py). Where the run
goes back to a checkpoint (a shard restarted, a new worker enters, the run resumes), every worker
takes that step's replica from the shards, with the prediction and the optimizer's state afresh:
the replicas are one again.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import torch

from gpu_worker.schemes.base import Replica, WorkerScheme
from gradps.errors import RolledBack
from gradps.optimizer import ScheduledOptimizer
from gradps.optimizer_spec import averages_gradients


class PseudosyncWorker(WorkerScheme):
    def __init__(self, replica: Replica) -> None:
        super().__init__(replica)
        sp = replica.spec.scheme_params
        self.alpha = sp.alpha or 0.5
        self.alpha_min = sp.alpha_min or 0.1
        self.adaptive = not sp.fixed_alpha
        if self.adaptive and averages_gradients(replica.spec.optimizer):
            self.alpha, self.adaptive = 1.0, False
        self._alpha_at_start = self.alpha
        self.hands_in = replica.assignment.rank == 0
        self.optimizer = ScheduledOptimizer(list(self.params.values()), replica.spec.optimizer, replica.total_steps)
        self.predicted: dict[str, torch.Tensor] | None = None
        # One thread each: pushes go out in step order, and G_t is fetched while the worker
        # computes step t + 1 (the wait for the reduction overlaps compute).
        self._pusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pseudosync-push")
        self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pseudosync-fetch")
        self._pushing: Future | None = None
        self._fetching: Future | None = None

    def start(self) -> None:
        """The initial replica; past step 0 (joining, resumed), the replica handed in there."""
        self._take_up(self.replica.start_step)

    def after_backward(self, step: int) -> int:
        grads = {n: g.clone() for n, g in self.replica.grads().items()}
        if self._pushing is not None:
            self._pushing.result()  # surface a failed push; normally long done
        self._pushing = self._pusher.submit(self.client.push, grads, step)
        if self._fetching is not None:
            self._apply_global(self._fetching.result())
        self._fetching = self._fetcher.submit(self._fetch, step)
        following = step + 1
        if self.hands_in and self.client.cuts.is_cut(following) and following < self.replica.total_steps:
            # The replica at the start of the checkpoint step, before its gradient is pushed.
            self.client.register(self.params, overwrite=True, replica_step=following)
        return following

    def _fetch(self, step: int) -> dict[str, torch.Tensor]:
        """G_step, once every live worker pushed step `step` (runs in the background)."""
        G = {n: torch.empty_like(p) for n, p in self.params.items()}
        self.client.pull_gradient(step, G)
        return G

    def _apply_global(self, G: dict[str, torch.Tensor]) -> None:
        """Form the predicted gradient from G_{t-1}, update the replica."""
        if self.predicted is None:
            self.predicted = {n: g.clone() for n, g in G.items()}
        else:
            if self.adaptive:
                self.alpha = self._adapt(self.predicted, G)
            for name, h in self.predicted.items():
                h.mul_(1.0 - self.alpha).add_(G[name], alpha=self.alpha)
        for name, p in self.params.items():
            p.grad = self.predicted[name]
        self.optimizer.step()
        for p in self.params.values():
            p.grad = None

    def _adapt(self, predicted: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> float:
        dot = sum(float((predicted[n] * actual[n]).sum(dtype=torch.float64)) for n in actual)
        norm_h = sum(float(predicted[n].pow(2).sum(dtype=torch.float64)) for n in actual) ** 0.5
        norm_g = sum(float(actual[n].pow(2).sum(dtype=torch.float64)) for n in actual) ** 0.5
        cosine = dot / (norm_h * norm_g) if norm_h > 0 and norm_g > 0 else 0.0
        return min(1.0, max(self.alpha_min, (self.alpha + (1.0 - cosine)) / 2))

    def went_back(self, step: int) -> None:
        """The run went back to its checkpoint at `step`: the exchanges of the abandoned steps end
        (told so too), and the replica becomes the one handed in there."""
        for pending in (self._pushing, self._fetching):
            if pending is not None:
                with contextlib.suppress(RolledBack, grpc.RpcError):
                    pending.result()
        self._pushing = self._fetching = None
        self._take_up(step)

    def _take_up(self, step: int) -> None:
        """Start at `step` as every other worker does: the shards' replica (handed in at `step`,
        the initial one at 0), the prediction and the optimizer afresh at that point of the
        schedule, and G_{step-1} to apply after this step's push (as the pipeline had it)."""
        self.client.pull(self.params)
        self.predicted, self.alpha = None, self._alpha_at_start
        self.optimizer = ScheduledOptimizer(
            list(self.params.values()), self.replica.spec.optimizer, self.replica.total_steps
        )
        self.optimizer.updates = max(0, step - 1)  # applied after steps 1 .. step-1
        if step:
            self._fetching = self._fetcher.submit(self._fetch, step - 1)

    def finish(self, steps_done: int) -> None:
        """Apply the last step's global gradient; rank 0 publishes the replica for export."""
        if self._pushing is not None:
            self._pushing.result()
        if self._fetching is not None:
            self._apply_global(self._fetching.result())
        self._pusher.shutdown(wait=True)
        self._fetcher.shutdown(wait=True)
        if self.replica.assignment.rank == 0:  # the last hand-in: a completed run's checkpoint holds it
            self.client.register(self.params, overwrite=True, replica_step=self.replica.total_steps)

    def holds_final_model(self) -> bool:
        return True  # the replicas applied the same global gradients: bit-identical
