"""The one chunking path: a call's parts into messages through its Outbound, and back.

Parts whose payload goes out of band (in shared memory) and small ones travel together in the
repeated `parts` of a message (every streamed message costs grpcio a few thread hand-offs), up
to wire.BATCH_BYTES; a large inline payload travels alone in the message's `part`, framed by
hand so that it is copied once (gradps/wire.py); a streamed one's message travels alone and its
bytes follow it on the data stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from gradps import wire
from gradps.errors import Invalid
from gradps.transport.base import Buffer, Outbound
from gradps.transport.data_stream import as_buffer
from gradps.v1 import tensor_pb2

M = TypeVar("M", bound=Message)
# A part's metadata and its payload: bytes, or float32 values (codec none) on any device.
Item = tuple[tensor_pb2.TensorPart, object]

# The field that holds a message's one large `part` (gradps/v1/shard.proto).
PART_FIELD = {
    "PushRequest": 4,
    "PushPullRequest": 4,
    "PushPullResponse": 2,
    "PullResponse": 1,
    "ReadCheckpointResponse": 1,
    "RegisterTensorsRequest": 2,
    "GroupAverageRequest": 6,
    "GroupAverageResponse": 1,
}


def frame(
    header: Message, items: Iterable[Item], out: Outbound, guard: AbstractContextManager[object] | None = None
) -> Iterator[bytes]:
    """The serialized messages of one call: each repeats `header` (its fields other than the
    parts, with the route named in it) and carries some of `items`. `guard` (a shard's run lock)
    is held while an item is made and its payload copied (into a region, a message, a snapshot),
    and released before a message is sent: a pulled part is one consistent snapshot."""
    named = type(header)()
    named.CopyFrom(header)  # shared by the shards' threads and the retries
    out.name_in(named)
    head = named.SerializeToString()
    part_field = PART_FIELD[type(header).__name__]
    batch = wire.PartBatch(lambda: type(header).FromString(head))
    parts = iter(items)
    while True:
        with guard or nullcontext():
            item = next(parts, None)
            if item is None:
                break
            ready, streamed = _place(head, part_field, item, out, batch)
        if ready is not None:
            yield ready if isinstance(ready, bytes) else ready.SerializeToString()
        if streamed:
            out.follow()  # resumed once the message is on its way: the peer reads after it
    if (rest := batch.take()) is not None:
        yield rest.SerializeToString()


def _place(
    head: bytes, part_field: int, item: Item, out: Outbound, batch: wire.PartBatch
) -> tuple[Message | bytes | None, bool]:
    """One part into the call: (the message to send now, if any; whether its bytes follow it)."""
    meta, payload = item
    meta.ClearField("shared")  # a part framed again (a retry) starts over
    meta.streamed = 0
    if out.carry(meta, payload):
        if not meta.streamed:
            return batch.add(meta), False
        message = batch.new()
        message.part.CopyFrom(meta)  # type: ignore[attr-defined]
        return message, True
    data = as_buffer(payload)
    if len(data) <= wire.SMALL_PAYLOAD:
        return batch.add(meta, data), False
    return b"".join(wire.part_message(head, part_field, meta, data)), False


def unframe(message: Buffer, message_type: type[M]) -> tuple[M, list[tuple[tensor_pb2.TensorPart, Buffer]]]:
    """One message of a bulk call: its other fields, and (metadata, payload received with it) of
    each part, the large `part` first, its payload viewed in place. Invalid on bad encoding."""
    try:
        rest, part, payload = wire.split_message(message, PART_FIELD[message_type.__name__])
        parsed = message_type.FromString(rest)
    except (wire.WireError, DecodeError) as e:
        raise Invalid(f"malformed {message_type.__name__}: {e}") from None
    first: list[tuple[tensor_pb2.TensorPart, Buffer]] = [(part, payload)] if part is not None else []
    return parsed, first + [(p, p.payload) for p in getattr(parsed, "parts", ())]
