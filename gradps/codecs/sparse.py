"""Sparse payloads shared by CODEC_TOPK and CODEC_RANDK: k uint32 indices (relative to the part's
offset, strictly increasing), then k float32 values; elements not listed are zero.

Subclasses only choose which k indices to send.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from decimal import Decimal

import numpy as np
import torch

from gradps.codec_table import check_ratio, ratio_text
from gradps.codecs.base import (
    Buffer,
    Codec,
    CodecError,
    byte_view,
    check_count,
    check_out,
    require_finite,
    view_as,
    zero_values,
)
from gradps.v1 import tensor_pb2

_MAX_COUNT = 1 << 32  # indices are uint32


def keep_count(ratio: float, count: int) -> int:
    """k = max(1, ceil(ratio * count)), at most count.

    The product is exact decimal arithmetic on `ratio_text(ratio)`, so that the float32 ratio
    0.1 keeps 10 of 100 elements, not 11.
    """
    if count == 0:
        return 0
    return min(count, max(1, math.ceil(Decimal(ratio_text(ratio)) * count)))


@dataclass(frozen=True)
class SparsePart:
    """A decoded sparse part: `values` at `indices`, zero elsewhere, for a receiver that only sums
    parts (a sync shard) and so never needs the full-size tensor."""

    # Validated positions, int64, strictly increasing, each < count; on the values' device.
    indices: torch.Tensor
    # The k float32 values sent (finite).
    values: torch.Tensor
    # Elements of the whole part.
    count: int

    def add_to(self, out: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """out += alpha * self, in place (one index_add_ of k values); returns out."""
        check_out(out)
        if out.numel() != self.count:
            raise ValueError(f"sparse part of {self.count} values added to a tensor of {out.numel()}")
        return out.index_add_(0, self.indices, self.values, alpha=alpha)

    def to_dense(self) -> torch.Tensor:
        """A new full-size float32 tensor on the values' device."""
        return zero_values(self.count, self.values.device).index_copy_(0, self.indices, self.values)


class SparseCodec(Codec):
    """Sends k = keep_count(ratio, count) (index, value) pairs chosen by `select`. A receiver that
    only sums parts takes them as SparsePart (`gradps.codecs.decode_summand`)."""

    def __init__(self, ratio: float) -> None:
        """`ratio` is the fraction of elements kept, in (0, 1]."""
        self.ratio = check_ratio(ratio, self.entry.name)

    @classmethod
    def from_params(cls, params: tensor_pb2.CodecParams, generator: torch.Generator | None) -> SparseCodec:
        return cls(params.ratio)

    @abc.abstractmethod
    def select(self, values: torch.Tensor, k: int) -> torch.Tensor:
        """k distinct indices into `values`, int64, sorted increasing."""

    def payload_bytes(self, count: int) -> int:
        return 8 * keep_count(self.ratio, count)

    def max_payload_bytes(self, count: int) -> int:
        return 8 * count

    def _encode(self, values: torch.Tensor, peak: float) -> bytes:
        if values.numel() > _MAX_COUNT:
            raise CodecError(f"{self.entry.name}: a part of {values.numel()} values exceeds uint32 indices")
        k = keep_count(self.ratio, values.numel())
        indices = self.select(values, k)
        words = np.empty(2 * k, dtype=np.uint32)  # k indices, then k float32 values
        words[:k] = indices.numpy()
        words[k:].view(np.float32)[:] = values[indices].numpy()
        return words.tobytes()

    def decode_sparse(
        self, payload: Buffer, count: int, device: torch.device | str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (indices int64, values float32) on `device`, k each, indices strictly increasing,
        so that a caller can `index_add_` into an accumulator without a full-size tensor.

        Raises CodecError on a length that is not 8 * k with k <= count, an index >= count,
        indices that are not strictly increasing (repeats), or NaN/Inf values.
        """
        payload, count, device = byte_view(payload), check_count(count), torch.device(device)
        if len(payload) % 8 or len(payload) > 8 * count:
            raise CodecError(
                f"{self.entry.name}: payload is {len(payload)} bytes, expected 8 * k with k <= {count} values"
            )
        k = len(payload) // 8
        # Move the raw words to the device, widen there; uint32 is read as int32 then masked.
        indices = view_as(payload, torch.int32, 0, k).to(device).to(torch.int64).bitwise_and_(0xFFFFFFFF)
        values = view_as(payload, torch.float32, 4 * k, k).to(device, copy=True)
        if k:
            if k > 1 and not bool((indices[1:] > indices[:-1]).all()):
                raise CodecError(f"{self.entry.name}: indices are not strictly increasing (repeated or unsorted)")
            last = int(indices[-1])
            if last >= count:
                raise CodecError(f"{self.entry.name}: index {last} out of range for {count} values")
            require_finite(values, f"{self.entry.name}: values")
        return indices, values

    def add_decoded(self, payload: Buffer, out: torch.Tensor, alpha: float = 1.0) -> None:
        check_out(out)
        indices, values = self.decode_sparse(payload, out.numel(), out.device)
        out.index_add_(0, indices, values, alpha=alpha)

    def _decode(self, payload: memoryview, count: int, device: torch.device) -> torch.Tensor:
        return SparsePart(*self.decode_sparse(payload, count, device), count).to_dense()
