"""CODEC_BF16: bfloat16 values (the upper 16 bits of each float32, after rounding)."""

from __future__ import annotations

import torch

from gradps.codecs.dense import DenseFloatCodec
from gradps.v1 import tensor_pb2


class Bf16Codec(DenseFloatCodec):
    """`count` bfloat16 values, rounded to nearest even (relative error <= 2**-8); float32's range."""

    name = "bf16"
    enum = tensor_pb2.CODEC_BF16
    pull = True
    lossy = True
    wire_dtype = torch.bfloat16
