"""A push or a deposit as the shard reads it: every message of the call checked and every part
decoded on the shard's device before anything changes (a bad part changes nothing).

Exactly once: a call's header announces how many parts it carries (`part_count`), and a call is
applied only when all of them arrived and the call is still alive (not cancelled, not past its
deadline). A stream that ends short of its parts looks, to the server, like one that ended
normally, so the count is what tells them apart; the liveness is checked again under the run's
lock, right before the rule applies it."""

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
from gradps.errors import Cancelled, DataLost, Invalid, TimedOut
from gradps.placement import PartKey
from gradps.transport.base import Buffer, Inbound
from gradps.transport.framing import unframe
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
    # The parts the call announced (its header's part_count).
    expected: int = 0


def receive(call: Call, messages: Iterable[bytes], claims: ExitStack, context: grpc.ServicerContext) -> Received:
    """Read the whole call; a data stream it names is held (in `claims`) until every part is read.
    Returns only when every part the call announced arrived and the call is still alive."""
    got: Received | None = None
    key: Hashable = None
    request: Any
    for message in messages:
        request, parts = unframe(message, call.message_type)
        if got is None:
            got = Received(call.open_run(request), request)
            got.expected = expected_parts(request.part_count, got.found[0], call.noun)
            key = call.header_of(request), request.part_count
            inbound = claims.enter_context(receiving(got.found[0], request.worker_id, request, context))
            decode = call.decode(got.found)
        elif (call.header_of(request), request.part_count) != key:
            raise Invalid(f"all parts of a {call.noun} need the same header and part_count")
        if not parts:
            raise Invalid(f"a {call.message_type.__name__} without a part")
        for meta, data in parts:
            _take(got, call, meta, data, inbound, decode)
        del message, parts, request  # the received bytes are dead weight once decoded
    if got is None:
        raise Invalid(f"empty {call.noun}")
    check_whole(len(got.values), got.expected, call.noun, context)
    return got


def expected_parts(count: int, run: RunState, noun: str) -> int:
    """The parts a call's header announces (`part_count`), checked: at least one, and at most
    the parts this shard holds for the run (each travels once)."""
    if not 1 <= count <= len(run.parts):
        raise Invalid(f"a {noun} announces its parts in part_count, 1 to {len(run.parts)} here; got {count}")
    return count


def check_whole(received: int, expected: int, noun: str, context: grpc.ServicerContext) -> None:
    """After a call's last message: nothing of it is applied unless it is alive and all of it came."""
    check_alive(context, noun)
    if received < expected:
        raise DataLost(f"the {noun} ended after {received} of its {expected} parts; nothing of it is applied")


def check_alive(context: grpc.ServicerContext, noun: str) -> None:
    """Cancelled or TimedOut once the call is over: what a cancelled or expired call carried is
    never applied (its client sees a failure and makes it again)."""
    if not context.is_active():
        raise Cancelled(f"the {noun} was cancelled; nothing of it is applied")
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        raise TimedOut(f"the {noun} ran past its deadline; nothing of it is applied")


def _take(
    got: Received, call: Call, meta: tensor_pb2.TensorPart, data: Buffer, inbound: Inbound, decode: Decode
) -> None:
    run = got.found[0]
    if len(got.values) == got.expected:
        raise Invalid(f"a {call.noun} of part_count {got.expected} carries more parts")
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
