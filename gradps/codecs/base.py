"""The codec interface and the helpers every codec shares (payload views, validation, buffers).

A codec turns one part's values (a 1-D float32 tensor) into the payload bytes laid out as
`proto/gradps/v1/tensor.proto` describes for its `Codec` enum value, and back.
"""

from __future__ import annotations

import abc
import math
import struct
import sys
import warnings
from typing import ClassVar

import numpy as np
import torch

from gradps.codec_table import CodecEntry, CodecError
from gradps.v1 import tensor_pb2

if sys.byteorder != "little":  # payloads are little-endian and are viewed in place, never byte-swapped
    raise ImportError("gradps.codecs needs a little-endian host")

# Bytes-like payloads accepted by decoders (protobuf gives `bytes`; slices give `memoryview`).
Buffer = bytes | bytearray | memoryview

# torch warns, once per process, that a tensor over immutable `bytes` could be written through.
# The views made here are only ever read (and copied from), so spend that one warning at import,
# silently: a filter would not do, as pytest and others reset the filters around each call.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)

_SCALE = struct.Struct("<f")


class Codec(abc.ABC):
    """One wire encoding of a part's float32 values.

    Subclasses implement `_encode`, `_decode` and the two size functions; the public `encode` and
    `decode` validate their arguments first, so every codec rejects bad input the same way. Its
    `entry` is its registration (`gradps.codecs.registry`).
    """

    # Its entry in gradps.codec_table: name, enum value, lossy, pull and params.
    entry: ClassVar[CodecEntry]

    @classmethod
    def from_params(cls, params: tensor_pb2.CodecParams, generator: torch.Generator | None) -> Codec:
        """The codec for `params` (already checked against `cls.params`); `generator` drives
        randomized codecs (torch's default when None)."""
        return cls()

    def encode(self, values: torch.Tensor) -> bytes:
        """Encode a 1-D contiguous float32 CPU tensor into this codec's payload (little-endian).

        Raises CodecError when the values contain NaN/Inf or do not fit the codec.
        """
        return self._encode(values.detach(), self._peak(values))

    def encode_subtract(self, values: torch.Tensor) -> bytes:
        """`encode(values)`, leaving values - decode(payload) in `values`: what error feedback
        keeps. A codec may do both in one pass over memory (int8 does)."""
        payload = self.encode(values)
        self.add_decoded(payload, values, alpha=-1.0)
        return payload

    def _peak(self, values: torch.Tensor) -> float:
        """max |value| of a tensor `encode` accepts; TypeError, ValueError or CodecError if not."""
        if values.dtype != torch.float32 or values.dim() != 1 or values.device.type != "cpu":
            raise TypeError(
                f"{self.entry.name}: encode takes a 1-D float32 CPU tensor, got {values.dtype} "
                f"with shape {tuple(values.shape)} on {values.device}"
            )
        if not values.is_contiguous():
            raise ValueError(f"{self.entry.name}: encode takes a contiguous tensor")
        low, high = check_finite(values, f"{self.entry.name}: values to encode")
        return max(-low, high)

    def decode(self, payload: Buffer, count: int, device: torch.device | str) -> torch.Tensor:
        """Decode `payload` into a new 1-D float32 tensor of `count` elements on `device`.

        Raises CodecError on a wrong length, out-of-range or repeated indices, or NaN/Inf.
        """
        return self._decode(byte_view(payload), check_count(count), torch.device(device))

    def add_decoded(self, payload: Buffer, out: torch.Tensor, alpha: float = 1.0) -> None:
        """out += alpha * decode(payload), in place, on out's device; `out` is 1-D float32.

        Used by error feedback (alpha = -1) and by a shard accumulating pushes; sparse codecs
        override it to touch only the k listed elements.
        """
        check_out(out)
        out.add_(self.decode(payload, out.numel(), out.device), alpha=alpha)

    @abc.abstractmethod
    def payload_bytes(self, count: int) -> int:
        """Payload size this encoder produces for `count` elements."""

    @abc.abstractmethod
    def max_payload_bytes(self, count: int) -> int:
        """Largest valid payload for `count` elements (the bound for lz4 decompression)."""

    @abc.abstractmethod
    def _encode(self, values: torch.Tensor, peak: float) -> bytes:
        """Encode validated, finite values; `peak` is max |value| (0 when empty), from the check."""

    @abc.abstractmethod
    def _decode(self, payload: memoryview, count: int, device: torch.device) -> torch.Tensor:
        """Decode a byte view; validate everything read from it."""


