"""The shard's side of the transport seam: which route a call's payloads take, from what the
worker's request names (a region of its shared segment, a call on its data stream, or neither:
the messages), checked against what the worker set up in the run."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import grpc
from google.protobuf.message import Message

from gradps.data_stream import CallReceiver, CallSender, DataStream
from gradps.errors import Invalid, NotNow, Unmapped
from gradps.shared_memory import RegionWriter, Segment, SegmentError
from gradps.transport.base import INLINE_OUT, Inbound, Outbound
from gradps.transport.data_stream import StreamIn, StreamOut
from gradps.transport.shared_memory import RegionIn, RegionOut
from gradps.v1 import shard_pb2, tensor_pb2
from ps_server.run_state import RunState

# The longest a call holds a direction of a data stream, when its deadline is later or unset.
MAX_CLAIM_S = 600.0
_DEFAULT_CLAIM_S = 60.0


def receiving(
    run: RunState, worker_id: int, header: Message, context: grpc.ServicerContext
) -> AbstractContextManager[Inbound]:
    """Where the payloads of a push or deposit come from: the worker's data stream when its
    header names one (held for the call), else its shared segments and the messages."""
    if header.HasField("stream"):
        call = header.stream  # type: ignore[attr-defined]
        return _stream_in(stream_of(run, worker_id, call), call, context)

    def view(region: tensor_pb2.SharedRegion) -> memoryview:
        return segment_of(run, worker_id, region.segment).region(region.offset, region.length)

    return nullcontext(RegionIn(view))


def sending(
    run: RunState, worker_id: int, request: Message, context: grpc.ServicerContext, snapshot: bool
) -> AbstractContextManager[Outbound]:
    """Where the payloads of a pull's or an average's answer go: the region of the worker's
    segment it names, or its data stream (held once entered; `snapshot`: copy each payload as it
    is carried, for values that change after the lock is released), else the messages. Checked
    now, before any wait."""
    if request.HasField("into"):
        into = request.into  # type: ignore[attr-defined]
        try:
            writer = RegionWriter(segment_of(run, worker_id, into.segment), into.offset, into.length)
        except SegmentError as e:
            raise Invalid(str(e)) from None
        return nullcontext(RegionOut(writer))
    if request.HasField("stream"):
        call = request.stream  # type: ignore[attr-defined]
        return _stream_out(stream_of(run, worker_id, call), call, context, snapshot)
    return nullcontext(INLINE_OUT)


def segment_of(run: RunState, worker_id: int, name: str) -> Segment:
    with run.cond:
        segment = run.segments.get((worker_id, name))
    if segment is None:
        raise Unmapped(name, worker_id)
    return segment


def stream_of(run: RunState, worker_id: int, call: shard_pb2.StreamCall) -> DataStream:
    with run.cond:
        stream = run.streams.get((worker_id, call.stream))
    if stream is None or stream.closed:
        raise NotNow(f"data stream {call.stream} is not open for worker {worker_id}")
    return stream


@contextmanager
def _stream_in(stream: DataStream, call: shard_pb2.StreamCall, context: grpc.ServicerContext) -> Iterator[Inbound]:
    with _claimed(stream, "receive", call, context) as receiver:
        yield StreamIn(receiver, name=False)  # type: ignore[arg-type]


@contextmanager
def _stream_out(
    stream: DataStream, call: shard_pb2.StreamCall, context: grpc.ServicerContext, snapshot: bool
) -> Iterator[Outbound]:
    with _claimed(stream, "send", call, context) as sender:
        yield StreamOut(sender, snapshot=snapshot, name=False)  # type: ignore[arg-type]


@contextmanager
def _claimed(
    stream: DataStream, direction: str, call: shard_pb2.StreamCall, context: grpc.ServicerContext
) -> Iterator[CallSender | CallReceiver]:
    """One direction of the worker's stream for the call, until its deadline (at most
    MAX_CLAIM_S); NotNow while another call has it or it is closed."""
    remaining = context.time_remaining()
    timeout_s = min(_DEFAULT_CLAIM_S if remaining is None else remaining, MAX_CLAIM_S)
    claim = stream.sending if direction == "send" else stream.receiving
    with claim(call.call, timeout_s) as io:
        if io is None:
            raise NotNow(f"data stream {stream.id} is busy or closed")
        finished = False

        # A call that ends before its bytes did (the client cancelled, or left) would leave this
        # thread blocked on the socket until the deadline: closing the stream fails that read or
        # write at once (the worker reopens a stream in the background).
        def close_unless_finished() -> None:
            if not finished:
                stream.close()

        context.add_callback(close_unless_finished)
        try:
            yield io
        finally:
            finished = True
