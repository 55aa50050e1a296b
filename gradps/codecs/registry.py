"""The one codec registry: `CodecParams` (wire) and "name[:arg]" strings (CLI) to codecs.

Each codec class registers itself through its class attributes (name, enum, params, pull); the
tables, the CLI syntax, parsing and formatting are derived from `CODECS` alone.
"""

from __future__ import annotations

import numpy as np
import torch

from gradps.codecs.base import Codec, CodecError
from gradps.codecs.bf16 import Bf16Codec
from gradps.codecs.fp16 import Fp16Codec
from gradps.codecs.int8 import Int8Codec
from gradps.codecs.none import NoneCodec
from gradps.codecs.randk import RandKCodec
from gradps.codecs.sign import SignCodec
from gradps.codecs.sparse import check_ratio, ratio_text
from gradps.codecs.topk import TopKCodec
from gradps.v1 import tensor_pb2

# Every codec, in the order the CLI lists them.
CODECS: tuple[type[Codec], ...] = (NoneCodec, Fp16Codec, Bf16Codec, Int8Codec, TopKCodec, RandKCodec, SignCodec)

# How the CLI writes each CodecParams field a codec may take: the ":ARG" suffix, and whether the
# codec needs it (a ratio) or may go without (stochastic rounding).
_ARGUMENTS: dict[str, tuple[str, bool]] = {"ratio": (":RATIO", True), "stochastic_rounding": (":stochastic", False)}


def _by_enum() -> dict[int, type[Codec]]:
    table: dict[int, type[Codec]] = {c.enum: c for c in CODECS}
    enums = {v for v in tensor_pb2.Codec.values() if v != tensor_pb2.CODEC_UNSPECIFIED}
    if len(table) != len(CODECS) or set(table) != enums:
        raise ImportError("gradps.codecs: every Codec enum value but UNSPECIFIED needs exactly one codec class")
    fields = set(tensor_pb2.CodecParams.DESCRIPTOR.fields_by_name) - {"codec"}
    if set(_ARGUMENTS) != fields or any(set(c.params) - fields for c in CODECS):
        raise ImportError("gradps.codecs: codec params must be CodecParams fields with a CLI form")
    return table


# Codec enum value -> codec class (CODEC_UNSPECIFIED means CODEC_NONE).
_CODECS: dict[int, type[Codec]] = _by_enum()
_BY_NAME = {c.name: c for c in CODECS}
# What a pull may ask the weights in.
_PULL = frozenset(c.enum for c in CODECS if c.pull)
# CodecParams field -> the names of the codecs that take it.
_TAKEN_BY = {field: [c.name for c in CODECS if field in c.params] for field in _ARGUMENTS}


def _words(names: list[str], last: str = "and") -> str:
    return ", ".join(names[:-1]) + f" {last} {names[-1]}" if len(names) > 1 else "".join(names)


def codec_forms(*, pull: bool = False) -> list[str]:
    """The CLI forms of every codec (those a pull may use with `pull`), e.g. "topk:RATIO"."""
    forms = []
    for codec in CODECS:
        if pull and not codec.pull:
            continue
        suffixes = [_ARGUMENTS[p] for p in codec.params]
        if not any(required for _, required in suffixes):
            forms.append(codec.name)
        forms.extend(codec.name + suffix for suffix, _ in suffixes)
    return forms


def codec_syntax(*, pull: bool = False) -> str:
    """The accepted CLI strings in one line, for help texts and error messages."""
    forms = codec_forms(pull=pull)
    return ", ".join(forms) + (" (0 < RATIO <= 1)" if any("RATIO" in f for f in forms) else "")


_SYNTAX = codec_syntax()


def _codec_class(params: tensor_pb2.CodecParams) -> type[Codec]:
    codec = _CODECS.get(params.codec or tensor_pb2.CODEC_NONE)
    if codec is None:
        raise CodecError(f"unknown codec {params.codec}")
    return codec


def get_codec(params: tensor_pb2.CodecParams, *, generator: torch.Generator | None = None) -> Codec:
    """The codec for `params`; `generator` drives randk and stochastic int8 (torch's default when None).

    Raises CodecError on an unknown codec or parameters that do not belong to it.
    """
    codec = _codec_class(params)
    if "ratio" in codec.params:
        check_ratio(params.ratio, codec.name)
    for field, takers in _TAKEN_BY.items():
        value = getattr(params, field)
        if value and field not in codec.params:
            raise CodecError(f"{codec.name}: {field} is for {_words(takers)} only, got {value}")
    return codec.from_params(params, generator)


def get_pull_codec(params: tensor_pb2.CodecParams) -> Codec:
    """`get_codec` for a pull (PullRequest.codec, RunSpec.pull_codec): CodecError, its message
    one line that starts with "pull codec", unless `params` is a valid codec that may be pulled."""
    if (params.codec or tensor_pb2.CODEC_NONE) not in _PULL:
        raise CodecError(f"pull codec must be {_words(codec_forms(pull=True), 'or')}")
    try:
        return get_codec(params)
    except CodecError as e:
        raise CodecError(f"pull codec: {e}") from None


def parse_codec(text: str) -> tensor_pb2.CodecParams:
    """Parse a CLI codec string, one of `codec_forms()` ("none", "int8:stochastic", "topk:0.01",
    ...). Raises ValueError with the accepted forms on anything else."""
    name, sep, arg = text.strip().lower().partition(":")
    codec = _BY_NAME.get(name)
    if codec is None:
        raise ValueError(f"unknown codec {text!r}; expected one of: {_SYNTAX}")
    if "ratio" in codec.params:
        return tensor_pb2.CodecParams(codec=codec.enum, ratio=_parse_ratio(text, name, sep, arg))
    if sep and "stochastic_rounding" in codec.params and arg == "stochastic":
        return tensor_pb2.CodecParams(codec=codec.enum, stochastic_rounding=True)
    if sep:
        raise ValueError(f"codec {text!r}: {name} takes no {arg!r} argument; expected one of: {_SYNTAX}")
    return tensor_pb2.CodecParams(codec=codec.enum)


def _parse_ratio(text: str, name: str, sep: str, arg: str) -> float:
    if not sep:
        raise ValueError(f"codec {text!r} needs a ratio, e.g. {name}:0.01")
    try:
        ratio = float(arg)
    except ValueError:
        raise ValueError(f"codec {text!r}: ratio {arg!r} is not a number") from None
    # The ratio travels as float32: also reject what float32 rounds to 0.
    if not (0.0 < ratio <= 1.0 and np.float32(ratio) > 0):
        raise ValueError(f"codec {text!r}: ratio must be in (0, 1]")
    return ratio


def format_codec(params: tensor_pb2.CodecParams) -> str:
    """The CLI string for `params`, the inverse of `parse_codec`; CodecError if `params` is invalid."""
    get_codec(params)  # same validation as on the wire
    codec = _codec_class(params)
    if "ratio" in codec.params:
        return f"{codec.name}:{ratio_text(params.ratio)}"
    if params.stochastic_rounding:
        return f"{codec.name}:stochastic"
    return codec.name
