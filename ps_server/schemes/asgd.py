"""asgd (GPU A-SGD, Downpour style): apply every push at once.

Options, off by default: staleness-aware learning rate lr / max(1, tau) (Zhang et al. 2016), and
DC-ASGD delay compensation g + lambda * g * g * (w_now - w_pulled) (Zheng et al. 2017), with the
adaptive variant lambda_t = lambda / sqrt(mean square of g).
"""

from __future__ import annotations

import torch

from gradps.optimizer_spec import asynchrony_aware
from gradps.placement import PartKey
from gradps.v1 import run_pb2
from ps_server.run_state import Part, Push, RunState
from ps_server.saved_state import Saved, part_of
from ps_server.schemes.base import ShardRule

_MEAN_SQUARE_MOMENTUM = 0.95


class AsgdRule(ShardRule):
    """w <- opt(w, g) on arrival; staleness = version now - version the gradient was computed on."""

    def __init__(self, run: RunState) -> None:
        super().__init__(run)
        sp = run.spec.scheme_params
        self.staleness_lr = sp.staleness_lr
        self.dc_lambda = sp.dc_lambda
        self.dc_adaptive = sp.dc_adaptive
        # Each worker's clock: its pushes' highest step plus one (ssp's bound; every clock at the
        # run's steps: the weights are final).
        self.clock: dict[int, int] = {}
        # DC-ASGD: the weights each worker last pulled (its "backup" in the paper).
        self.pulled: dict[int, dict[PartKey, torch.Tensor]] = {}
        self.mean_square: dict[PartKey, torch.Tensor] = {}

    @staticmethod
    def updates_per_step(spec: run_pb2.RunSpec, workers: int) -> float:
        # Every worker's push is an update: a cosine schedule over one worker's steps reached 0
        # after 1/P of the run.
        return workers / max(1, spec.scheme_params.n_push)

    @staticmethod
    def optimizer(spec: run_pb2.RunSpec, workers: int) -> run_pb2.OptimizerSpec:
        # With the run's momentum on top of the momentum that asynchrony adds, asgd diverges.
        return asynchrony_aware(spec.optimizer, workers)

    def on_pull(self, worker_id: int, parts: list[Part]) -> None:
        if self.dc_lambda:
            backup = self.pulled.setdefault(worker_id, {})
            for p in parts:
                backup[p.key] = p.values.clone()

    def save(self, saved: Saved) -> None:
        # DC-ASGD's backups (each worker's pulled weights) and adaptive lambda's mean squares.
        saved.fields["pulled"] = [
            [worker, *key, saved.put(values)] for worker, parts in self.pulled.items() for key, values in parts.items()
        ]
        saved.fields["mean_square"] = [[*key, saved.put(ms)] for key, ms in self.mean_square.items()]
        saved.fields["clock"] = sorted(self.clock.items())

    def load(self, saved: Saved) -> None:
        for worker, name, index, tensor in saved.fields["pulled"]:
            self.pulled.setdefault(int(worker), {})[part_of([name, index])] = saved.get(tensor)
        for name, index, tensor in saved.fields["mean_square"]:
            self.mean_square[part_of([name, index])] = saved.get(tensor)
        # An asgd checkpoint written before asgd kept clocks has none: its weights are never final.
        self.clock = {int(worker): int(clock) for worker, clock in saved.fields.get("clock", [])}

    def push(self, push: Push) -> int:
        staleness = 0
        updates = []
        for key, grad in push.grads.items():
            part = self.run.parts[key]
            tau = part.version - push.versions[key]
            staleness = max(staleness, tau)
            if self.dc_lambda:
                grad = self._compensate(push.worker_id, part, grad)
            updates.append((key, grad, 1.0 / max(1, tau) if self.staleness_lr else 1.0))
            part.version += 1
        self.run.optimizer.apply(updates)  # every part of the push in one fused step
        self.clock[push.worker_id] = max(self.clock.get(push.worker_id, 0), push.step + 1)
        return staleness

    def slowest_clock(self) -> int:
        return min((self.clock.get(w, 0) for w in self.run.live_workers), default=0)

    def weights_final(self) -> bool:
        # A worker's last push is of its last step or beyond (asgd's remainder after it).
        return self.slowest_clock() >= self.run.total_steps > 0  # no live worker: clock 0

    def _compensate(self, worker_id: int, part: Part, grad: torch.Tensor) -> torch.Tensor:
        pulled = self.pulled.get(worker_id, {}).get(part.key)
        if pulled is None:
            return grad
        lam: float | torch.Tensor = self.dc_lambda
        if self.dc_adaptive:
            ms = self.mean_square.get(part.key)
            ms = (
                grad * grad
                if ms is None
                else ms.mul_(_MEAN_SQUARE_MOMENTUM).addcmul_(grad, grad, value=1 - _MEAN_SQUARE_MOMENTUM)
            )
            self.mean_square[part.key] = ms
            lam = lam / (ms.sqrt() + 1e-7)
        return grad + lam * grad * grad * (part.values - pulled)
