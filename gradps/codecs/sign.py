"""CODEC_SIGN: a float32 scale s, then ceil(count / 8) bytes of sign bits, least significant bit
first; bit 1 -> +s, bit 0 -> -s.

s = mean |x| (EF-signSGD, Karimireddy et al. 2019). The encoder sets bit 1 for x > 0 and bit 0
otherwise, so zeros are sent as -s (error feedback takes the difference back). Padding bits in the
last byte are 0 and ignored by the decoder.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gradps.codec_table import BY_NAME
from gradps.codecs.base import Codec, CodecError, check_length, empty_values, pack_scale, read_scale, view_as


class SignCodec(Codec):
    """1 bit per element plus one scale per part."""

    entry = BY_NAME["sign"]

    def payload_bytes(self, count: int) -> int:
        return 4 + (count + 7) // 8

    def max_payload_bytes(self, count: int) -> int:
        return self.payload_bytes(count)

    def _encode(self, values: torch.Tensor, peak: float) -> bytes:
        count = values.numel()
        total = torch.linalg.vector_norm(values, 1).item() if count else 0.0
        if not math.isfinite(total):  # the values are finite, their float32 sum is not
            raise CodecError(f"{self.entry.name}: sum of |value| overflows float32")
        scale = total / count if count else 0.0
        bits = np.packbits((values > 0).numpy(), bitorder="little")
        return pack_scale(scale) + bits.tobytes()

    def _decode(self, payload: memoryview, count: int, device: torch.device) -> torch.Tensor:
        check_length(payload, self.payload_bytes(count), self.entry.name, count)
        scale = read_scale(payload, self.entry.name)
        packed = view_as(payload, torch.uint8, 4, (count + 7) // 8).to(device)
        # Unpack on the device: byte b, bit j (LSB first) is element 8 * b + j.
        shifts = torch.arange(8, dtype=torch.uint8, device=device)
        bits = packed.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(1).view(-1)[:count]
        out = empty_values(count, device).copy_(bits)  # 0 or 1
        return out.mul_(2.0 * scale).sub_(scale)
