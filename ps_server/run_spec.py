"""Defaults and validation of a RunSpec, applied by the coordinator when a run is submitted."""

from __future__ import annotations

import math

from gradps.channel import MAX_PART_BYTES
from gradps.codecs import CodecError, get_codec, get_pull_codec
from gradps.v1 import run_pb2, tensor_pb2
from ps_server.optimizer import validate as validate_optimizer
from ps_server.schemes import RULES

# Workers of one run. Runs start first come, first served (gang scheduling), so a run that asks
# for more workers than can ever join holds up every later run until it is stopped; this bound
# only refuses the absurd (membership lists of every shard and worker grow with it).
MAX_WORKERS = 4096
# Steps per worker (about 10^12): far beyond any run, and within every uint64 step counter.
MAX_STEPS = 2**40
# Passes over the data: steps derived from epochs (workers resolve them) stay within uint64.
MAX_EPOCHS = 1e6


def with_defaults(spec: run_pb2.RunSpec) -> run_pb2.RunSpec:
    """A copy of `spec` with every unset field given its documented default."""
    out = run_pb2.RunSpec()
    out.CopyFrom(spec)
    out.model = out.model or "mlp"
    out.dataset = out.dataset or "digits"
    out.scheme = out.scheme or "sync"
    opt = out.optimizer
    opt.name = opt.name or "sgd"
    if opt.lr == 0:
        opt.lr = 0.2
    opt.schedule = opt.schedule or "constant"
    if opt.schedule == "step" and opt.gamma == 0:
        opt.gamma = 0.1
    out.batch_size = out.batch_size or 32
    if out.steps == 0 and out.epochs == 0:
        out.epochs = 50
    out.workers = out.workers or 2
    if out.codec.codec == tensor_pb2.CODEC_UNSPECIFIED:
        out.codec.codec = tensor_pb2.CODEC_NONE
    if out.pull_codec.codec == tensor_pb2.CODEC_UNSPECIFIED:
        out.pull_codec.codec = tensor_pb2.CODEC_NONE
    out.part_size = out.part_size or 4 * 1024 * 1024
    sp = out.scheme_params
    sp.n_push = sp.n_push or 1
    sp.n_fetch = sp.n_fetch or 1
    return out


def validate(spec: run_pb2.RunSpec) -> None:
    """Raise ValueError with a one-line, actionable message for a bad spec (defaults applied).

    Every field is checked, whichever scheme reads it: a spec the coordinator accepts must not
    fail later on a shard or a worker, nor wait for workers that can never join.
    """
    if spec.scheme not in RULES:
        raise ValueError(f"unknown scheme {spec.scheme!r}; choose one of {', '.join(sorted(RULES))}")
    validate_optimizer(spec.optimizer)
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
    try:  # the registry's own checks, as the shards make them on every pushed or pulled part
        get_codec(spec.codec)
    except CodecError as e:
        raise ValueError(f"codec: {e}") from None
    try:
        get_pull_codec(spec.pull_codec)
    except CodecError as e:
        raise ValueError(str(e)) from None
    if not 0 <= spec.jitter <= 1:
        raise ValueError(f"jitter must be a probability in [0, 1], got {spec.jitter}")
    if not 0 <= spec.straggler_factor < math.inf:
        raise ValueError(f"straggler_factor must be a finite number >= 0, got {spec.straggler_factor}")
    if spec.straggler_factor > 1 and spec.straggler_rank >= spec.workers:
        raise ValueError(f"straggler rank {spec.straggler_rank} is not below workers={spec.workers}")
    sp = spec.scheme_params
    if not 0 <= sp.dc_lambda < math.inf:
        raise ValueError(f"dc_lambda must be a finite number >= 0, got {sp.dc_lambda}")
    for name in ("alpha", "alpha_min"):  # 0: the default
        if not 0 <= getattr(sp, name) <= 1:
            raise ValueError(f"{name} must be in (0, 1] (0: the default), got {getattr(sp, name)}")
