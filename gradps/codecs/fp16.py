"""CODEC_FP16: IEEE binary16 values; |x| above 65504 is rejected rather than sent as Inf."""

from __future__ import annotations

import torch

from gradps.codecs.dense import DenseFloatCodec
from gradps.v1 import tensor_pb2


class Fp16Codec(DenseFloatCodec):
    """`count` binary16 values, rounded to nearest even (relative error <= 2**-11)."""

    name = "fp16"
    enum = tensor_pb2.CODEC_FP16
    pull = True
    lossy = True
    wire_dtype = torch.float16
