"""The optimizer a shard applies to each part, and the learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gradps.placement import PartKey
from gradps.v1 import run_pb2

OPTIMIZERS = ("sgd", "adam", "adamw")
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SCHEDULES = ("constant", "step", "cosine")


def validate(spec: run_pb2.OptimizerSpec) -> None:
    """Raise ValueError with a one-line, actionable message for a bad optimizer spec.

    Unset (0) beta1, beta2 and eps mean torch's defaults (see `make_optimizer`); every number must
    be finite: a NaN or infinity would reach the shards' parameters on the first update.
    """
    if spec.name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {spec.name!r}; choose one of {', '.join(OPTIMIZERS)}")
    if not 0 < spec.lr < math.inf:  # also false for NaN
        raise ValueError(f"learning rate must be a positive number, got {spec.lr}")
    _validate_terms(spec)
    _validate_schedule(spec)


def _validate_terms(spec: run_pb2.OptimizerSpec) -> None:
    """Momentum, weight decay, eps and Adam's betas."""
    for name in ("momentum", "weight_decay", "eps"):  # eps 0: the default
        if not 0 <= getattr(spec, name) < math.inf:
            raise ValueError(f"{name} must be a finite number >= 0, got {getattr(spec, name)}")
    if spec.nesterov and spec.momentum <= 0:
        raise ValueError("nesterov needs momentum > 0")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(spec, name) < 1:
            raise ValueError(f"{name} must be in [0, 1) (0: the default), got {getattr(spec, name)}")


def _validate_schedule(spec: run_pb2.OptimizerSpec) -> None:
    if spec.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {spec.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if not 0 <= spec.gamma <= 1:
        raise ValueError(f"gamma must be in [0, 1], got {spec.gamma}")
    if spec.schedule == "step" and (spec.step_size == 0 or spec.gamma == 0):
        raise ValueError("the step schedule needs step_size >= 1 and gamma in (0, 1]")


def learning_rate(spec: run_pb2.OptimizerSpec, update: int, total_steps: int) -> float:
    """The learning rate for a part's `update`-th update (0-based)."""
    lr = spec.lr
    if spec.warmup_steps and update < spec.warmup_steps:
        return lr * (update + 1) / spec.warmup_steps
    if spec.schedule == "step":
        return lr * spec.gamma ** (update // spec.step_size)
    if spec.schedule == "cosine":
        horizon = max(1, (spec.total_steps or total_steps) - spec.warmup_steps)
        progress = min(1.0, (update - spec.warmup_steps) / horizon)
        return lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr


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


def averages_gradients(spec: run_pb2.OptimizerSpec) -> bool:
    """Whether the optimizer keeps a moving average of the gradients: SGD with momentum, Adam and
    AdamW (their first moment)."""
    return (spec.name or "sgd") != "sgd" or spec.momentum > 0


def asynchrony_aware(spec: run_pb2.OptimizerSpec, workers: int) -> run_pb2.OptimizerSpec:
    """The optimizer a shard applies to P asynchronous workers' pushes.

    P workers pushing in turn add an implicit momentum of about 1 - 1/P (Mitliagkas et al. 2016,
    "Asynchrony begets momentum"), so SGD's explicit momentum mu is lowered by as much (0.9 with
    4 workers: 0.15), and the learning rate is set so that a push's effective step,
    lr' / (1 - mu'), is 1/P of the run's, lr / (1 - mu): P pushes move the model as far as one
    synchronous step. Measured on digits (4 workers, lr 0.05, momentum 0.9; docs/schemes.md):
    momentum lowered alone took 230-260 steps to 95%, the lr divided by P alone 300-330, both
    170-190 (sync 110). Plain SGD and Adam are left as they are: asgd at SGD lr 0.2 reached 95%
    in 110-190 steps, at lr / P in 270-280, and with Adam's moments as they are it converges."""
    out = run_pb2.OptimizerSpec()
    out.CopyFrom(spec)
    if (out.name or "sgd") == "sgd" and out.momentum > 0:
        p = max(1, workers)
        out.momentum = max(0.0, spec.momentum - (1.0 - 1.0 / p))
        out.lr = spec.lr * (1.0 - out.momentum) / ((1.0 - spec.momentum) * p)
        out.nesterov = out.nesterov and out.momentum > 0
    return out


def model_averaged(spec: run_pb2.OptimizerSpec, workers: int) -> run_pb2.OptimizerSpec:
    """The optimizer of a worker whose model is averaged with P - 1 others' after each local step
    (wagma).

    Averaging P SGD steps on batches of B is one SGD step on their union (the mean gradient), so
    SGD is left as it is. An Adam step's size is about lr per coordinate whatever the gradient's
    noise: where the noise dominates, the average of P such steps moves sqrt(P) times less along
    the signal than one Adam step on the union's mean gradient, whose noise is sqrt(P) times
    smaller. So Adam's and AdamW's lr is multiplied by sqrt(P); AdamW's decoupled decay, lr * wd
    per step and no noise, stays as it was. Measured on digits (4 workers,
    Adam lr 0.001, docs/schemes.md): 300-470 steps to 95% and 3 of 4 straggler runs never there;
    with the lr times sqrt(P) 200-280 steps (sync 210) and 350-420 under the straggler."""
    out = run_pb2.OptimizerSpec()
    out.CopyFrom(spec)
    if (out.name or "sgd") != "sgd":
        scale = math.sqrt(max(1, workers))
        out.lr = spec.lr * scale
        if out.name == "adamw":
            out.weight_decay = spec.weight_decay / scale
    return out


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
    _validate_terms(spec)  # the schedule is the run's, checked with it
    return spec
