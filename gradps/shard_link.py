"""A worker's link to one shard for one run: its channel, the bulk calls, the route its payloads
take (a Route of gradps/transport/), retries and the fall-back to the messages."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from gradps import wire
from gradps.auth.tls import client_tls
from gradps.channel import open_channel
from gradps.data_stream import StreamError
from gradps.errors import RolledBack, Unmapped
from gradps.transport import TRANSPORTS
from gradps.transport.base import Buffer, Inbound, Outbound, Route
from gradps.transport.data_stream import DataStreamRoute, as_buffer
from gradps.transport.framing import PART_FIELD, Item, frame, unframe
from gradps.transport.shared_memory import SharedMemoryRoute
from gradps.v1 import shard_pb2, shard_pb2_grpc, tensor_pb2

_LOGGER = logging.getLogger("gradps.worker")
_SERVICE = "/gradps.v1.ShardService/"
# Codes after which a call is made again: the shard applies a push, a deposit or an upload of
# initial values only whole (each call announces its parts), and a push once per (worker, step),
# so one whose outcome is unknown may be made again.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_ATTEMPTS = 3
# The longest pause between calls made again while a shard does not answer (it may be restarting;
# channels reconnect at least this often, gradps.channel).
_MAX_PAUSE_S = 1.0
# A shard that is down or starting (UNAVAILABLE), or stopping: a server shutting down cancels the
# calls in flight (CANCELLED; a worker never cancels its own), and a cancelled call applied nothing.
_NOT_ANSWERING = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
T = TypeVar("T")
M = TypeVar("M", bound=Message)
# Takes one received part: (metadata, the call's inbound route, bytes that came with it); returns
# the payload bytes it took.
Take = Callable[[tensor_pb2.TensorPart, Inbound, Buffer], int]


class ShardLink:
    """One shard as a worker reaches it. The bulk calls send and receive raw bytes (gradps/wire.py):
    one copy of each payload."""

    def __init__(
        self,
        index: int,
        address: str,
        run_id: str,
        worker_id: int,
        part_counts: list[int],
        timeout_s: float,
        abandoned: Callable[[], bool] = lambda: False,
    ) -> None:
        """`abandoned()`: whether the worker's run was stopped (a shard that does not answer is not
        waited for then: the coordinator failed the run, perhaps for that very shard)."""
        self.index = index
        self.address = address
        # Also how long a shard that does not answer (UNAVAILABLE: restarting, or being restored)
        # is waited for before a call fails.
        self.timeout_s = timeout_s
        self._abandoned = abandoned
        self._ids = (run_id, worker_id)
        self._part_counts = part_counts
        # Every call is read by the thread that makes it (the pulls among them).
        self.channel = open_channel(address, in_caller_thread=True)
        self.stub = shard_pb2_grpc.ShardServiceStub(self.channel)
        raw, ch = None, self.channel
        self._push = _Calls(
            ch.stream_unary(_SERVICE + "Push", raw, shard_pb2.PushResponse.FromString),
            ch.unary_unary(_SERVICE + "Push", raw, shard_pb2.PushResponse.FromString),
        )
        self._register = ch.stream_unary(
            _SERVICE + "RegisterTensors", raw, shard_pb2.RegisterTensorsResponse.FromString
        )
        self._pull = ch.unary_stream(_SERVICE + "Pull", shard_pb2.PullRequest.SerializeToString, raw)
        self._push_pull = _Calls(
            ch.stream_stream(_SERVICE + "PushPull", raw, raw), ch.unary_stream(_SERVICE + "PushPull", raw, raw)
        )
        self._average = _Calls(
            ch.stream_stream(_SERVICE + "GroupAverage", raw, raw), ch.unary_stream(_SERVICE + "GroupAverage", raw, raw)
        )
        self.route = Route()

    def set_up(self, transport: str, local: bool) -> None:
        """Choose the route: shared memory (`transport` "shm" and the shard `local`), else a data
        stream (unless "grpc"), else the messages; each where it can be set up."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r}: expected one of {', '.join(TRANSPORTS)}")
        self._transport, self._local = transport, local
        run_id, worker_id = self._ids
        route: Route | None = None
        if transport == "shm" and local:
            route = SharedMemoryRoute.map(self.stub, run_id, worker_id, self._part_counts, self.timeout_s)
        if route is None and transport != "grpc":
            host = self.address.rsplit(":", 1)[0].strip("[]")
            tls = client_tls(self.address)  # the channel's: streams are inside TLS when it is
            route = DataStreamRoute.connect(self.stub, host, run_id, worker_id, self.timeout_s, tls)
        self.route = route or Route()

    def register(self, header: shard_pb2.RegisterTensorsRequest, items: Iterable[Item]) -> None:
        """Upload initial values, one part a message, inline; made again as a push is (the shard
        sets them only whole)."""
        items = list(items)
        if not items:
            return
        head = _announcing(header, len(items)).SerializeToString()
        field = PART_FIELD["RegisterTensorsRequest"]

        def call(_: Outbound, __: Inbound) -> None:
            messages = (b"".join(wire.part_message(head, field, meta, as_buffer(data))) for meta, data in items)
            self._register(messages, timeout=self.timeout_s)

        self._attempts(call, send=False, receive=False, retry=_RETRYABLE)

    def push(self, header: shard_pb2.PushRequest, items: Iterable[Item]) -> shard_pb2.PushResponse:
        """Push `items` (`header.part_count` of them; unset: every part this shard holds, as the
        parameter client sends); made again (the items framed again, not encoded again) after a
        broken route, or an UNAVAILABLE or DEADLINE_EXCEEDED answer. `items` must give the same
        parts on every pass: the shard applies the push once, whole, whichever call brought it."""
        header = _announcing(header, header.part_count or len(self._part_counts))

        def call(out: Outbound, _: Inbound) -> shard_pb2.PushResponse:
            return self._push(_until_broken(frame(header, items, out)), out, timeout=self.timeout_s)

        return self._attempts(call, send=True, receive=False, retry=_RETRYABLE)

    def pull(self, request: shard_pb2.PullRequest, take: Take) -> tuple[int, shard_pb2.PullResponse]:
        """Pull `request`, each part handed to `take`; returns the payload bytes received and what
        every message of the answer repeats (its cut_step and final_weights)."""

        def call(_: Outbound, inbound: Inbound) -> tuple[int, shard_pb2.PullResponse]:
            named = shard_pb2.PullRequest()
            named.CopyFrom(request)
            inbound.name_in(named)
            received, head = 0, shard_pb2.PullResponse()
            for message in self._pull(named, timeout=self.timeout_s + 5):
                head, parts = unframe(message, shard_pb2.PullResponse)
                received += sum(take(meta, inbound, data) for meta, data in parts)
            head.ClearField("parts")  # taken: the caller keeps the header's own fields only
            return received, head

        return self._attempts(call, send=False, receive=True)

    def push_pull(
        self, header: shard_pb2.PushPullRequest, items: Iterable[Item], take: Take
    ) -> tuple[shard_pb2.PushResponse, int]:
        """Push `items`, then take the pull `header.pull` in the same call: the push's response
        (with the cut the pull's answer names) and the pulled payload bytes. Made again as a push is."""
        announced = _announcing(header, header.part_count or len(self._part_counts))

        def call(out: Outbound, inbound: Inbound) -> tuple[shard_pb2.PushResponse, int]:
            named = shard_pb2.PushPullRequest()
            named.CopyFrom(announced)
            inbound.name_in(named.pull)
            response, received = shard_pb2.PushResponse(), 0
            for message in self._push_pull(_until_broken(frame(named, items, out)), out, timeout=self.timeout_s + 5):
                head, parts = unframe(message, shard_pb2.PushPullResponse)
                response = head.push
                response.cut_step = max(response.cut_step, head.cut_step)
                received += sum(take(meta, inbound, data) for meta, data in parts)
            return response, received

        return self._attempts(call, send=True, receive=True, retry=_RETRYABLE)

    def exchange(self, header: shard_pb2.GroupAverageRequest, items: Iterable[Item], take: Take) -> int:
        """A group round: deposit `items`, hand each part of the average to `take`. A deposit
        sent again replaces the first and a fixed round answers again the same, so it is made
        again as a push is."""
        items = list(items)  # framed again by a retry
        announced = _announcing(header, len(items))

        def call(out: Outbound, inbound: Inbound) -> int:
            named = shard_pb2.GroupAverageRequest()
            named.CopyFrom(announced)
            inbound.name_in(named)  # frame copies it again for the outbound to name itself
            received = 0
            for message in self._average(_until_broken(frame(named, items, out)), out, timeout=self.timeout_s):
                parts = unframe(message, shard_pb2.GroupAverageResponse)[1]
                received += sum(take(meta, inbound, data) for meta, data in parts)
            return received

        return self._attempts(call, send=True, receive=True, retry=_RETRYABLE)

    def _attempts(
        self, call: Callable[[Outbound, Inbound], T], send: bool, receive: bool, retry: Iterable[grpc.StatusCode] = ()
    ) -> T:
        """`call` through the route, made again inline when the route broke under it, after the
        `retry` codes (a call whose outcome the worker cannot see: the shard applies what a call
        carries whole or not at all, and a push once, so making it again is safe), and while the
        shard does not answer, for up to `timeout_s` (UNAVAILABLE or CANCELLED: it stops, restarts,
        or its run is being restored; a shared segment it has lost is mapped again). RolledBack when the run
        went back to a checkpoint meanwhile."""
        give_up = time.monotonic() + self.timeout_s
        attempt = waits = 0  # calls that failed for another reason; UNAVAILABLE answers waited out
        while True:
            try:
                with self.route.call(send, receive) as (out, inbound):
                    return call(out, inbound)
            except (grpc.RpcError, StreamError) as e:
                code = e.code() if isinstance(e, grpc.RpcError) else grpc.StatusCode.DATA_LOSS
                if isinstance(e, grpc.RpcError) and (rolled := RolledBack.of(e, self._ids[0])) is not None:
                    raise rolled from None
                if code in _NOT_ANSWERING and time.monotonic() < give_up and not self._abandoned():
                    waits += 1
                    time.sleep(min(_MAX_PAUSE_S, 0.1 * 2**waits))
                    continue
                attempt += 1
                if isinstance(e, grpc.RpcError) and Unmapped.told(e) and attempt < _ATTEMPTS:
                    _LOGGER.warning("shard %d lost this worker's shared segment: mapping one again", self.index)
                    self.set_up(self._transport, self._local)
                    continue
                if attempt >= _ATTEMPTS or (code != grpc.StatusCode.DATA_LOSS and code not in retry):
                    raise
                if code == grpc.StatusCode.DATA_LOSS:
                    _LOGGER.warning("shard %d: %s; payloads inline for now", self.index, _reason(e))
                else:
                    time.sleep(0.2 * attempt)

    def close(self) -> None:
        self.route.close()
        self.channel.close()


