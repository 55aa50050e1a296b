"""A pull's answer as the shard makes it: each part's payload (the live weights copied as they
are sent, anything else copied at once), and why values cannot be sent."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import torch

from gradps.codec_table import format_codec
from gradps.codecs import CodecError, encode_part, is_plain
from gradps.codecs.base import require_finite
from gradps.errors import NotNow, OutOfRange
from gradps.transport.framing import Item
from gradps.v1 import tensor_pb2
from ps_server.run_state import Part, RunState

# A pulled part's payload: float32 values (codec none, copied where they are placed), or a
# codec's bytes and lz4 flag.
Payload = torch.Tensor | tuple[bytes, bool]


def part_meta(part: Part, codec: tensor_pb2.CodecParams, version: int) -> tensor_pb2.TensorPart:
    """The metadata of one of `part`'s float32 payloads sent back to a worker."""
    meta = tensor_pb2.TensorPart(
        name=part.key[0], index=part.key[1], offset=part.offset, count=part.count, dtype=tensor_pb2.DTYPE_FLOAT32
    )
    meta.codec.CopyFrom(codec)
    meta.version = version
    return meta


def fixed_payload(part: Part, values: torch.Tensor, codec: tensor_pb2.CodecParams) -> Payload | None:
    """A pull's payload of `values` copied now, unless they are the live weights (None): those
    are copied as they are sent."""
    if values.data_ptr() == part.values.data_ptr():
        return None
    payload = _payload(part, values, codec)
    return payload.clone() if isinstance(payload, torch.Tensor) else payload


def pulled_parts(
    run: RunState,
    chosen: list[tuple[Part, Payload | None]],
    codec: tensor_pb2.CodecParams,
    shared: bool,
    context: grpc.ServicerContext,
) -> Iterator[Item]:
    """The answer's parts, each made (under frame's guard: the run's lock) as it is sent."""
    for part, fixed in chosen:
        if shared and not context.is_active():
            return  # cancelled: the worker may have reused its area for its next pull
        payload = _payload(part, part.values, codec) if fixed is None else fixed
        meta = part_meta(part, codec, part.version)
        if isinstance(payload, torch.Tensor):
            run.bytes_pulled += 4 * part.count
            yield meta, payload
        else:
            data, meta.lz4 = payload
            run.bytes_pulled += len(data)
            yield meta, data


def _payload(part: Part, values: torch.Tensor, codec: tensor_pb2.CodecParams) -> Payload:
    """`values` as a pull sends them: the values themselves for `none` (copied once, where they
    are placed), else the codec's payload and lz4 flag. FAILED_PRECONDITION when they are not
    finite (the run diverged: no codec can send them), OUT_OF_RANGE when they do not fit the codec."""
    try:
        if is_plain(codec):
            require_finite(values, "none: values to encode")  # what the none codec checks
            return values
        return encode_part(values.cpu(), codec, lz4_threshold=None)
    except CodecError:
        name = f"{part.key[0]}/{part.key[1]}"
        what = "weights" if values.data_ptr() == part.values.data_ptr() else "values"
        if not bool(torch.isfinite(values).all()):
            raise NotNow(f"part {name}: its {what} are not finite (NaN or Inf): the run diverged") from None
        peak = float(values.abs().max())
        raise OutOfRange(
            f"part {name}: its {what} (|value| up to {peak:g}) do not fit {codec_name(codec)}; pull with codec none"
        ) from None


def codec_name(params: tensor_pb2.CodecParams) -> str:
    """The CLI name of `params` ("fp16", "topk:0.01"), or the enum number when it is not valid."""
    try:
        return format_codec(params)
    except CodecError:
        return f"codec {params.codec}"
