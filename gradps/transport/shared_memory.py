"""Shared memory: payloads in a segment that a worker creates on its shard's host and the shard
maps (ShardService.MapSegment), so that they cross between the processes with one copy each way.

A worker's segment for one shard has two areas: pushes and deposits lay their payloads into the
first, pulls and averages name the second for the shard to write into (PullRequest.into). One
call uses an area at a time; a call that finds it busy sends inline.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import Message

from gradps.errors import Invalid
from gradps.shared_memory import ALIGN, RegionWriter, Segment, SegmentError, aligned, pid_namespace
from gradps.transport.base import INLINE_IN, INLINE_OUT, Buffer, Inbound, Outbound, Route
from gradps.v1 import shard_pb2, shard_pb2_grpc, tensor_pb2

_LOGGER = logging.getLogger("gradps.worker")


class RegionOut(Outbound):
    """Payloads written one after another into a region: a worker's push area, or the region a
    worker named for a shard's answer. Those that do not fit travel in the message."""

    def __init__(self, writer: RegionWriter) -> None:
        self._writer = writer

    def carry(self, meta: tensor_pb2.TensorPart, payload: object) -> bool:
        region = self._writer.put(payload)  # type: ignore[arg-type]
        if region is None:
            return False
        meta.shared.CopyFrom(region)
        return True


class RegionIn(Inbound):
    """Payloads that lie in shared segments (TensorPart.shared), their bytes found by `view`
    (region -> bytes, checked for this caller: SegmentError or a GradpsError); others in the
    messages. `into`: the region this side names for the peer to write into."""

    def __init__(
        self, view: Callable[[tensor_pb2.SharedRegion], memoryview], into: tensor_pb2.SharedRegion | None = None
    ) -> None:
        self._view = view
        self._into = into

    def name_in(self, header: Message) -> None:
        if self._into is not None:
            header.into.CopyFrom(self._into)  # type: ignore[attr-defined]

    def payload(self, meta: tensor_pb2.TensorPart, received: Buffer, into: memoryview | None = None) -> Buffer | None:
        if not meta.HasField("shared"):
            return super().payload(meta, received, into)
        name = f"{meta.name}/{meta.index}"
        if len(received) or meta.streamed:
            raise Invalid(f"part {name} has a payload and a shared one")
        try:
            return self._view(meta.shared)
        except SegmentError as e:
            raise Invalid(f"part {name}: {e}") from None


@dataclass
class _Area:
    """Half of the segment; `lock` is held by the call that uses it."""

    segment: Segment
    offset: int
    length: int
    lock: threading.Lock = field(default_factory=threading.Lock)

    def region(self) -> tensor_pb2.SharedRegion:
        return tensor_pb2.SharedRegion(segment=self.segment.name, offset=self.offset, length=self.length)

    def view(self, region: tensor_pb2.SharedRegion) -> memoryview:
        """The bytes of a region the shard wrote: only within this area."""
        if region.segment != self.segment.name:
            raise SegmentError(f"it arrived in segment {region.segment!r}, which this call did not offer")
        if region.offset < self.offset or region.offset + region.length > self.offset + self.length:
            raise SegmentError(f"it arrived at [{region.offset}, {region.offset + region.length}), outside the area")
        return self.segment.region(region.offset, region.length)


class SharedMemoryRoute(Route):
    """A worker's segment shared with one shard on its host."""

    def __init__(self, segment: Segment, length: int) -> None:
        self.segment = segment
        self._push = _Area(segment, ALIGN, length)
        self._pull = _Area(segment, ALIGN + length, length)
        self._closed = False

    @classmethod
    def map(
        cls,
        stub: shard_pb2_grpc.ShardServiceStub,
        run_id: str,
        worker_id: int,
        part_counts: list[int],
        timeout_s: float,
    ) -> SharedMemoryRoute | None:
        """A segment with room for every part of the shard twice (a push and a pull at once),
        mapped by the shard; None when it cannot be (another host or PID namespace, no memfd)."""
        # Any codec's payload of a part fits in its float32 bytes (top-k above half does not:
        # such parts go inline).
        length = sum(aligned(4 * count) for count in part_counts)
        try:
            segment = Segment.create(2 * length)
        except SegmentError as e:
            _LOGGER.info("payloads inline (%s)", e)
            return None
        try:
            request = shard_pb2.MapSegmentRequest(
                run_id=run_id,
                worker_id=worker_id,
                segment=segment.name,
                token=segment.token,
                pid=os.getpid(),
                fd=segment.descriptor(),
                pid_namespace=pid_namespace(),
            )
            # The shard opens the segment through the descriptor while the call runs.
            stub.MapSegment(request, timeout=min(timeout_s, 10.0))
        except grpc.RpcError as e:
            _LOGGER.info("payloads inline (%s: %s)", e.code().name, e.details())
            # The error's traceback holds this frame in a reference cycle: the segment's mapping
            # and descriptor go now, not whenever the collector runs.
            del segment
            return None
        segment.release()  # both processes map it now: it goes with the last
        return cls(segment, length)

    @property
    def open(self) -> bool:
        return not self._closed

    @contextmanager
    def call(self, send: bool, receive: bool) -> Iterator[tuple[Outbound, Inbound]]:
        with ExitStack() as held:
            out: Outbound = INLINE_OUT
            inbound: Inbound = INLINE_IN
            if send and not self._closed and held.enter_context(_claimed(self._push)):
                out = RegionOut(RegionWriter(self.segment, self._push.offset, self._push.length))
            if receive and not self._closed and held.enter_context(_claimed(self._pull)):
                inbound = RegionIn(self._pull.view, self._pull.region())
            yield out, inbound

    def close(self) -> None:
        # Unmapped when the last view goes (at once, unless a call is still running); the shard
        # drops its mapping when the run closes.
        self._closed = True


@contextmanager
def _claimed(area: _Area) -> Iterator[bool]:
    if not area.lock.acquire(blocking=False):
        yield False
        return
    try:
        yield True
    finally:
        area.lock.release()
