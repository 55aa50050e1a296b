"""Defaults and validation of a RunSpec, applied by the coordinator when a run is submitted."""

from __future__ import annotations

import math

from gradps.v1 import run_pb2, tensor_pb2
from ps_server.optimizer import validate as validate_optimizer
from ps_server.schemes import RULES


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
    """Raise ValueError with a one-line, actionable message for a bad spec (defaults applied)."""
    if spec.scheme not in RULES:
        raise ValueError(f"unknown scheme {spec.scheme!r}; choose one of {', '.join(sorted(RULES))}")
    validate_optimizer(spec.optimizer)
    if spec.workers < 1:
        raise ValueError("workers must be >= 1")
    if spec.batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if spec.epochs < 0 or not math.isfinite(spec.epochs):
        raise ValueError(f"epochs must be a non-negative number, got {spec.epochs}")
    if not 0 < spec.part_size <= 64 * 1024 * 1024:
        raise ValueError(f"part_size must be in (0, 64 MiB], got {spec.part_size}")
    if spec.pull_codec.codec not in (tensor_pb2.CODEC_NONE, tensor_pb2.CODEC_FP16, tensor_pb2.CODEC_BF16):
        raise ValueError("pull codec must be none, fp16 or bf16")
    if not 0 <= spec.jitter <= 1:
        raise ValueError(f"jitter must be a probability in [0, 1], got {spec.jitter}")
    if spec.straggler_factor > 1 and spec.straggler_rank >= spec.workers:
        raise ValueError(f"straggler rank {spec.straggler_rank} is not below workers={spec.workers}")
    if spec.codec.codec in (tensor_pb2.CODEC_TOPK, tensor_pb2.CODEC_RANDK) and not 0 < spec.codec.ratio <= 1:
        raise ValueError(f"codec ratio must be in (0, 1], got {spec.codec.ratio}")
