"""A run's OptimizerSpec: the optimizers and schedules it may name, their checks, the learning rate
of each update, and how a scheme adapts the spec to its workers. No torch here: the coordinator and
the CLI check specs with it; `gradps.optimizer` applies them."""

from __future__ import annotations

import math

from gradps.v1 import run_pb2

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "step", "cosine")


def validate(spec: run_pb2.OptimizerSpec) -> None:
    """Raise ValueError with a one-line, actionable message for a bad optimizer spec.

    Unset (0) beta1, beta2 and eps mean torch's defaults (see `gradps.optimizer.make_optimizer`);
    every number must be finite: a NaN or infinity would reach the shards' parameters on the first
    update.
    """
    if spec.name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {spec.name!r}; choose one of {', '.join(OPTIMIZERS)}")
    if not 0 < spec.lr < math.inf:  # also false for NaN
        raise ValueError(f"learning rate must be a positive number, got {spec.lr}")
    validate_terms(spec)
    _validate_schedule(spec)


def validate_terms(spec: run_pb2.OptimizerSpec) -> None:
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
