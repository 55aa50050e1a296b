"""CODEC_BF16: bfloat16 values (the upper 16 bits of each float32, after rounding)."""

from __future__ import annotations

import torch

from gradps.codec_table import BY_NAME
from gradps.codecs.dense import DenseFloatCodec


class Bf16Codec(DenseFloatCodec):
    """`count` bfloat16 values, rounded to nearest even (relative error <= 2**-8); float32's range."""

    entry = BY_NAME["bf16"]
    wire_dtype = torch.bfloat16
