"""Codecs for tensor parts on the wire (see proto/gradps/v1/tensor.proto and docs/compression.md).

The rest of gradps calls `encode_part` on the sending side and `decode_part` or `decode_summand`
on the receiving side; everything else here is the machinery behind them. What names a codec
(its name, parameters, CLI form and checks) is `gradps.codec_table`, which needs no torch.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from gradps.codecs.base import Buffer, Codec, CodecError, check_count, flat_float32
from gradps.codecs.error_feedback import ErrorFeedback
from gradps.codecs.framing import maybe_lz4, unwrap
from gradps.codecs.registry import CODECS, get_codec
from gradps.codecs.sparse import SparseCodec, SparsePart
from gradps.v1 import tensor_pb2

__all__ = [
    "CODECS",
    "Buffer",
    "Codec",
    "CodecError",
    "ErrorFeedback",
    "SparseCodec",
    "SparsePart",
    "decode_part",
    "decode_summand",
    "encode_part",
    "get_codec",
    "is_plain",
    "max_wire_bytes",
    "maybe_lz4",
    "plain_payload",
    "unwrap",
]


def is_plain(params: tensor_pb2.CodecParams) -> bool:
    """Whether `params` sends values as they are: codec none (or unset)."""
    return params.codec in (tensor_pb2.CODEC_UNSPECIFIED, tensor_pb2.CODEC_NONE)


def plain_payload(part: tensor_pb2.TensorPart) -> bool:
    """Whether a part's payload is its float32 values as they are: codec none and no lz4 frame."""
    return is_plain(part.codec) and not part.lz4


def max_wire_bytes(part: tensor_pb2.TensorPart) -> int:
    """The most bytes a part's payload can take: its codec's largest payload of `part.count`
    values, and an lz4 frame's overhead when it has one (an incompressible frame is a little
    longer than its content). CodecError for a codec that does not exist."""
    limit = get_codec(part.codec).max_payload_bytes(part.count)
    return limit + limit // 128 + 1024 if part.lz4 else limit


def encode_part(
    values: torch.Tensor,
    params: tensor_pb2.CodecParams,
    *,
    feedback: ErrorFeedback | None = None,
    key: Hashable | None = None,
    lz4_threshold: float | None = 0.9,
) -> tuple[bytes, bool]:
    """Encode one part's values (any shape and float dtype, flattened to float32): the
    (payload, lz4 flag) for TensorPart.payload and TensorPart.lz4.

    With `feedback`, lossy codecs add and update the residual kept under `key` (required then).
    `lz4_threshold=None` never frames; otherwise see `maybe_lz4`.
    """
    codec = get_codec(params)
    if feedback is not None:
        if key is None:
            raise ValueError("encode_part: error feedback needs the part's key")
        payload = feedback.compress(key, values, codec)
    else:
        payload = codec.encode(flat_float32(values))
    if lz4_threshold is None:
        return payload, False
    return maybe_lz4(payload, lz4_threshold)


def decode_part(
    payload: Buffer, is_lz4: bool, params: tensor_pb2.CodecParams, count: int, device: torch.device | str
) -> torch.Tensor:
    """Decode one part's payload into a 1-D float32 tensor of `count` values on `device`.

    Raises CodecError (-> INVALID_ARGUMENT) on bad parameters, frames or payloads.
    """
    codec, count = get_codec(params), check_count(count)
    return codec.decode(unwrap(payload, is_lz4, codec.max_payload_bytes(count)), count, device)


def decode_summand(
    payload: Buffer, is_lz4: bool, params: tensor_pb2.CodecParams, count: int, device: torch.device | str
) -> torch.Tensor | SparsePart:
    """Like `decode_part`, for a receiver that only adds the part into a sum: sparse codecs (topk,
    randk) give a SparsePart (k indices and values on `device`, `add_to` is one index_add_), the
    others a new dense tensor. Same validation: CodecError (-> INVALID_ARGUMENT), nothing to undo.
    """
    codec, count = get_codec(params), check_count(count)
    payload = unwrap(payload, is_lz4, codec.max_payload_bytes(count))
    if isinstance(codec, SparseCodec):
        return SparsePart(*codec.decode_sparse(payload, count, device), count)
    return codec.decode(payload, count, device)
