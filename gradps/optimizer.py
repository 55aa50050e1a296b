"""The torch optimizer a shard applies to each part (and a worker to its model, in the schemes whose
model lives on the workers), following a run's OptimizerSpec (`gradps.optimizer_spec`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gradps.optimizer_spec import learning_rate, validate_terms
from gradps.placement import PartKey
from gradps.v1 import run_pb2

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def kernels(params: Sequence[torch.Tensor]) -> dict[str, bool]:
    """torch's fused kernels (one pass over memory per step) where every parameter allows them,
    else foreach kernels (one launch per op over all tensors). Fused Adam on CPU is ~6x faster
    than foreach, which makes several passes (docs/performance.md)."""
    fused_ok = all(p.dtype in _FUSED_DTYPES and p.device.type in ("cpu", "cuda") for p in params)
    return {"fused": True} if fused_ok and params else {"foreach": True}


def make_optimizer(params: Sequence[torch.Tensor], spec: run_pb2.OptimizerSpec) -> torch.optim.Optimizer:
    """The torch optimizer a spec names, over `params` (fused or foreach kernels: see `kernels`)."""
    if spec.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=spec.lr,
            momentum=spec.momentum,
            nesterov=spec.nesterov,
            weight_decay=spec.weight_decay,
            **kernels(params),
        )
    cls = torch.optim.Adam if spec.name == "adam" else torch.optim.AdamW
    return cls(
        params,
        lr=spec.lr,
        betas=(spec.beta1 or 0.9, spec.beta2 or 0.999),
        eps=spec.eps or 1e-8,
        weight_decay=spec.weight_decay,
        **kernels(params),
    )


class ScheduledOptimizer:
    """A torch optimizer whose learning rate follows the spec's schedule, one update at a time.

    Schemes whose model lives on the workers (wagma, pseudosync) use it for the local update; a
    shard's ShardOptimizer follows the same rule and schedule, so every scheme applies the same
    optimizer.
    """

    def __init__(self, params: Sequence[torch.Tensor], spec: run_pb2.OptimizerSpec, total_steps: int) -> None:
        self.spec = spec
        self.total_steps = total_steps
        self.updates = 0
        self.opt = make_optimizer(params, spec)

    def step(self) -> None:
        """One update from the gradients in the parameters' .grad."""
        self.opt.param_groups[0]["lr"] = learning_rate(self.spec, self.updates, self.total_steps)
        self.opt.step()
        self.updates += 1


class ShardOptimizer:
    """One torch optimizer over every part a shard holds in a run. The parts that a push (asgd,
    ssp) or a completed step (sync) updates together take one fused step over all of them: a step
    per part pays the optimizer's Python and kernel-launch overhead once per part, which on a GPU
    costs more than the update of a 4 MiB part itself (docs/performance.md, "The shard's optimizer
    update"). Every rule is elementwise, so the result is exactly that of one optimizer per part:
    each part keeps its own state and its own position in the learning-rate schedule."""

    def __init__(self, values: dict[PartKey, torch.Tensor], spec: run_pb2.OptimizerSpec, total_steps: int) -> None:
        self.spec = spec
        self.total_steps = total_steps
        self.params = {key: torch.nn.Parameter(v, requires_grad=False) for key, v in values.items()}
        # Updates applied to each part so far (its position in the schedule).
        self.updates = dict.fromkeys(values, 0)
        # A shard the placement gives no part of a run has nothing to optimize.
        self.opt = make_optimizer(list(self.params.values()), spec) if values else None

    def apply(self, updates: list[tuple[PartKey, torch.Tensor, float]]) -> None:
        """w <- opt(w, grad) for each (part, grad, lr_scale), in order: a part listed twice is
        updated twice. Parts at the same schedule position and scale share one step."""
        for wave in _waves(updates):
            groups: dict[tuple[int, float], list[PartKey]] = {}
            for key, (_, lr_scale) in wave.items():
                groups.setdefault((self.updates[key], lr_scale), []).append(key)
            for (position, lr_scale), keys in groups.items():
                self._step({key: wave[key][0] for key in keys}, position, lr_scale)

    def _step(self, grads: dict[PartKey, torch.Tensor], position: int, lr_scale: float) -> None:
        """One fused step over the parts in `grads`, all at schedule `position`."""
        assert self.opt is not None  # there are parts, so there is an optimizer
        # Between steps no part holds a gradient: torch's step skips those without one.
        for key, grad in grads.items():
            self.params[key].grad = grad
        self.opt.param_groups[0]["lr"] = learning_rate(self.spec, position, self.total_steps) * lr_scale
        self.opt.step()
        for key in grads:
            self.params[key].grad = None
            self.updates[key] += 1


def _waves(updates: list[tuple[PartKey, torch.Tensor, float]]) -> list[dict[PartKey, tuple[torch.Tensor, float]]]:
    """`updates` cut into waves in which each part appears at most once, in order."""
    waves: list[dict[PartKey, tuple[torch.Tensor, float]]] = []
    for key, grad, lr_scale in updates:
        wave = next((w for w in waves if key not in w), None)
        if wave is None:
            waves.append(wave := {})
        wave[key] = (grad, lr_scale)
    return waves


# The torch optimizers a shard can apply, by class name: what `spec_of` translates.
_TORCH_OPTIMIZERS = {"SGD": "sgd", "Adam": "adam", "AdamW": "adamw"}


def spec_of(optimizer: torch.optim.Optimizer) -> run_pb2.OptimizerSpec:
    """The OptimizerSpec that makes the shards apply what a torch optimizer would: SGD (lr,
    momentum, weight_decay, nesterov), Adam and AdamW (lr, betas, eps, weight_decay), read from
    its param groups. ValueError (one line) for any other optimizer or setting the shards cannot
    apply. The inverse of `make_optimizer`; schedules are the run's (OptimizerSpec.schedule)."""
    kind = type(optimizer)
    name = _TORCH_OPTIMIZERS.get(kind.__name__) if kind.__module__.startswith("torch.optim") else None
    if name is None:
        where = "torch.optim" if kind.__module__.startswith("torch.optim") else kind.__module__
        raise ValueError(f"gradps supports torch.optim.SGD, Adam and AdamW, not {where}.{kind.__qualname__}")
    groups = optimizer.param_groups
    settings = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    if any(s != settings[0] for s in settings[1:]):
        raise ValueError(f"{kind.__name__}: every param group must have the same settings (the shards apply one)")
    group = settings[0]
    for key, refused in (("maximize", True), ("amsgrad", True), ("dampening", 0)):
        if key in group and group[key] != (refused if key == "dampening" else False):
            raise ValueError(f"{kind.__name__}({key}={group[key]}) is not supported by the shards' optimizer")
    spec = run_pb2.OptimizerSpec(lr=float(group["lr"]), weight_decay=float(group["weight_decay"]))
    if name == "sgd":
        spec.name = "sgd"
        spec.momentum = float(group["momentum"])
        spec.nesterov = bool(group["nesterov"])
    else:
        spec.name = "adamw" if name == "adamw" or group.get("decoupled_weight_decay") else "adam"
        spec.beta1, spec.beta2 = (float(b) for b in group["betas"])
        spec.eps = float(group["eps"])
        if spec.beta1 == 0 or spec.eps == 0:  # 0 means the default in an OptimizerSpec
            raise ValueError(f"{kind.__name__}: beta1 and eps must be > 0 (0 means the default on the shards)")
    if not 0 < spec.lr < math.inf:
        raise ValueError(f"{kind.__name__}: learning rate must be a positive number, got {spec.lr}")
    validate_terms(spec)  # the schedule is the run's, checked with it
    return spec
