"""CODEC_NONE: raw float32 values (the parameter server's tensors are float32)."""

from __future__ import annotations

import torch

from gradps.codecs.dense import DenseFloatCodec
from gradps.v1 import tensor_pb2


class NoneCodec(DenseFloatCodec):
    """Lossless: `count` float32 values, little-endian."""

    name = "none"
    enum = tensor_pb2.CODEC_NONE
    pull = True
    lossy = False
    wire_dtype = torch.float32
