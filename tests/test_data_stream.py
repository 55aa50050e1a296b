"""Data streams (gradps/data_stream.py): push and pull payloads as raw bytes on a TCP connection
beside gRPC, against real shard processes (and, where a shard needs to be built differently, real
in-process shard servers) over real sockets: same weights as inline payloads, every bad OpenStream,
handshake and streamed push a client could send, a pull read off the stream by hand, and the
worker's fallback to inline payloads when a stream breaks or a shard has no data port."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import grpc
import numpy as np
import pytest
import torch

from gradps import data_stream, wire
from gradps.channel import bind, make_server, open_channel
from gradps.codec_table import parse_codec
from gradps.data_stream import CallReceiver, CallSender, DataStream, StreamError, StreamListener
from gradps.errors import Invalid
from gradps.parameter_client import ParameterClient, tensor_specs
from gradps.placement import place
from gradps.transport import data_stream as route_module
from gradps.transport.data_stream import StreamIn
from gradps.v1 import run_pb2, shard_pb2, shard_pb2_grpc, tensor_pb2
from ps_server.shard import ShardServicer, add_shard_servicer
from tests.joined_run import NONE, asgd_steps, join_run, leave

HOST = "127.0.0.1"
LR = 0.5
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
DATA_LOSS = grpc.StatusCode.DATA_LOSS
FP16 = tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_FP16)


def _spec(workers: int = 1, part_size: int = 512 << 10, lr: float = LR) -> run_pb2.RunSpec:
    return run_pb2.RunSpec(
        scheme="asgd",
        workers=workers,
        steps=100,
        part_size=part_size,
        optimizer=run_pb2.OptimizerSpec(name="sgd", lr=lr),
    )


def _rejected(call, code: grpc.StatusCode, words: str) -> None:
    """`call` fails with `code` and a one-line message containing `words`."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    details = err.value.details()
    assert err.value.code() == code, details
    assert words in details and "\n" not in details, details


@contextmanager
def _shard(address: str) -> Iterator[shard_pb2_grpc.ShardServiceStub]:
    """A ShardService stub on a channel of its own to the shard at `address`."""
    with open_channel(address) as channel:
        yield shard_pb2_grpc.ShardServiceStub(channel)


def _stats(placement: shard_pb2.Placement, run_id: str) -> list[shard_pb2.GetStatsResponse]:
    out = []
    for address in placement.shards:
        with _shard(address) as stub:
            out.append(stub.GetStats(shard_pb2.GetStatsRequest(run_id=run_id)))
    return out


def _open_stream(stub: shard_pb2_grpc.ShardServiceStub, run_id: str, worker: int) -> shard_pb2.OpenStreamResponse:
    """OpenStream alone: a token, not yet presented."""
    return stub.OpenStream(shard_pb2.OpenStreamRequest(run_id=run_id, worker_id=worker), timeout=10)


def _attach(stub: shard_pb2_grpc.ShardServiceStub, run_id: str, worker: int) -> tuple[int, socket.socket]:
    """A data stream opened by hand with a raw socket: OpenStream, connect, present the token,
    read the shard's one-byte answer. (stream id, socket)."""
    response = _open_stream(stub, run_id, worker)
    assert len(response.token) == data_stream.TOKEN_BYTES and response.stream > 0 and response.port > 0
    sock = socket.create_connection((HOST, response.port), timeout=10)
    sock.sendall(response.token)
    assert sock.recv(1) == b"\x01"
    return response.stream, sock


def _peer_state(sock: socket.socket, timeout_s: float = 5.0) -> str:
    """What the other end did: "closed" the connection (EOF or reset), sent "data", or nothing
    within `timeout_s` ("quiet")."""
    sock.settimeout(timeout_s)
    try:
        return "data" if sock.recv(1) else "closed"
    except ConnectionResetError:
        return "closed"
    except TimeoutError:
        return "quiet"


def _peer_closed(sock: socket.socket) -> bool:
    return _peer_state(sock) == "closed"


def _part(p: shard_pb2.PartPlacement, codec: tensor_pb2.CodecParams = NONE, **fields) -> tensor_pb2.TensorPart:
    part = tensor_pb2.TensorPart(
        name=p.name, index=p.index, offset=p.offset, count=p.count, dtype=tensor_pb2.DTYPE_FLOAT32, **fields
    )
    part.codec.CopyFrom(codec)
    return part


def _call(stream_id: int, number: int) -> shard_pb2.StreamCall:
    return shard_pb2.StreamCall(stream=stream_id, call=number)


def _push_request(
    run_id: str, worker: int, step: int, part: tensor_pb2.TensorPart, stream: shard_pb2.StreamCall | None = None
) -> shard_pb2.PushRequest:
    request = shard_pb2.PushRequest(run_id=run_id, worker_id=worker, step=step, part_count=1)
    request.part.CopyFrom(part)
    if stream is not None:
        request.stream.CopyFrom(stream)
    return request


def _frame(number: int, payload: bytes) -> bytes:
    """A call's bytes on a data stream: its number (u64, little-endian), then the payload."""
    return struct.pack("<Q", number) + payload


