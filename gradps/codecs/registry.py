"""The one codec registry: `CodecParams` (wire) and "name[:arg]" strings (CLI) to codecs."""

from __future__ import annotations

from collections.abc import Callable

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

_Factory = Callable[[tensor_pb2.CodecParams, torch.Generator | None], Codec]

# Codec enum -> (CLI name, factory). CODEC_UNSPECIFIED means CODEC_NONE.
_CODECS: dict[int, tuple[str, _Factory]] = {
    tensor_pb2.CODEC_NONE: ("none", lambda p, g: NoneCodec()),
    tensor_pb2.CODEC_FP16: ("fp16", lambda p, g: Fp16Codec()),
    tensor_pb2.CODEC_BF16: ("bf16", lambda p, g: Bf16Codec()),
    tensor_pb2.CODEC_INT8: ("int8", lambda p, g: Int8Codec(p.stochastic_rounding, g)),
    tensor_pb2.CODEC_TOPK: ("topk", lambda p, g: TopKCodec(p.ratio)),
    tensor_pb2.CODEC_RANDK: ("randk", lambda p, g: RandKCodec(p.ratio, g)),
    tensor_pb2.CODEC_SIGN: ("sign", lambda p, g: SignCodec()),
}
_BY_NAME = {name: codec for codec, (name, _) in _CODECS.items()}
_SPARSE = (tensor_pb2.CODEC_TOPK, tensor_pb2.CODEC_RANDK)
_SYNTAX = "none, fp16, bf16, int8, int8:stochastic, topk:RATIO, randk:RATIO, sign (0 < RATIO <= 1)"


def get_codec(params: tensor_pb2.CodecParams, *, generator: torch.Generator | None = None) -> Codec:
    """The codec for `params`; `generator` drives randk and stochastic int8 (torch's default when None).

    Raises CodecError on an unknown codec or parameters that do not belong to it.
    """
    codec = params.codec or tensor_pb2.CODEC_NONE
    if codec not in _CODECS:
        raise CodecError(f"unknown codec {params.codec}")
    name, factory = _CODECS[codec]
    if codec in _SPARSE:
        check_ratio(params.ratio, name)
    elif params.ratio:
        raise CodecError(f"{name}: ratio is for topk and randk only, got {params.ratio}")
    if params.stochastic_rounding and codec != tensor_pb2.CODEC_INT8:
        raise CodecError(f"{name}: stochastic_rounding is for int8 only")
    return factory(params, generator)


# What a pull may ask the weights in: dense codecs without error feedback (the shard keeps none
# per worker), so the values arrive whole.
_PULL = (tensor_pb2.CODEC_NONE, tensor_pb2.CODEC_FP16, tensor_pb2.CODEC_BF16)


def get_pull_codec(params: tensor_pb2.CodecParams) -> Codec:
    """`get_codec` for a pull (PullRequest.codec, RunSpec.pull_codec): CodecError, its message
    one line that starts with "pull codec", unless `params` is none, fp16 or bf16 and valid."""
    if (params.codec or tensor_pb2.CODEC_NONE) not in _PULL:
        raise CodecError("pull codec must be none, fp16 or bf16")
    try:
        return get_codec(params)
    except CodecError as e:
        raise CodecError(f"pull codec: {e}") from None


def parse_codec(text: str) -> tensor_pb2.CodecParams:
    """Parse a CLI codec string: "none", "fp16", "bf16", "int8", "int8:stochastic", "topk:0.01",
    "randk:0.05" or "sign". Raises ValueError with the accepted forms on anything else."""
    name, sep, arg = text.strip().lower().partition(":")
    codec = _BY_NAME.get(name)
    if codec is None:
        raise ValueError(f"unknown codec {text!r}; expected one of: {_SYNTAX}")
    if codec in _SPARSE:
        if not sep:
            raise ValueError(f"codec {text!r} needs a ratio, e.g. {name}:0.01")
        try:
            ratio = float(arg)
        except ValueError:
            raise ValueError(f"codec {text!r}: ratio {arg!r} is not a number") from None
        # The ratio travels as float32: also reject what float32 rounds to 0.
        if not (0.0 < ratio <= 1.0 and np.float32(ratio) > 0):
            raise ValueError(f"codec {text!r}: ratio must be in (0, 1]")
        return tensor_pb2.CodecParams(codec=codec, ratio=ratio)
    if codec == tensor_pb2.CODEC_INT8 and sep and arg == "stochastic":
        return tensor_pb2.CodecParams(codec=codec, stochastic_rounding=True)
    if sep:
        raise ValueError(f"codec {text!r}: {name} takes no {arg!r} argument; expected one of: {_SYNTAX}")
    return tensor_pb2.CodecParams(codec=codec)


def format_codec(params: tensor_pb2.CodecParams) -> str:
    """The CLI string for `params`, the inverse of `parse_codec`; CodecError if `params` is invalid."""
    get_codec(params)  # same validation as on the wire
    name, _ = _CODECS[params.codec or tensor_pb2.CODEC_NONE]
    if params.codec in _SPARSE:
        return f"{name}:{ratio_text(params.ratio)}"
    if params.stochastic_rounding:
        return f"{name}:stochastic"
    return name
