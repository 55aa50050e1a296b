"""CODEC_INT8: a float32 scale s, then `count` int8 values q; value = q * s.

s = max|x| / 127 and q = round(x / s) clipped to [-127, 127], so the error per element is at most
s / 2. With stochastic rounding q = floor(x / s + u), u ~ U[0, 1): unbiased, E[q * s] = x.
"""

from __future__ import annotations

import numpy as np
import torch

from gradps.codec_table import BY_NAME
from gradps.codecs.base import Codec, CodecError, check_length, empty_values, pack_scale, read_scale, view_as
from gradps.v1 import tensor_pb2

# Elements quantized per step: the float temporary (1 MiB) stays in cache instead of allocating
# and faulting in a full-size float32 array per operation (2.5x faster at 64 MiB).
_CHUNK = 1 << 18
_TINY = float(torch.finfo(torch.float32).tiny)
# Largest scale whose products q * s, |q| <= 128, stay finite in float32.
_MAX_SCALE = float(torch.finfo(torch.float32).max) / 128


class Int8Codec(Codec):
    """Per-part absmax scaling to int8, round to nearest (default) or stochastic."""

    entry = BY_NAME["int8"]

    def __init__(self, stochastic_rounding: bool = False, generator: torch.Generator | None = None) -> None:
        """`generator` drives stochastic rounding (torch's default generator when None)."""
        self.stochastic_rounding = stochastic_rounding
        self.generator = generator

    @classmethod
    def from_params(cls, params: tensor_pb2.CodecParams, generator: torch.Generator | None) -> Int8Codec:
        return cls(params.stochastic_rounding, generator)

    def payload_bytes(self, count: int) -> int:
        return 4 + count

    def max_payload_bytes(self, count: int) -> int:
        return 4 + count

    def encode_subtract(self, values: torch.Tensor) -> bytes:
        # Quantized and subtracted chunk by chunk while the chunk is in cache: one pass over
        # memory instead of encoding, then decoding into a full-size tensor and subtracting it.
        return self._encode(values.detach(), self._peak(values), subtract=True)

    def _encode(self, values: torch.Tensor, peak: float, subtract: bool = False) -> bytes:
        count = values.numel()
        out = np.empty(4 + count, dtype=np.uint8)
        scale = float(np.float32(peak / 127.0))
        if scale > _MAX_SCALE:
            raise CodecError(f"{self.entry.name}: |value| up to {peak:g} is too large to quantize")
        if scale < _TINY:
            # All zeros, or so small that 1/scale overflows float32: send zeros with scale 0 (error
            # feedback keeps the values in the residual).
            scale = 0.0
            out[4:] = 0
        else:
            subtract_scale = np.float32(scale) if subtract else None
            self._quantize(values.numpy(), np.float32(1.0 / scale), out[4:].view(np.int8), subtract_scale)
        out[:4] = np.frombuffer(pack_scale(scale), dtype=np.uint8)
        return out.tobytes()

    def _quantize(
        self, values: np.ndarray, inverse_scale: np.float32, q: np.ndarray, subtract_scale: np.float32 | None
    ) -> None:
        """q = quantized values; with `subtract_scale` (the scale), values -= q * scale too, in
        float32 as decoding computes it, so the residual is exactly values - decode(payload)."""
        # numpy, not torch: encoding is CPU-only, and numpy's single-threaded loops do not stall
        # at a thread barrier per op when the (shared, 2-core) machine is busy.
        scaled_buffer = np.empty(min(_CHUNK, values.size), dtype=np.float32)
        noise_buffer = torch.empty(scaled_buffer.size) if self.stochastic_rounding else None
        for start in range(0, values.size, _CHUNK):
            chunk = values[start : start + _CHUNK]
            scaled = np.multiply(chunk, inverse_scale, out=scaled_buffer[: chunk.size])
            if noise_buffer is None:
                np.rint(scaled, out=scaled)
            else:
                noise = torch.rand(chunk.size, generator=self.generator, out=noise_buffer[: chunk.size])
                np.floor(np.add(scaled, noise.numpy(), out=scaled), out=scaled)
            # x / s can exceed 127 by an ulp (s is rounded), and floor(127 + u) by one.
            np.clip(scaled, -127.0, 127.0, out=scaled)
            q[start : start + chunk.size] = scaled
            if subtract_scale is not None:
                np.subtract(chunk, np.multiply(scaled, subtract_scale, out=scaled), out=chunk)

    def _decode(self, payload: memoryview, count: int, device: torch.device) -> torch.Tensor:
        check_length(payload, 4 + count, self.entry.name, count)
        scale = read_scale(payload, self.entry.name)
        if abs(scale) > _MAX_SCALE:  # q * s would overflow to Inf
            raise CodecError(f"{self.entry.name}: scale {scale:g} is too large")
        # Ship the int8 buffer (a quarter of the float32 size) to the device, dequantize there.
        out = empty_values(count, device).copy_(view_as(payload, torch.int8, 4, count).to(device))
        return out.mul_(scale)