def _read_exactly(sock: socket.socket, size: int, timeout_s: float) -> bytearray:
    """`size` bytes off the stream; fails if the shard closes it first."""
    sock.settimeout(timeout_s)
    got = bytearray(size)
    view, read = memoryview(got), 0
    while read < size:
        received = sock.recv_into(view[read:])
        assert received, "the shard closed the stream"
        read += received
    return got


@contextmanager
def _writing(sock: socket.socket, data: bytes, close_after: bool = False) -> Iterator[None]:
    """Write `data` on `sock` from another thread while the block (the call) runs: the shard reads
    the stream while its call runs, and more than a socket buffer would block a lone writer."""

    def write() -> None:
        try:
            sock.sendall(data)
            if close_after:
                sock.close()
        except OSError:
            pass  # the shard refused the call and closed the stream before reading it all

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        yield
    finally:
        writer.join(15)
        assert not writer.is_alive(), "the bytes on the stream were never read"


def _floats(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def _pulled(client: ParameterClient, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A pull into fresh zeros shaped like `tensors`: whatever it shows came from the shards."""
    pulled = {n: torch.zeros_like(t) for n, t in tensors.items()}
    client.pull(pulled)
    return pulled


def _assert_near(pulled: torch.Tensor, expected: torch.Tensor) -> None:
    """The shard's sgd steps against the same steps here, within float32 rounding."""
    torch.testing.assert_close(pulled, expected, rtol=0, atol=1e-5)


class _Run(ExitStack):
    """A run the test joined as its workers; when its block ends, what the test opened for it closes
    and the workers leave. Its clients move payloads inline unless told: the test opens streams."""

    def __init__(
        self,
        address: str,
        spec: run_pb2.RunSpec,
        tensors: dict[str, torch.Tensor],
        n_workers: int = 1,
        codec: tensor_pb2.CodecParams = NONE,
        transport: str = "grpc",
    ) -> None:
        super().__init__()
        self.id, sessions, self.clients, self.placement = join_run(address, spec, tensors, n_workers, codec, transport)
        self.workers = [s.worker_id for s in sessions]
        self.callback(leave, sessions, self.clients)

    def stub(self, shard: int) -> shard_pb2_grpc.ShardServiceStub:
        return self.enter_context(_shard(self.placement.shards[shard]))

    def attach(self, stub: shard_pb2_grpc.ShardServiceStub, worker: int) -> tuple[int, socket.socket]:
        """`_attach`, its socket closed with the run."""
        stream_id, sock = _attach(stub, self.id, worker)
        self.callback(sock.close)
        return stream_id, sock

    def stats(self) -> list[shard_pb2.GetStatsResponse]:
        return _stats(self.placement, self.id)


# --- 1. the same training through a stream and inline ------------------------------------------


def _train(address: str, codec: str, transport: str, monkeypatch, steps: int = 3):
    """A few asgd steps of push and pull; (weights pulled at the end, client facts, shard stats,
    bytes the client sent and received on its streams)."""
    torch.manual_seed(0)
    # 1.25 MiB parts: w is cut into two full parts (int8 payloads of 320 KiB, streamed) and one of
    # 565 KiB (streamed as float32 in a pull, inline in an int8 push); b travels inline.
    tensors = {"w": torch.randn(800, 1000), "b": torch.randn(77)}
    grads = [{n: torch.randn_like(t) for n, t in tensors.items()} for _ in range(steps)]
    streamed = {"sent": 0, "received": 0}
    send, receive_into = CallSender.send, CallReceiver.receive_into

    def counting_send(self, payload):
        streamed["sent"] += len(memoryview(payload).cast("B"))
        return send(self, payload)

    def counting_receive_into(self, view):
        streamed["received"] += len(view)
        return receive_into(self, view)

    with monkeypatch.context() as patch:  # a spy: the real methods run
        patch.setattr(CallSender, "send", counting_send)
        patch.setattr(CallReceiver, "receive_into", counting_receive_into)
        spec = _spec(part_size=1280 << 10, lr=0.1)
        with _Run(address, spec, tensors, codec=parse_codec(codec), transport=transport) as run:
            client = run.clients[0]
            assert len(run.placement.parts) == 4
            facts = {"streamed": client.streamed_shards, "shared": client.shared_shards}
            pulled = asgd_steps(client, tensors, grads)
            facts["streamed_after"] = client.streamed_shards
            facts["traffic"] = (client.traffic.bytes_pushed, client.traffic.bytes_pulled)
            stats = run.stats()
            big = sum(4 * p.count for p in run.placement.parts if 4 * p.count > wire.SMALL_PAYLOAD)
            facts["big_float_bytes"] = big
            return pulled, facts, stats, streamed


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_streamed_payloads_give_the_same_weights_as_inline_ones(shards_only, codec, monkeypatch):
    steps = 3
    inline, inline_facts, inline_stats, inline_streamed = _train(shards_only.address, codec, "grpc", monkeypatch)
    on_stream, facts, stats, streamed = _train(shards_only.address, codec, "stream", monkeypatch)
    assert inline_facts["streamed"] == [] and inline_streamed == {"sent": 0, "received": 0}
    assert facts["streamed"] == facts["streamed_after"] == [0, 1, 2] and facts["shared"] == []
    for name in inline:
        assert torch.equal(on_stream[name], inline[name]), name  # bit-exact
    # The large payloads really went on the streams: every pull's float32 parts over 256 KiB ...
    assert streamed["received"] == (steps + 1) * facts["big_float_bytes"]
    if codec == "none":
        assert streamed["sent"] == steps * facts["big_float_bytes"]
    else:  # ... and the int8 payloads over 256 KiB (two parts of 327680 values, 4-byte scale)
        assert streamed["sent"] == steps * 2 * (4 + 327680)
    # The shards counted every payload byte, wherever it travelled, as the worker did.
    for traffic, shard_stats in ((inline_facts["traffic"], inline_stats), (facts["traffic"], stats)):
        pushed, pulled = traffic
        assert sum(s.bytes_pushed for s in shard_stats) == pushed
        assert sum(s.bytes_pulled for s in shard_stats) == pulled == (steps + 1) * 4 * (800 * 1000 + 77)
        assert [s.pushes for s in shard_stats] == [steps] * 3
    if codec == "none":
        assert facts["traffic"][0] == steps * 4 * (800 * 1000 + 77)
    assert facts["traffic"] == inline_facts["traffic"]


# --- 2. OpenStream --------------------------------------------------------------------------------


def test_open_stream_rejects_unknown_runs_non_members_and_a_fifth_stream(shards_only):
    tensors = {"w": torch.randn(1000)}
    with _Run(shards_only.address, _spec(workers=2), tensors, n_workers=2) as run:
        mine, theirs = run.workers
        stub = run.stub(0)
        _rejected(lambda: _open_stream(stub, "nope", mine), grpc.StatusCode.NOT_FOUND, "unknown run 'nope'")
        _rejected(lambda: _open_stream(stub, run.id, 9999), PRECONDITION, "worker 9999 is not a live member")
        ids = {run.attach(stub, mine)[0] for _ in range(4)}
        assert len(ids) == 4
        _rejected(
            lambda: _open_stream(stub, run.id, mine),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"worker {mine} already has 4 data streams",
        )
        # The limit is per worker: the other worker still gets one.
        stream_id, _ = run.attach(stub, theirs)
        assert stream_id not in ids


def test_tokens_asked_for_before_connecting_do_not_exceed_the_stream_limit(shards_only):
    with _Run(shards_only.address, _spec(), {"w": torch.randn(1000)}) as run:
        (mine,) = run.workers
        stub = run.stub(0)
        responses = []
        for _ in range(6):
            try:
                responses.append(_open_stream(stub, run.id, mine))
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
        attached = 0
        for response in responses:
            try:
                stream = DataStream.connect(HOST, response.port, response.token, response.stream, 5)
            except StreamError:
                continue
            run.callback(stream.close)
            attached += 1
        assert attached <= 4, f"{attached} streams attached for one worker"


# --- 3. the handshake -----------------------------------------------------------------------------


def test_a_connection_needs_the_token_and_a_token_works_once(shards_only):
    with _Run(shards_only.address, _spec(), {"w": torch.randn(1000)}) as run:
        (mine,) = run.workers
        response = _open_stream(run.stub(0), run.id, mine)
        port, token = response.port, response.token
        wrong = bytes(b ^ 0xFF for b in token)
        with pytest.raises(StreamError, match="refused"):
            DataStream.connect(HOST, port, wrong, response.stream, 5)
        # Part of a token, then nothing more: closed without an answer.
        with socket.create_connection((HOST, port), timeout=5) as sock:
            sock.sendall(token[:5])
            sock.shutdown(socket.SHUT_WR)
            assert _peer_closed(sock), "the shard answered half a token"
        # Connecting and closing at once, and the wrong token followed by more bytes.
        socket.create_connection((HOST, port), timeout=5).close()
        with socket.create_connection((HOST, port), timeout=5) as sock:
            sock.sendall(wrong + token)
            assert _peer_closed(sock), "the shard accepted a wrong token"
        # None of that used the token up; once used, it is gone.
        stream = DataStream.connect(HOST, port, token, response.stream, 5)
        run.callback(stream.close)
        assert not stream.closed and stream.id == response.stream
        with pytest.raises(StreamError, match="refused"):
            DataStream.connect(HOST, port, token, response.stream, 5)
        with socket.create_connection((HOST, port), timeout=5) as sock:
            sock.sendall(token)
            assert _peer_closed(sock), "a token was accepted twice"
        with pytest.raises(StreamError, match="cannot connect"):
            DataStream.connect(HOST, 1, token, response.stream, 5)  # nothing listens on port 1


def test_a_listener_refuses_expired_tokens_and_streams_its_run_refuses(monkeypatch):
    monkeypatch.setattr(data_stream, "HANDSHAKE_S", 0.3)
    listener = StreamListener(0)
    attached: list[DataStream] = []
    try:
        token, first = listener.expect(lambda s: attached.append(s) is None)
        late, _ = listener.expect(lambda s: attached.append(s) is None)
        refused, _ = listener.expect(lambda s: False)
        assert len({token, late, refused}) == 3
        stream = DataStream.connect(HOST, listener.port, token, first, 5)
        assert [s.id for s in attached] == [first]
        time.sleep(0.5)
        with pytest.raises(StreamError, match="refused"):
            DataStream.connect(HOST, listener.port, late, 2, 5)
        with pytest.raises(StreamError, match="refused"):
            DataStream.connect(HOST, listener.port, refused, 3, 5)
        assert len(attached) == 1
        # Both ends of the attached stream carry a call's bytes, checked against its number.
        with stream.sending(5, 5) as sender:
            sender.send(b"abc")
            sender.send(b"defg")
        target = bytearray(7)
        with attached[0].receiving(5, 5) as receiver:
            receiver.receive_into(memoryview(target)[:3])
            receiver.receive_into(memoryview(target)[3:])
        assert bytes(target) == b"abcdefg"
        with stream.sending(6, 5) as sender:
            sender.send(b"x")
        with pytest.raises(StreamError, match="bytes of call 6, expected call 7"):
            with attached[0].receiving(7, 5) as receiver:
                receiver.receive_into(memoryview(bytearray(1)))
        assert attached[0].closed  # a receiver that lost the framing closed its stream
        with attached[0].receiving(8, 5) as receiver:
            assert receiver is None
        with pytest.raises(StreamError):  # ... and the worker's end sees it
            with stream.receiving(1, 5) as receiver:
                receiver.receive_into(memoryview(bytearray(1)))
        assert stream.closed
    finally:
        listener.close()
        for s in attached:
            s.close()


def test_a_closed_listener_accepts_no_connection():
    listener = StreamListener(0)
    time.sleep(0.3)  # its accept thread is waiting in accept()
    listener.close()
    time.sleep(0.1)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((HOST, listener.port), timeout=2).close()


def test_connections_without_a_token_are_bounded_in_number_and_time(monkeypatch):
    monkeypatch.setattr(data_stream, "HANDSHAKE_S", 1.0)
    listener = StreamListener(0)
    idle: list[socket.socket] = []
    try:
        # A token trickled a byte at a time has HANDSHAKE_S in all, not per byte.
        trickle = socket.create_connection((HOST, listener.port), timeout=5)
        idle.append(trickle)
        start = time.monotonic()
        with contextlib.suppress(OSError):
            for _ in range(data_stream.TOKEN_BYTES):
                trickle.sendall(b"x")
                time.sleep(0.3)
        assert _peer_closed(trickle) and time.monotonic() - start < 3.5
        # Connections that send nothing take at most MAX_HANDSHAKES threads: the next is refused.
        idle += [socket.create_connection((HOST, listener.port)) for _ in range(data_stream.MAX_HANDSHAKES)]
        time.sleep(0.3)
        extra = socket.create_connection((HOST, listener.port))
        idle.append(extra)
        assert _peer_state(extra, timeout_s=0.9) == "closed"
    finally:
        listener.close()
        for sock in idle:
            sock.close()


# --- 4. bad streamed pushes -------------------------------------------------------------------------


def test_bad_streamed_pushes_are_rejected_and_change_nothing(shards_only):
    torch.manual_seed(4)
    tensors = {"w": torch.randn(100_000)}  # one 400 KB part: streamed
    with _Run(shards_only.address, _spec(workers=2), tensors, n_workers=2) as run:
        mine, theirs = run.workers
        (p,) = run.placement.parts
        size = 4 * p.count
        grad = torch.randn(p.count)
        good = _floats(grad)
        run.clients[0].register(tensors)
        stub = run.stub(p.shard)

        def attach(worker: int = mine) -> tuple[int, socket.socket]:
            return run.attach(stub, worker)

        def push(part: tensor_pb2.TensorPart, stream=None, worker: int = mine, step: int = 0):
            return stub.Push(iter([_push_request(run.id, worker, step, part, stream)]), timeout=10)

        # Each failed call below that claimed a stream closes it, and a closed stream still counts
        # towards a worker's four in a run: this worker's four are used, then the other worker's.
        s1, sock1 = attach()
        # A streamed part in a push that names no stream; a stream that does not exist; another
        # worker's stream. The stream is not touched (nothing was written for these).
        _rejected(lambda: push(_part(p, streamed=size)), INVALID, "part w/0 is streamed, but the call has no stream")
        _rejected(lambda: push(_part(p, streamed=size), _call(999_999, 1)), PRECONDITION, "data stream 999999 is not")
        _rejected(
            lambda: push(_part(p, streamed=size), _call(s1, 1), worker=theirs),
            PRECONDITION,
            f"data stream {s1} is not open for worker {theirs}",
        )
        # More bytes than any payload of the part could have: refused before reading (or allocating).
        s2, sock2 = attach()
        for (stream_id, sock), too_many in (((s1, sock1), size + 1), ((s2, sock2), 1 << 62)):
            _rejected(
                lambda n=too_many, s=stream_id: push(_part(p, streamed=n), _call(s, 1)),
                INVALID,
                "streamed bytes, more than",
            )
            assert _peer_closed(sock), "a push that failed on a stream left it open"
            _rejected(
                lambda s=stream_id: push(_part(p, streamed=size), _call(s, 2)),
                PRECONDITION,
                f"data stream {stream_id} is not open for worker {mine}",
            )
        # A payload in the message and on the stream.
        s3, sock3 = attach()
        _rejected(lambda: push(_part(p, streamed=size, payload=good), _call(s3, 1)), INVALID, "and has another payload")
        assert _peer_closed(sock3)
        # Bytes of another call: the framing is lost, the stream closes.
        s4, sock4 = attach()
        with _writing(sock4, _frame(99, good)):
            _rejected(
                lambda: push(_part(p, streamed=size), _call(s4, 1)), DATA_LOSS, "bytes of call 99, expected call 1"
            )
        assert _peer_closed(sock4)
        _rejected(lambda: push(_part(p, streamed=size), _call(s4, 2)), PRECONDITION, f"data stream {s4} is not open")
        # NaN in the streamed bytes.
        t1, tsock1 = attach(theirs)
        nan = grad.clone()
        nan[1234] = float("nan")
        with _writing(tsock1, _frame(1, _floats(nan))):
            _rejected(lambda: push(_part(p, streamed=size), _call(t1, 1), worker=theirs), INVALID, "NaN")
        assert _peer_closed(tsock1)
        # Too few bytes for the codec: read, then refused by the decoder.
        t2, tsock2 = attach(theirs)
        with _writing(tsock2, _frame(1, good[:-4])):
            _rejected(
                lambda: push(_part(p, streamed=size - 4), _call(t2, 1), worker=theirs), INVALID, f"expected {size}"
            )
        # The worker closes its end halfway through the part's bytes.
        t3, tsock3 = attach(theirs)
        with _writing(tsock3, _frame(1, good[: size // 2]), close_after=True):
            _rejected(
                lambda: push(_part(p, streamed=size), _call(t3, 1), worker=theirs),
                DATA_LOSS,
                "the peer closed the data stream",
            )

        # Nothing changed.
        assert [s.pushes for s in run.stats()] == [0, 0, 0]
        assert torch.equal(_pulled(run.clients[0], tensors)["w"], tensors["w"])

        # A good streamed push on a fresh stream is applied once; a retry of it reads its bytes,
        # is not applied again and is answered as the push was (applied); the stream still
        # carries the next push.
        t4, tsock4 = attach(theirs)
        for number, step, applied in ((1, 0, True), (2, 0, True), (3, 1, True)):
            with _writing(tsock4, _frame(number, good)):
                response = push(_part(p, streamed=size), _call(t4, number), worker=theirs, step=step)
            assert (response.parts, response.applied) == (1, applied)
        stats = run.stats()[p.shard]
        assert (stats.pushes, stats.bytes_pushed) == (2, 2 * size)
        _assert_near(_pulled(run.clients[0], tensors)["w"], tensors["w"] - 2 * LR * grad)
        assert _peer_state(tsock4, 0.2) == "quiet"


def test_a_stream_carries_one_push_at_a_time(shards_only):
    tensors = {"w": torch.randn(100_000)}
    with _Run(shards_only.address, _spec(), tensors) as run:
        (mine,) = run.workers
        (p,) = run.placement.parts
        size = 4 * p.count
        grad = torch.randn(p.count)
        run.clients[0].register(tensors)
        stub = run.stub(p.shard)
        stream_id, sock = run.attach(stub, mine)

        def push(number: int, step: int):
            request = _push_request(run.id, mine, step, _part(p, streamed=size), _call(stream_id, number))
            return stub.Push(iter([request]), timeout=20)

        first: list = []
        waiting = threading.Thread(target=lambda: first.append(push(1, 0)), daemon=True)
        waiting.start()  # holds the stream's receive direction while it waits for its bytes
        time.sleep(1.0)
        _rejected(lambda: push(2, 1), PRECONDITION, f"data stream {stream_id} is busy or closed")
        sock.sendall(_frame(1, _floats(grad)))
        waiting.join(15)
        assert first and first[0].applied
        _assert_near(_pulled(run.clients[0], tensors)["w"], tensors["w"] - LR * grad)


# --- 5. a pull read off the stream by hand ---------------------------------------------------------


def test_a_pull_on_a_stream_sends_large_payloads_after_their_messages(shards_only):
    torch.manual_seed(5)
    # One part of 800 KB (streamed, and as fp16 too) and one of 4 KB (inline), on two shards: the
    # part size is w's, so that the model's bytes are worth two shards.
    tensors = {"w": torch.randn(200_000), "b": torch.randn(1000)}
    spec = _spec(workers=2, part_size=4 * 200_000)
    with _Run(shards_only.address, spec, tensors, n_workers=2) as run:
        mine, theirs = run.workers
        shard_of = {p.name: p.shard for p in run.placement.parts}
        assert shard_of["w"] != shard_of["b"]
        run.clients[0].register(tensors)
        stubs = {name: run.stub(shard) for name, shard in shard_of.items()}

        def pull(name: str, stream: int, number: int, codec=NONE, worker: int = mine):
            request = shard_pb2.PullRequest(run_id=run.id, worker_id=worker, codec=codec, stream=_call(stream, number))
            return stubs[name].Pull(request, timeout=10)

        stream_id, sock = run.attach(stubs["w"], mine)
        for number, codec, dtype in ((7, NONE, np.float32), (8, FP16, np.float16)):
            responses = pull("w", stream_id, number, codec)
            (response,) = list(responses)  # the bytes wait in the socket buffer meanwhile
            assert not response.parts
            part = response.part
            assert (part.name, part.index, part.payload) == ("w", 0, b"")
            assert part.streamed == np.dtype(dtype).itemsize * part.count
            got = _read_exactly(sock, 8 + part.streamed, 5)
            assert got[:8] == struct.pack("<Q", number)
            expected = tensors["w"].numpy().astype(dtype)
            assert np.array_equal(np.frombuffer(bytes(got[8:]), dtype=dtype), expected)
        stats = run.stats()[shard_of["w"]]
        assert stats.bytes_pulled == 4 * 200_000 + 2 * 200_000

        # A small part travels in its message even when a stream is offered: nothing on the stream.
        small_id, small_sock = run.attach(stubs["b"], mine)
        (response,) = list(pull("b", small_id, 1))
        (part,) = wire.parts_of(response)
        assert part.streamed == 0 and np.array_equal(np.frombuffer(part.payload, np.float32), tensors["b"].numpy())
        assert _peer_state(small_sock, 0.2) == "quiet"  # no bytes, and open

        # Another worker's stream, and one that does not exist.
        _rejected(lambda: list(pull("w", stream_id, 9, worker=theirs)), PRECONDITION, f"not open for worker {theirs}")
        _rejected(lambda: list(pull("w", 424242, 9)), PRECONDITION, "data stream 424242 is not open")


def test_a_pulled_part_longer_than_its_codec_allows_is_refused_before_reading():
    # 10 float32 values are 40 bytes: a shard announcing 41 is refused at once, not waited for.
    mine, theirs = socket.socketpair()
    stream = DataStream(mine, 1)
    try:
        part = tensor_pb2.TensorPart(name="w", index=0, count=10, streamed=41, codec=NONE)
        with stream.receiving(1, 5) as receiver:
            with pytest.raises(Invalid, match="41 streamed bytes, more than 40"):
                StreamIn(receiver).payload(part, b"", memoryview(torch.zeros(10).numpy()).cast("B"))
    finally:
        stream.close()
        theirs.close()


def test_a_streamed_pull_sends_the_part_as_it_was_when_the_pull_took_it(shards_only):
    # asgd applies pushes while a pull is still sending: the part's bytes on the stream are the
    # snapshot taken with its version, not the live weights. 48 MiB is more than both sockets'
    # buffers hold, so the shard is still sending when the other worker's push lands.
    n = 12 << 20
    tensors = {"w": torch.arange(n, dtype=torch.float32)}
    with _Run(shards_only.address, _spec(workers=2, part_size=4 * n), tensors, n_workers=2) as run:
        mine = run.workers[0]
        (shard,) = {p.shard for p in run.placement.parts}
        run.clients[0].register(tensors)
        stub = run.stub(shard)
        stream_id, sock = run.attach(stub, mine)
        request = shard_pb2.PullRequest(run_id=run.id, worker_id=mine, stream=_call(stream_id, 1))
        responses = stub.Pull(request, timeout=30)
        part = next(responses).part
        assert part.streamed == 4 * n and part.version == 0
        run.clients[1].push({"w": torch.ones(n)}, 0)  # applied at once (asgd): w - 0.5
        got = _read_exactly(sock, 8 + 4 * n, 10)
        assert list(responses) == []
        assert bytes(got[:8]) == struct.pack("<Q", 1)
        assert np.array_equal(np.frombuffer(got, np.float32, offset=8), tensors["w"].numpy())
        assert torch.equal(_pulled(run.clients[0], tensors)["w"], tensors["w"] - LR)


# --- 6. the worker's fallback ------------------------------------------------------------------------


def _stream(client: ParameterClient, shard: int) -> DataStream | None:
    """The data stream the client's link to `shard` holds now (None: none, payloads inline)."""
    return getattr(client.links[shard].route, "stream", None)


def test_a_push_whose_data_stream_breaks_lands_once_and_later_calls_go_inline(shards_only, monkeypatch):
    monkeypatch.setattr(route_module, "REOPEN_S", 3600.0)  # no new stream during this test
    torch.manual_seed(6)
    tensors = {"w": torch.randn(300_000)}  # three 400 KB parts, one per shard
    with _Run(shards_only.address, _spec(part_size=400_000), tensors, transport="stream") as run:
        client = run.clients[0]
        assert sorted(p.shard for p in run.placement.parts) == [0, 1, 2]
        assert client.streamed_shards == [0, 1, 2]
        client.register(tensors)
        broken: list[DataStream] = []
        used: list[int] = []  # the stream of every payload sent or received
        send, receive_into = CallSender.send, CallReceiver.receive_into

        def breaking(real, after: int):
            """A spy on `real`: the stream under it breaks when `after` streams have broken before;
            otherwise it notes the stream in `used` and runs `real`."""

            def spy(self, payload):
                if len(broken) == after:
                    broken.append(self.stream)
                    self.stream.close()
                    raise StreamError(f"data stream {self.stream.id}: broken by the test")
                used.append(self.stream.id)
                return real(self, payload)

            return spy

        # The first payload of any shard's push: the stream breaks under it.
        monkeypatch.setattr(CallSender, "send", breaking(send, after=0))
        grads = [{"w": torch.randn_like(tensors["w"])} for _ in range(3)]
        ids = {_stream(client, s).id for s in (0, 1, 2)}
        client.push(grads[0], 0)
        (first,) = broken
        others = [s for s in (0, 1, 2) if _stream(client, s) is not None]
        assert client.streamed_shards == others and len(others) == 2 and len(used) == 2
        assert {first.id, *used} == ids
        expected = tensors["w"] - LR * grads[0]["w"]
        _assert_near(_pulled(client, tensors)["w"], expected)
        stats = run.stats()
        assert [s.pushes for s in stats] == [1, 1, 1]  # once each, the broken shard's too
        assert [s.bytes_pushed for s in stats] == [4 * 100_000] * 3
        # Later pushes: inline to that shard, still on the streams to the others.
        used.clear()
        client.push(grads[1], 1)
        assert sorted(used) == sorted(_stream(client, s).id for s in others)
        # A pull whose stream breaks under it is fetched again inline.
        monkeypatch.setattr(CallReceiver, "receive_into", breaking(receive_into, after=1))  # the first of any pull
        pulled = _pulled(client, tensors)
        expected -= LR * grads[1]["w"]
        _assert_near(pulled["w"], expected)
        assert len(broken) == 2 and broken[1] is not first
        (last,) = [s for s in others if _stream(client, s) is not None]
        assert client.streamed_shards == [last]
        used.clear()
        client.push(grads[2], 2)
        pulled = _pulled(client, tensors)
        assert used == [_stream(client, last).id] * 2  # one push and one pull on the last stream
        expected -= LR * grads[2]["w"]
        _assert_near(pulled["w"], expected)
        stats = run.stats()
        assert [s.pushes for s in stats] == [3, 3, 3]
        assert [s.bytes_pushed for s in stats] == [3 * 4 * 100_000] * 3
        assert client.traffic.bytes_pulled == 3 * 4 * 300_000  # three pulls, the refetched one counted once


def test_a_broken_stream_is_opened_again_in_the_background(shards_only, monkeypatch):
    monkeypatch.setattr(route_module, "REOPEN_S", 0.2)
    torch.manual_seed(7)
    tensors = {"w": torch.randn(100_000)}  # one 400 KB part: streamed
    with _Run(shards_only.address, _spec(part_size=400_000), tensors, transport="stream") as run:
        client = run.clients[0]
        (shard,) = {p.shard for p in run.placement.parts}
        client.register(tensors)
        old = _stream(client, shard)
        old.close()  # as a dropped connection would: the next call finds it closed and goes inline
        grads = [{"w": torch.randn_like(tensors["w"])} for _ in range(2)]
        client.push(grads[0], 0)
        deadline = time.monotonic() + 10
        while client.streamed_shards != [shard]:
            assert time.monotonic() < deadline, "no new stream"
            time.sleep(0.05)
        new = _stream(client, shard)
        assert new is not old and new.id != old.id
        used: list[int] = []
        send = CallSender.send

        def counting_send(self, payload):
            used.append(self.stream.id)
            return send(self, payload)

        monkeypatch.setattr(CallSender, "send", counting_send)
        client.push(grads[1], 1)
        assert used == [new.id]
        expected = tensors["w"] - LR * grads[0]["w"] - LR * grads[1]["w"]
        _assert_near(_pulled(client, tensors)["w"], expected)
        # The shard forgot the stream the worker closed: with the new one, three more reach the limit.
        (mine,) = run.workers
        stub = run.stub(shard)
        for _ in range(3):
            run.attach(stub, mine)
        _rejected(lambda: _open_stream(stub, run.id, mine), grpc.StatusCode.RESOURCE_EXHAUSTED, "already has 4")


def test_streams_closed_under_running_pushes_lose_nothing(shards_only):
    """The worker's streams closed from another thread at some point of a push (before, during or
    after its bytes): whichever, every push lands once and the next ones go inline."""
    torch.manual_seed(7)
    tensors = {"w": torch.randn(3 * 262_144)}  # three 1 MiB parts
    with _Run(shards_only.address, _spec(part_size=1 << 20), tensors, transport="stream") as run:
        client = run.clients[0]
        client.register(tensors)
        grads = [{"w": torch.randn_like(tensors["w"])} for _ in range(4)]
        expected = tensors["w"].clone()
        for step, grad in enumerate(grads):
            if step == 1:
                streams = [_stream(client, s) for s in range(3)]
                timers = [threading.Timer(0.002 * (i + 1), s.close) for i, s in enumerate(streams)]
                for timer in timers:
                    timer.start()
            client.push(grad, step)
            if step == 1:
                for timer in timers:
                    timer.join()
                assert client.streamed_shards == []
            expected -= LR * grad["w"]
        _assert_near(_pulled(client, tensors)["w"], expected)
        assert [s.pushes for s in run.stats()] == [4, 4, 4]


# --- 7. shards without a data port, and a run's end ---------------------------------------------------


@contextmanager
def _in_process_shards(listeners: list[StreamListener | None]) -> Iterator[list[str]]:
    """Shard servers in this process, each with the given data port (None: none); their addresses."""
    servers, addresses = [], []
    try:
        for listener in listeners:
            server = make_server(max_workers=8)
            add_shard_servicer(ShardServicer(torch.device("cpu"), listener), server)
            addresses.append(f"{HOST}:{bind(server, 0)}")
            server.start()
            servers.append(server)
        yield addresses
    finally:
        for server in servers:
            server.stop(0)
        for listener in listeners:
            if listener is not None:
                listener.close()


def _open_run(addresses: list[str], tensors: dict[str, torch.Tensor], workers: list[int], part_size: int):
    placement = place(tensor_specs(tensors), addresses, part_size)
    for index, address in enumerate(addresses):
        request = shard_pb2.OpenRunRequest(
            run_id="r1",
            spec=_spec(len(workers)),
            placement=placement,
            shard_index=index,
            workers=workers,
            total_steps=10,
        )
        with _shard(address) as stub:
            stub.OpenRun(request, timeout=10)
    return placement


def test_a_shard_without_a_data_port_gets_payloads_inline():
    torch.manual_seed(8)
    tensors = {"w": torch.randn(200_000)}  # two 400 KB parts: one on each shard
    with _in_process_shards([StreamListener(0), None]) as addresses:
        placement = _open_run(addresses, tensors, [0], 400_000)
        assert sorted(p.shard for p in placement.parts) == [0, 1]
        with _shard(addresses[1]) as stub:
            _rejected(lambda: _open_stream(stub, "r1", 0), PRECONDITION, "this shard has no data port")
        client = ParameterClient(placement, "r1", 0, NONE, NONE, timeout_s=10, transport="stream")
        try:
            assert client.streamed_shards == [0]  # the shard with a data port only
            client.register(tensors)
            grad = {"w": torch.randn_like(tensors["w"])}
            client.push(grad, 0)
            _assert_near(_pulled(client, tensors)["w"], tensors["w"] - LR * grad["w"])
            assert client.traffic.bytes_pushed == client.traffic.bytes_pulled == 4 * 200_000
            assert [s.bytes_pushed for s in _stats(placement, "r1")] == [4 * 100_000] * 2
            assert client.streamed_shards == [0]
        finally:
            client.close()


def test_a_members_streams_close_when_it_leaves_and_all_when_the_run_closes():
    tensors = {"w": torch.randn(1000)}
    with _in_process_shards([StreamListener(0)]) as (address,), _shard(address) as stub:
        _open_run([address], tensors, [0, 1], 1 << 20)
        leaving, sock0 = _attach(stub, "r1", 0)
        staying, sock1 = _attach(stub, "r1", 1)
        pending = _open_stream(stub, "r1", 0)
        try:
            stub.SetMembership(shard_pb2.SetMembershipRequest(run_id="r1", epoch=1, live_workers=[1]), timeout=10)
            assert _peer_closed(sock0), "the stream of a worker that left stayed open"
            assert _peer_state(sock1, 0.2) == "quiet"
            # Its token, asked for before it left, no longer attaches; nor can it ask again.
            with pytest.raises(StreamError, match="refused"):
                DataStream.connect(HOST, pending.port, pending.token, pending.stream, 5)
            _rejected(lambda: _open_stream(stub, "r1", 0), PRECONDITION, "worker 0 is not a live member")
            late = _open_stream(stub, "r1", 1)
            stub.CloseRun(shard_pb2.CloseRunRequest(run_id="r1"), timeout=10)
            assert _peer_closed(sock1), "a stream outlived its run"
            with pytest.raises(StreamError, match="refused"):
                DataStream.connect(HOST, late.port, late.token, late.stream, 5)
            assert leaving != staying
        finally:
            sock0.close()
            sock1.close()


def test_a_stream_on_a_descriptor_past_1024_still_tells_whether_it_is_gone():
    # A shard with many workers' streams has descriptors past 1024, where select() fails: the
    # check every OpenStream makes (RunState.open_streams) must still work there.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    ours, theirs = socket.socketpair()
    high = os.dup2(ours.fileno(), 2000)
    ours.close()
    stream = DataStream(socket.socket(fileno=high), stream_id=1)
    try:
        assert not stream.gone()
        theirs.close()
        assert stream.gone()
    finally:
        stream.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_cancelled_streamed_push_frees_its_thread_and_closes_the_stream(shards_only):
    tensors = {"w": torch.zeros(100_000)}  # one 400 KB part: streamed
    with _Run(shards_only.address, _spec(), tensors) as run:
        (worker,) = run.workers
        (p,) = run.placement.parts
        run.clients[0].register(tensors)
        stub = run.stub(p.shard)
        stream_id, sock = run.attach(stub, worker)
        part = _part(p, streamed=4 * p.count)
        # The part's bytes never come; the call would hold a shard thread until its hour is up.
        call = stub.Push.future(iter([_push_request(run.id, worker, 0, part, _call(stream_id, 1))]), timeout=3600)
        time.sleep(0.5)
        call.cancel()
        # The shard closes the stream at once, which ends the read its thread was blocked in.
        assert _peer_state(sock, timeout_s=5.0) == "closed"
        assert run.clients[0].pull({"w": torch.zeros(100_000)}) is None  # the shard serves on
