"""Dense float payloads: `count` values of one float type, little-endian (none, fp16, bf16)."""

from __future__ import annotations

from typing import ClassVar

import torch

from gradps.codecs.base import Codec, CodecError, check_length, empty_values, require_finite, tensor_bytes, view_as


class DenseFloatCodec(Codec):
    """Sends every value cast to `wire_dtype`; decoding widens back to float32 on the device."""

    # Element type on the wire.
    wire_dtype: ClassVar[torch.dtype]

    def payload_bytes(self, count: int) -> int:
        return count * self.wire_dtype.itemsize

    def max_payload_bytes(self, count: int) -> int:
        return self.payload_bytes(count)

    def _encode(self, values: torch.Tensor, peak: float) -> bytes:
        limit = torch.finfo(self.wire_dtype).max
        if peak > limit:  # would round to Inf (or to the limit: refuse both, the user picks a codec)
            raise CodecError(f"{self.entry.name}: |value| up to {peak:g} exceeds {limit:g} (use bf16 or int8)")
        return tensor_bytes(values.to(self.wire_dtype))

    def _decode(self, payload: memoryview, count: int, device: torch.device) -> torch.Tensor:
        check_length(payload, self.payload_bytes(count), self.entry.name, count)
        # Move the raw (possibly narrower) buffer first, widen on the device; copy_ also detaches
        # the result from the payload's memory.
        out = empty_values(count, device).copy_(view_as(payload, self.wire_dtype, 0, count).to(device))
        require_finite(out, f"{self.entry.name}: decoded values")
        return out
