"""CODEC_NONE: raw float32 values (the parameter server's tensors are float32)."""

from __future__ import annotations

import torch

from gradps.codec_table import BY_NAME
from gradps.codecs.dense import DenseFloatCodec


class NoneCodec(DenseFloatCodec):
    """Lossless: `count` float32 values, little-endian."""

    entry = BY_NAME["none"]
    wire_dtype = torch.float32
