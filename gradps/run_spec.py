"""Defaults and validation of a RunSpec: the coordinator applies them to every submitted run, the
CLI and the SDK check a spec with them before submitting it."""

from __future__ import annotations

import math

from gradps.channel import MAX_PART_BYTES
from gradps.codec_table import CodecError, check_codec, check_pull_codec
from gradps.optimizer_spec import validate as validate_optimizer
from gradps.placement import DEFAULT_PART_SIZE
from gradps.schemes import DEFAULT_SCHEME, default_params, fill_unset, get_scheme, validate_params
from gradps.tasks import DATASET_TASKS, MODEL_TASKS, check_task
from gradps.v1 import run_pb2, tensor_pb2

# Workers of one run. A run that asks for more workers than the cluster has live waits without
# holding up later runs (ps_server/coordinator.py); this bound only refuses the absurd
# (membership lists of every shard and worker grow with it).
MAX_WORKERS = 4096
# Steps per worker (about 10^12): far beyond any run, and within every uint64 step counter.
MAX_STEPS = 2**40
# A run's membership changes (a worker lost, a new one in a lost one's rank) at most this many
# times per worker: the coordinator gives no lost rank to a new worker beyond it, and a shard
# refuses a larger epoch, which would lock every later change out.
MEMBERSHIP_CHANGES_PER_WORKER = 32
# Passes over the data: steps derived from epochs (workers resolve them) stay within uint64.
MAX_EPOCHS = 1e6
# THE defaults of a run, listed in proto/gradps/v1/run.proto's header: the coordinator fills them
# in on submit (`with_defaults`), the CLI's options and the SDK start from them (`default_spec`).
# Keys are field paths. A field with explicit presence (`optional` in the proto: 0 is a value of
# its own) takes its default only when absent, any other field when it is 0 or empty. SchemeParams
# take theirs from the scheme registry (gradps/schemes.py) by the same rule.
DEFAULTS: dict[str, str | int | float] = {
    "model": "mlp",
    "dataset": "digits",
    "scheme": DEFAULT_SCHEME,
    "batch_size": 32,
    "workers": 2,
    "part_size": DEFAULT_PART_SIZE,
    "eval_every": 50,
    "codec.codec": tensor_pb2.CODEC_NONE,
    "pull_codec.codec": tensor_pb2.CODEC_NONE,
    "optimizer.name": "sgd",
    "optimizer.lr": 0.2,
    "optimizer.schedule": "constant",
    "optimizer.gamma": 0.1,
}
# Passes over the data when neither `steps` nor `epochs` is given.
DEFAULT_EPOCHS = 50.0


def with_defaults(spec: run_pb2.RunSpec) -> run_pb2.RunSpec:
    """A copy of `spec` with every unset field given its default (DEFAULTS)."""
    out = run_pb2.RunSpec()
    out.CopyFrom(spec)
    for path, value in DEFAULTS.items():
        *outer, name = path.split(".")
        message = out
        for field in outer:
            message = getattr(message, field)
        has_presence = message.DESCRIPTOR.fields_by_name[name].has_presence
        if not (message.HasField(name) if has_presence else getattr(message, name)):
            setattr(message, name, value)
    if out.steps == 0 and out.epochs == 0:
        out.epochs = DEFAULT_EPOCHS
    fill_unset(out.scheme_params)
    return out


def default_spec() -> run_pb2.RunSpec:
    """The run nobody chose anything for: every default of DEFAULTS and the scheme registry set.
    The CLI's and the SDK's defaults."""
    return with_defaults(run_pb2.RunSpec(scheme_params=default_params()))


def validate(spec: run_pb2.RunSpec) -> None:
    """Raise ValueError with a one-line, actionable message for a bad spec (defaults applied).

    Every field is checked, whichever scheme reads it: a spec the coordinator accepts must not
    fail later on a shard or a worker, nor wait for workers that can never join.
    """
    get_scheme(spec.scheme)  # an unknown scheme is refused here
    validate_optimizer(spec.optimizer)
    _validate_sizes(spec)
    _validate_codecs(spec)
    _validate_slowdowns(spec)
    validate_params(spec.scheme_params)
    _validate_model_and_dataset(spec)
    if spec.scheme_params.backup_workers >= spec.workers:  # every step needs one gradient at least
        raise ValueError(
            f"backup_workers (--backup-workers) must be below workers={spec.workers}, "
            f"got {spec.scheme_params.backup_workers}"
        )


def _validate_model_and_dataset(spec: run_pb2.RunSpec) -> None:
    """Built-in names known, and a built-in model given a built-in dataset of its task; import paths
    (package.module:function) are resolved by the workers."""
    if ":" not in spec.model and spec.model not in MODEL_TASKS:
        raise ValueError(
            f"unknown model {spec.model!r}; choose one of {', '.join(MODEL_TASKS)} or package.module:function"
        )
    if ":" not in spec.dataset and spec.dataset not in DATASET_TASKS:
        raise ValueError(
            f"unknown dataset {spec.dataset!r}; choose one of {', '.join(DATASET_TASKS)} or package.module:function"
        )
    if spec.model in MODEL_TASKS and spec.dataset in DATASET_TASKS:
        check_task(spec.model, spec.dataset, DATASET_TASKS[spec.dataset])


def _validate_sizes(spec: run_pb2.RunSpec) -> None:
    if not 1 <= spec.workers <= MAX_WORKERS:
        raise ValueError(f"workers must be in [1, {MAX_WORKERS}], got {spec.workers}")
    if spec.batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if spec.steps > MAX_STEPS:
        raise ValueError(f"steps must be at most {MAX_STEPS}, got {spec.steps}")
    if not 0 <= spec.epochs <= MAX_EPOCHS:  # also false for NaN
        raise ValueError(f"epochs must be a number in [0, {MAX_EPOCHS:g}], got {spec.epochs}")
    if not 0 < spec.part_size <= MAX_PART_BYTES:
        raise ValueError(f"part_size must be in (0, 64 MiB], got {spec.part_size}")
    if not 0 <= spec.checkpoint_every_seconds < math.inf:
        raise ValueError(f"checkpoint_every_seconds must be a finite number >= 0, got {spec.checkpoint_every_seconds}")


def _validate_codecs(spec: run_pb2.RunSpec) -> None:
    try:  # the registry's own checks, as the shards make them on every pushed or pulled part
        check_codec(spec.codec)
    except CodecError as e:
        raise ValueError(f"codec: {e}") from None
    try:
        check_pull_codec(spec.pull_codec)
    except CodecError as e:
        raise ValueError(str(e)) from None


def _validate_slowdowns(spec: run_pb2.RunSpec) -> None:
    if not 0 <= spec.jitter <= 1:
        raise ValueError(f"jitter must be a probability in [0, 1], got {spec.jitter}")
    if not 0 <= spec.straggler_factor < math.inf:
        raise ValueError(f"straggler_factor must be a finite number >= 0, got {spec.straggler_factor}")
    if spec.straggler_factor > 1 and spec.straggler_rank >= spec.workers:
        raise ValueError(f"straggler rank {spec.straggler_rank} is not below workers={spec.workers}")


def total_steps(spec: run_pb2.RunSpec, world: int, train_size: int) -> int:
    """Steps per worker: `steps`, or `epochs` passes over an equal 1/P share of the data.

    Every rank derives the same number from the global size, so `sync` ranks never disagree.
    """
    if spec.steps:
        return spec.steps
    per_epoch = max(1, (train_size // world) // spec.batch_size)
    return max(1, math.ceil(spec.epochs * per_epoch))
