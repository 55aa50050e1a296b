"""Data streams: a large payload travels as raw bytes on a TCP connection beside gRPC, after the
message that lists its part (TensorPart.streamed), with no protobuf or HTTP/2 framing and no
copies but the kernel's. The connection and its framing are `gradps/data_stream.py`; this is
the route over it, the same on both sides.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import grpc
import numpy as np
import torch
from google.protobuf.message import Message

from gradps import wire
from gradps.auth.tls import TlsFiles
from gradps.codecs import CodecError, max_wire_bytes
from gradps.data_stream import CallReceiver, CallSender, DataStream, StreamError
from gradps.errors import Invalid
from gradps.transport.base import INLINE_IN, INLINE_OUT, Buffer, Inbound, Outbound, Route
from gradps.v1 import shard_pb2, shard_pb2_grpc, tensor_pb2

_LOGGER = logging.getLogger("gradps.worker")
# A data stream that broke is opened again in the background this long after, the wait doubling
# up to REOPEN_MAX_S while the shard cannot be reached on it; calls go inline meanwhile.
REOPEN_S, REOPEN_MAX_S = 5.0, 300.0


def _named(header: Message, io: CallSender | CallReceiver) -> None:
    header.stream.CopyFrom(shard_pb2.StreamCall(stream=io.stream.id, call=io.call))  # type: ignore[attr-defined]


class StreamOut(Outbound):
    """Large payloads on the call's send direction, each after its message; small ones inline.
    `snapshot`: copy each payload when it is carried (values that may change before it is sent).
    `name`: whether this side names the stream in its messages (the worker does; the shard answers
    on the stream the worker's request named)."""

    follows = True

    def __init__(self, sender: CallSender, snapshot: bool = False, name: bool = True) -> None:
        self._sender = sender
        self._snapshot = snapshot
        self._name = name
        self._pending: Buffer | None = None

    def name_in(self, header: Message) -> None:
        if self._name:
            _named(header, self._sender)

    def carry(self, meta: tensor_pb2.TensorPart, payload: object) -> bool:
        data = as_buffer(payload)
        if len(data) <= wire.SMALL_PAYLOAD:
            return False
        meta.streamed = len(data)
        self._pending = bytes(data) if self._snapshot else data
        return True

    def follow(self) -> None:
        data, self._pending = self._pending, None
        if data is not None:
            self._sender.send(data)  # StreamError closes the stream: the peer fails the call


class StreamIn(Inbound):
    """Payloads of parts with TensorPart.streamed from the call's receive direction, in order.
    `name`: as StreamOut's."""

    def __init__(self, receiver: CallReceiver, name: bool = True) -> None:
        self._receiver = receiver
        self._name = name

    def name_in(self, header: Message) -> None:
        if self._name:
            _named(header, self._receiver)

    def payload(self, meta: tensor_pb2.TensorPart, received: Buffer, into: memoryview | None = None) -> Buffer | None:
        if not meta.streamed:
            return super().payload(meta, received, into)
        name = f"{meta.name}/{meta.index}"
        if len(received) or meta.HasField("shared"):
            raise Invalid(f"part {name} is streamed and has another payload")
        try:
            limit = max_wire_bytes(meta)
        except CodecError as e:
            raise Invalid(f"part {name}: {e}") from None
        if meta.streamed > limit:
            raise Invalid(f"part {name}: {meta.streamed} streamed bytes, more than {limit}")
        if into is not None and len(into) == meta.streamed:
            self._receiver.receive_into(into)
            return None
        buffer = np.empty(meta.streamed, dtype=np.uint8).data
        self._receiver.receive_into(buffer)
        return buffer


def as_buffer(payload: object) -> Buffer:
    """A payload's bytes: float32 values (codec none) viewed in place, on the CPU."""
    if isinstance(payload, torch.Tensor):
        return payload.cpu().numpy().data.cast("B")
    return payload  # type: ignore[return-value]


class DataStreamRoute(Route):
    """A worker's data stream to one shard. A call that breaks it closes it; it is opened again
    in the background (REOPEN_S, doubling), and calls go inline meanwhile."""

    def __init__(self, opener: Callable[[], DataStream | None], stream: DataStream, timeout_s: float) -> None:
        self._opener = opener
        self.stream: DataStream | None = stream
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def connect(
        cls,
        stub: shard_pb2_grpc.ShardServiceStub,
        host: str,
        run_id: str,
        worker_id: int,
        timeout_s: float,
        tls: TlsFiles | None = None,
    ) -> DataStreamRoute | None:
        """A data stream to the shard at `host` (inside TLS with `tls`, as the shard's channel);
        None when it cannot be opened (no data port, a firewall, TLS on one side only): payloads
        go inline."""

        def opener() -> DataStream | None:
            request = shard_pb2.OpenStreamRequest(run_id=run_id, worker_id=worker_id)
            wait = min(timeout_s, 10.0)
            try:
                response = stub.OpenStream(request, timeout=wait)
                return DataStream.connect(host, response.port, response.token, response.stream, wait, tls)
            except grpc.RpcError as e:
                _LOGGER.info("%s: payloads inline (%s: %s)", host, e.code().name, e.details())
            except StreamError as e:
                _LOGGER.info("%s: payloads inline (%s)", host, e)
            except ValueError:  # the channel was closed meanwhile
                pass
            return None

        stream = opener()
        return cls(opener, stream, timeout_s) if stream is not None else None

    @property
    def open(self) -> bool:
        return self.stream is not None and not self.stream.closed

    @contextmanager
    def call(self, send: bool, receive: bool) -> Iterator[tuple[Outbound, Inbound]]:
        # One call number for both directions: the shard reads it once, from the call's header.
        stream = self.stream
        if stream is None:
            yield INLINE_OUT, INLINE_IN
            return
        number = stream.next_call()
        try:
            with ExitStack() as held:
                sender = held.enter_context(stream.sending(number, self._timeout_s)) if send else None
                receiver = held.enter_context(stream.receiving(number, self._timeout_s)) if receive else None
                if (send and sender is None) or (receive and receiver is None):
                    yield INLINE_OUT, INLINE_IN  # busy or closed
                    return
                out = StreamOut(sender) if sender is not None else INLINE_OUT
                inbound = StreamIn(receiver) if receiver is not None else INLINE_IN
                yield out, inbound
        finally:
            if stream.closed:
                self._reopen_later(stream, REOPEN_S)

    def _reopen_later(self, broken: DataStream | None, delay_s: float) -> None:
        """Forget `broken` (once, whichever call saw it break) and open a new stream `delay_s` from now."""
        with self._lock:
            if self._closed or self.stream is not broken:
                return
            self.stream = None
        timer = threading.Timer(delay_s, self._reopen, args=(delay_s,))
        timer.daemon = True
        timer.start()

    def _reopen(self, delay_s: float) -> None:
        if self._closed:
            return
        stream = self._opener()
        if stream is None:
            self._reopen_later(None, min(2 * delay_s, REOPEN_MAX_S))
            return
        with self._lock:
            if not self._closed and self.stream is None:
                self.stream = stream
                _LOGGER.info("data stream open again")
                return
        stream.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            stream, self.stream = self.stream, None
        if stream is not None:
            stream.close()
