"""The one codec registry: each entry of `gradps.codec_table` bound to the class that encodes and
decodes it, and `CodecParams` (wire) to a codec.

Each codec class names its entry (`Codec.entry`); the table holds everything else that names a
codec (CLI forms, checks), so that the coordinator and the CLI need no torch to check a spec.
"""

from __future__ import annotations

import torch

from gradps.codec_table import ENTRIES, check_codec
from gradps.codecs.base import Codec
from gradps.codecs.bf16 import Bf16Codec
from gradps.codecs.fp16 import Fp16Codec
from gradps.codecs.int8 import Int8Codec
from gradps.codecs.none import NoneCodec
from gradps.codecs.randk import RandKCodec
from gradps.codecs.sign import SignCodec
from gradps.codecs.topk import TopKCodec
from gradps.v1 import tensor_pb2

# Every codec, in the table's order.
CODECS: tuple[type[Codec], ...] = (NoneCodec, Fp16Codec, Bf16Codec, Int8Codec, TopKCodec, RandKCodec, SignCodec)


def _by_enum() -> dict[int, type[Codec]]:
    if [c.entry for c in CODECS] != list(ENTRIES):
        raise ImportError("gradps.codecs: every entry of gradps.codec_table needs exactly one codec class, in order")
    return {c.entry.enum: c for c in CODECS}


# Codec enum value -> codec class.
_CODECS: dict[int, type[Codec]] = _by_enum()


def get_codec(params: tensor_pb2.CodecParams, *, generator: torch.Generator | None = None) -> Codec:
    """The codec for `params`; `generator` drives randk and stochastic int8 (torch's default when None).

    Raises CodecError on an unknown codec or parameters that do not belong to it.
    """
    return _CODECS[check_codec(params).enum].from_params(params, generator)