def flat_float32(values: torch.Tensor) -> torch.Tensor:
    """`values` as the 1-D contiguous float32 CPU tensor that `Codec.encode` takes (a view of
    `values` when it already is one: do not write to it)."""
    return values.detach().reshape(-1).to("cpu", torch.float32).contiguous()


def byte_view(payload: Buffer) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous bytes-like object, without copying."""
    view = memoryview(payload)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def view_as(payload: memoryview, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
    """A CPU tensor of `count` elements of `dtype` read in place from payload[offset:].

    The tensor aliases the payload: read it or copy from it, never write to it or return it.
    """
    if count == 0:  # torch.frombuffer refuses empty buffers
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(payload, dtype=dtype, count=count, offset=offset)


def read_scale(payload: memoryview, codec: str) -> float:
    """The leading float32 scale of an int8 or sign payload; CodecError when NaN/Inf."""
    (scale,) = _SCALE.unpack_from(payload, 0)
    if not math.isfinite(scale):
        raise CodecError(f"{codec}: scale is {scale}")
    return scale


def pack_scale(scale: float) -> bytes:
    """A float32 scale as its 4 little-endian bytes."""
    return _SCALE.pack(scale)


def tensor_bytes(values: torch.Tensor) -> bytes:
    """The raw bytes of a contiguous 1-D tensor of any dtype (numpy lacks bfloat16, bytes do not)."""
    if values.numel() == 0:  # an empty tensor's stride may be 0, which view() refuses
        return b""
    return values.view(torch.uint8).numpy().tobytes()


def empty_values(count: int, device: torch.device) -> torch.Tensor:
    """An uninitialized 1-D float32 tensor for decoded values."""
    if device.type == "cpu":
        # numpy madvises large allocations to transparent huge pages; torch.empty does not, and the
        # first-touch page faults of a 64 MiB torch tensor cost more than int8 dequantization itself.
        return torch.from_numpy(np.empty(count, dtype=np.float32))
    return torch.empty(count, dtype=torch.float32, device=device)


def zero_values(count: int, device: torch.device) -> torch.Tensor:
    """A zeroed 1-D float32 tensor (calloc'd on CPU, so untouched pages cost nothing)."""
    if device.type == "cpu":
        return torch.from_numpy(np.zeros(count, dtype=np.float32))
    return torch.zeros(count, dtype=torch.float32, device=device)


def require_finite(values: torch.Tensor, what: str) -> None:
    """CodecError unless every element of `values` is finite, for callers that need no bounds.

    A finite sum proves it (NaN and Inf propagate into a sum) in one pass twice as fast as
    aminmax; only a sum that is not finite (or finite values that overflow it) takes the exact
    check.
    """
    if not math.isfinite(values.sum().item()):
        check_finite(values, what)


def check_finite(values: torch.Tensor, what: str) -> tuple[float, float]:
    """(min, max) of `values`, (0, 0) when empty; CodecError unless every element is finite.

    One aminmax pass: NaN and Inf propagate into the min or the max.
    """
    if values.numel() == 0:
        return 0.0, 0.0
    low, high = (bound.item() for bound in torch.aminmax(values))
    if not (math.isfinite(low) and math.isfinite(high)):
        raise CodecError(f"{what} contain NaN or Inf")
    return low, high


def check_length(payload: memoryview, expected: int, codec: str, count: int) -> None:
    """CodecError unless the payload has exactly the length its codec implies for `count`."""
    if len(payload) != expected:
        raise CodecError(f"{codec}: payload is {len(payload)} bytes, expected {expected} for {count} values")


def check_count(count: int) -> int:
    """CodecError on a negative element count."""
    if count < 0:
        raise CodecError(f"count must be >= 0, got {count}")
    return int(count)


def check_out(out: torch.Tensor) -> None:
    """TypeError unless `out` can accumulate decoded values."""
    if out.dtype != torch.float32 or out.dim() != 1:
        raise TypeError(f"add_decoded accumulates into a 1-D float32 tensor, got {out.dtype} {tuple(out.shape)}")
