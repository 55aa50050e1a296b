"""CODEC_FP16: IEEE binary16 values; |x| above 65504 is rejected rather than sent as Inf."""

from __future__ import annotations

import torch

from gradps.codec_table import BY_NAME
from gradps.codecs.dense import DenseFloatCodec


class Fp16Codec(DenseFloatCodec):
    """`count` binary16 values, rounded to nearest even (relative error <= 2**-11)."""

    entry = BY_NAME["fp16"]
    wire_dtype = torch.float16