def _announcing(header: M, count: int) -> M:
    """A copy of `header` that announces the call's `count` parts (`part_count`): the shard
    applies nothing of a call until it has them all."""
    announced = type(header)()
    announced.CopyFrom(header)
    announced.part_count = count  # type: ignore[attr-defined]
    return announced


class _Calls:
    """One bulk method, called as the request-streaming call it is or, when the call's request is
    one message, as a unary-request call on the same method: the same bytes on the wire, which
    grpcio sends from the calling thread. A streamed request is read by a thread grpcio starts for
    every call; on two busy cores starting it took longer than the round trip (py-spy)."""

    def __init__(self, streamed: Callable[..., Any], single: Callable[..., Any]) -> None:
        self.streamed, self._single = streamed, single

    def __call__(self, messages: Iterator[bytes], out: Outbound, timeout: float) -> Any:
        # Payloads in the messages or in shared memory: the next message can be made before this
        # one is sent (not where a payload's bytes follow its message on a data stream).
        if not out.follows:
            ahead = list(itertools.islice(messages, 2))
            if len(ahead) == 1:
                return self._single(ahead[0], timeout=timeout)
            messages = itertools.chain(ahead, messages)
        return self.streamed(messages, timeout=timeout)


def _until_broken(messages: Iterator[bytes]) -> Iterator[bytes]:
    """A call's messages, ending early when the route broke sending a payload: the shard, short
    of its bytes, then fails the call with DATA_LOSS and it is made again inline."""
    try:
        yield from messages
    except StreamError:
        return


def _reason(e: Exception) -> str:
    return f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
