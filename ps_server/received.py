"""A push or a deposit as the shard reads it: every message of the call checked and every part
decoded on the shard's device before anything changes (a bad part changes nothing)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
from google.protobuf.message import Message

from gradps.codecs import CodecError, decode_part, plain_payload
from gradps.codecs.base import require_finite
from gradps.errors import Invalid
from gradps.placement import PartKey
from gradps.transport import Buffer, Inbound, unframe
from gradps.v1 import tensor_pb2
from ps_server.call_routes import receiving
from ps_server.run_checks import check_part
from ps_server.run_state import RunState

# A codec's decode: (payload, lz4, codec, count, device) -> the values (or a SparsePart).
Decode = Callable[[Buffer, bool, tensor_pb2.CodecParams, int, torch.device], Any]


@dataclass
class Call:
    """What one bulk call names and how its parts are read."""

    message_type: type[Message]
    # "push" or "deposit", and the past tense for a part sent twice.
    noun: str
    twice: str
    # The fields every message of the call repeats.
    header_of: Callable[[Any], Hashable]
    # The run the call is for, (state, rule), looked up and checked from its first message.
    open_run: Callable[[Any], tuple[RunState, Any]]
    # How its parts are decoded, given the run's (state, rule).
    decode: Callable[[tuple[RunState, Any]], Decode] = field(default=lambda found: decode_part)


@dataclass
class Received:
    """A call's parts, decoded: values, the versions they were computed on, payload bytes."""

    # The run's (state, rule), and the call's first message.
    found: tuple[RunState, Any]
    header: Any
    values: dict[PartKey, Any] = field(default_factory=dict)
    versions: dict[PartKey, int] = field(default_factory=dict)
    nbytes: int = 0


def receive(call: Call, messages: Iterable[bytes], claims: ExitStack, context: grpc.ServicerContext) -> Received:
    """Read the whole call; a data stream it names is held (in `claims`) until every part is read."""
    got: Received | None = None
    key: Hashable = None
    request: Any
    for message in messages:
        request, parts = unframe(message, call.message_type)
        if got is None:
            got = Received(call.open_run(request), request)
            key = call.header_of(request)
            inbound = claims.enter_context(receiving(got.found[0], request.worker_id, request, context))
            decode = call.decode(got.found)
        elif call.header_of(request) != key:
            raise Invalid(f"all parts of a {call.noun} need the same header")
        if not parts:
            raise Invalid(f"a {call.message_type.__name__} without a part")
        for meta, data in parts:
            _take(got, call, meta, data, inbound, decode)
        del message, parts, request  # the received bytes are dead weight once decoded
    if got is None:
        raise Invalid(f"empty {call.noun}")
    return got


def _take(
    got: Received, call: Call, meta: tensor_pb2.TensorPart, data: Buffer, inbound: Inbound, decode: Decode
) -> None:
    run = got.found[0]
    part = check_part(run, meta)
    if part.key in got.values:
        raise Invalid(f"part {meta.name}/{meta.index} {call.twice} twice")
    got.values[part.key], size = decode_received(meta, data, inbound, decode, run.device)
    got.versions[part.key] = meta.version
    got.nbytes += size


def decode_received(
    meta: tensor_pb2.TensorPart, data: Buffer, inbound: Inbound, decode: Decode, device: torch.device
) -> tuple[Any, int]:
    """A part's values on `device` and its payload bytes. Plain values on a data stream are read
    straight into the tensor: nothing to decode. Decoding rejects NaN/Inf (every codec checks
    what it decodes)."""
    try:
        if meta.streamed and plain_payload(meta) and meta.streamed == 4 * meta.count:
            values = torch.empty(meta.count)
            inbound.payload(meta, data, values.numpy().data.cast("B"))
            require_finite(values, "none: decoded values")
            return values.to(device), meta.streamed
        payload = inbound.payload(meta, data)
        assert payload is not None  # given no `into`, a route returns the bytes
        return decode(payload, meta.lz4, meta.codec, meta.count, device), len(payload)
    except CodecError as e:
        raise Invalid(f"part {meta.name}/{meta.index}: {e}") from None
