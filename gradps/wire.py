"""Bulk messages (a TensorPart with a large payload) serialized and parsed by hand, so that a
part's payload is copied once between the tensor and gRPC.

Python protobuf copies a `bytes` field when it is assigned, when the message is serialized, when
it is parsed and on every read of the field: at 64 MiB those copies (and the page faults of
their fresh buffers) cost more than the socket. The workers' Push and Pull calls therefore use
gRPC's raw-bytes calling convention (no serializer) with the helpers here; the bytes on the wire
are exactly the protobuf encoding of the messages in `proto/gradps/v1/`, which the shard parses
with the generated code. Everything but the payload still goes through protobuf.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

import grpc
from google.protobuf.message import Message

from gradps.v1 import tensor_pb2

Buffer = bytes | bytearray | memoryview

# Wire types (protobuf encoding).
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
# TensorPart.payload is field 7.
_PAYLOAD_FIELD = 7
# Parts whose payload lies in shared memory or is at most SMALL_PAYLOAD bytes travel together, in a
# message's repeated `parts` (every streamed message costs grpcio a few thread hand-offs), up to
# BATCH_BYTES per message; larger payloads travel one per message, framed by hand. A batch, with
# its message's other fields, stays within gRPC's standard 4 MiB receive limit (a stock client's).
SMALL_PAYLOAD = 256 << 10
BATCH_BYTES = (4 << 20) - (64 << 10)
# Bytes a part takes in a message beyond its own encoding: the field's tag and length.
_PART_FRAMING = 8


class WireError(ValueError):
    """A message that is not valid protobuf encoding of what it should be."""


def varint(n: int) -> bytes:
    """`n` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def length_prefix(field: int, length: int) -> bytes:
    """The tag and length of a length-delimited field of `length` bytes."""
    return varint(field << 3 | _LEN) + varint(length)


def part_message(header: bytes, part_field: int, meta: tensor_pb2.TensorPart, payload: Buffer) -> list[Buffer]:
    """The pieces of a message = `header` (its other fields, serialized) + field `part_field` holding
    `meta` with `payload` as its payload; b"".join of them is the message (one copy of `payload`).

    `meta` must not have a payload of its own (the field would appear twice).
    """
    meta_bytes = meta.SerializeToString()
    size = len(payload)
    payload_prefix = length_prefix(_PAYLOAD_FIELD, size)
    part_size = len(meta_bytes) + len(payload_prefix) + size
    return [header + length_prefix(part_field, part_size) + meta_bytes + payload_prefix, payload]


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise WireError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf: memoryview, pos: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, key start, value start, value end) of each field in buf[pos:end]."""
    while pos < end:
        key_start = pos
        key, pos = _read_varint(buf, pos, end)
        field, wire_type = key >> 3, key & 7
        start = pos
        if wire_type == _VARINT:
            _, pos = _read_varint(buf, pos, end)
        elif wire_type == _I64:
            pos += 8
        elif wire_type == _I32:
            pos += 4
        elif wire_type == _LEN:
            size, start = _read_varint(buf, pos, end)
            pos = start + size
        else:
            raise WireError(f"unsupported wire type {wire_type}")
        if pos > end:
            raise WireError("field runs past the end of the message")
        yield field, wire_type, key_start, start, pos


def split_message(message: Buffer, part_field: int) -> tuple[bytes, tensor_pb2.TensorPart | None, memoryview]:
    """Split a message that may hold a TensorPart in field `part_field` (a PushRequest, a
    PullResponse) into its other fields (serialized, for the message's own FromString), the part's
    metadata (a TensorPart without payload; None when the field is absent) and a read-only view of
    the payload, without copying the payload.

    Raises WireError on bytes that are not protobuf encoding.
    """
    buf = memoryview(message).cast("B") if not isinstance(message, bytes) else memoryview(message)
    part = None
    for field, wire_type, key_start, start, end in _fields(buf, 0, len(buf)):
        if field == part_field and wire_type == _LEN:
            if part is not None:
                raise WireError(f"field {part_field} appears twice")
            part = (key_start, start, end)
    if part is None:
        return bytes(buf), None, buf[0:0]
    key_start, start, end = part
    payload = buf[0:0]
    meta = []
    cursor = start
    for field, wire_type, field_start, value_start, value_end in _fields(buf, start, end):
        if field == _PAYLOAD_FIELD and wire_type == _LEN:
            meta.append(buf[cursor:field_start])
            payload = buf[value_start:value_end]  # the last occurrence wins, as in protobuf
            cursor = value_end
    meta.append(buf[cursor:end])
    try:
        part_meta = tensor_pb2.TensorPart.FromString(b"".join(meta))
    except Exception as e:  # protobuf's DecodeError
        raise WireError(f"bad TensorPart: {e}") from None
    rest = b"".join((buf[:key_start], buf[end:]))
    return rest, part_meta, payload


def parts_of(message: Any) -> list[tensor_pb2.TensorPart]:
    """A parsed message's parts: its `part` if set, then its repeated `parts` if it has them."""
    first = [message.part] if message.HasField("part") else []
    return first + list(getattr(message, "parts", ()))


class PartBatch:
    """Parts gathered into the repeated `parts` of messages made by `new`: parts whose payload lies
    in shared memory and small ones, up to BATCH_BYTES a message."""

    def __init__(self, new: Callable[[], Message]) -> None:
        self.new = new
        self._message: Any = new()
        self._bytes = 0

    def add(self, meta: tensor_pb2.TensorPart, payload: Buffer = b"") -> Message | None:
        """Append `meta` with `payload` (copied); the message to send when this part would take
        the one gathered so far beyond BATCH_BYTES (the part starts the next), else None."""
        size = meta.ByteSize() + len(payload) + _PART_FRAMING
        full = self.take() if self._bytes and self._bytes + size > BATCH_BYTES else None
        part = self._message.parts.add()
        part.CopyFrom(meta)
        if len(payload):
            part.payload = bytes(payload)
        self._bytes += size
        return full

    def take(self) -> Message | None:
        """What was gathered (None when nothing was), and a new message for what follows."""
        message, self._message, self._bytes = self._message, self.new(), 0
        return message if message.parts else None


class _Capture:
    """Stands in for a server to collect the handlers a generated `add_*_to_server` registers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.service, self.handlers = service, dict(handlers)


def add_servicer(
    add_generated: Callable[[object, object], None],
    servicer: object,
    server: grpc.Server,
    raw_requests: Collection[str] = (),
    raw_responses: Collection[str] = (),
) -> None:
    """Register `servicer` as the generated `add_generated(servicer, server)` would, except that
    the methods named in `raw_requests` receive each request message as `bytes` and those in
    `raw_responses` return (or yield) `bytes`, already serialized (see `split_message` and
    `part_message`). Clients are unaffected: the bytes on the wire are the same."""
    capture = _Capture()
    add_generated(servicer, capture)
    if not capture.service:
        raise ValueError("add_generated registered no service")
    handlers = dict(capture.handlers)
    for name in raw_requests:
        handlers[name] = handlers[name]._replace(request_deserializer=None)
    for name in raw_responses:
        handlers[name] = handlers[name]._replace(response_serializer=None)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(capture.service, handlers),))
    server.add_registered_method_handlers(capture.service, handlers)
