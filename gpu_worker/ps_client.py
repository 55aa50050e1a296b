"""A worker's connection to every shard of a run: pull weights, push gradients, in parallel."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from gradps import wire
from gradps.channel import open_channel
from gradps.codecs import (
    CodecError,
    ErrorFeedback,
    decode_part,
    encode_part,
    is_plain,
    max_wire_bytes,
    plain_payload,
)
from gradps.codecs.base import require_finite
from gradps.data_stream import CallReceiver, CallSender, DataStream, StreamError
from gradps.placement import ITEMSIZE, PartKey
from gradps.shared_memory import ALIGN, RegionWriter, Segment, SegmentError, aligned, nbytes
from gradps.v1 import shard_pb2, shard_pb2_grpc, tensor_pb2

_LOGGER = logging.getLogger("gradps.worker")
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_PUSH = "/gradps.v1.ShardService/Push"
_PULL = "/gradps.v1.ShardService/Pull"
# PushRequest.part and PullResponse.part are field 4 and field 1.
_PUSH_PART_FIELD, _PULL_PART_FIELD = 4, 1
# Where payloads travel, fastest first: "shm" (shared memory with shards on this host, a data
# stream to the others), "stream" (a data stream to every shard: raw TCP beside gRPC, see
# gradps/data_stream.py) or "grpc" (in the messages). Each falls back to the next where it cannot
# be set up, and to the messages for a call that finds it busy or broken.
TRANSPORTS = ("shm", "stream", "grpc")
# A data stream that broke is opened again in the background this long after, the wait doubling
# up to _REOPEN_MAX_S while the shard cannot be reached on it; calls go inline meanwhile.
_REOPEN_S, _REOPEN_MAX_S = 5.0, 300.0


@dataclass
class Traffic:
    """What a worker's transfers cost so far."""

    bytes_pushed: int = 0
    bytes_pulled: int = 0
    pushes: int = 0
    staleness_sum: float = 0.0
    staleness_max: int = 0
    # Seconds inside push, pull and group-average calls (waiting on the servers and the wire).
    wait_s: float = 0.0
    # Of which: encoding gradients and decoding weights (summed over the shards' threads, so they
    # may overlap each other and the wire), and wall time of push and pull calls.
    encode_s: float = 0.0
    decode_s: float = 0.0
    push_s: float = 0.0
    pull_s: float = 0.0
    # Wall time of wagma's group_average calls (deposit and average).
    average_s: float = 0.0


@dataclass
class _Area:
    """Half of a shard's shared segment: the push area or the pull area. One call uses it at a
    time; a call that finds it busy sends its payloads inline."""

    segment: Segment
    offset: int
    length: int
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def end(self) -> int:
        return self.offset + self.length

    def region(self) -> tensor_pb2.SharedRegion:
        """The area, as a pull or group average names it for the shard to write into."""
        return tensor_pb2.SharedRegion(segment=self.segment.name, offset=self.offset, length=self.length)

    def writer(self) -> RegionWriter:
        """Lays this call's payloads into the area."""
        return RegionWriter(self.segment, self.offset, self.length)


def tensor_specs(tensors: dict[str, torch.Tensor]) -> list[tensor_pb2.TensorSpec]:
    """The wire description of named float32 tensors, in the given order."""
    return [
        tensor_pb2.TensorSpec(name=name, shape=list(t.shape), dtype=tensor_pb2.DTYPE_FLOAT32)
        for name, t in tensors.items()
    ]


class ParameterClient:
    """Pulls and pushes the parts of one run; each shard is driven by its own thread."""

    def __init__(
        self,
        placement: shard_pb2.Placement,
        run_id: str,
        worker_id: int,
        codec: tensor_pb2.CodecParams,
        pull_codec: tensor_pb2.CodecParams,
        timeout_s: float = 120.0,
        transport: str = "shm",
        local_shards: Collection[int] | None = None,
    ) -> None:
        """`transport`: one of TRANSPORTS. With "shm", payloads to and from shards on this host
        go through a shared segment per shard (gradps/shared_memory.py); with "shm" or "stream",
        those to other shards through a data stream per shard (gradps/data_stream.py).

        `local_shards`: where "shm" may try shared memory (None: every shard; those on another
        host refuse the segment). `gradps bench transport` names them to place each shard on an
        emulated host of its own."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r}: expected one of {', '.join(TRANSPORTS)}")
        self.placement = placement
        self.run_id = run_id
        self.worker_id = worker_id
        self.codec = codec
        self.pull_codec = pull_codec
        self.timeout_s = timeout_s
        self.traffic = Traffic()
        # Error feedback residuals live as long as this placement does.
        self.feedback = ErrorFeedback()
        self.versions: dict[PartKey, int] = {}
        self._channels = [open_channel(address) for address in placement.shards]
        self._stubs = [shard_pb2_grpc.ShardServiceStub(c) for c in self._channels]
        # The bulk calls send and receive raw bytes (see gradps/wire.py): one copy of each payload.
        self._push_calls = [
            c.stream_unary(_PUSH, request_serializer=None, response_deserializer=shard_pb2.PushResponse.FromString)
            for c in self._channels
        ]
        self._pull_calls = [
            c.unary_stream(_PULL, request_serializer=shard_pb2.PullRequest.SerializeToString) for c in self._channels
        ]
        self._parts_by_shard: list[list[shard_pb2.PartPlacement]] = [[] for _ in placement.shards]
        for p in placement.parts:
            self._parts_by_shard[p.shard].append(p)
        for t in placement.tensors:
            if ITEMSIZE.get(t.dtype) != 4:
                raise ValueError(f"tensor {t.name}: only float32 tensors are served")
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(placement.shards)), thread_name_prefix="shard")
        # Pushes get their own threads: a scheme may push while a pull waits on the shards.
        self._push_pool = ThreadPoolExecutor(max_workers=max(1, len(placement.shards)), thread_name_prefix="push")
        # The shards this worker exchanges with: those that own parts.
        self._owners = [s for s, parts in enumerate(self._parts_by_shard) if parts]
        # (push area, pull area) of each shard's segment, None where payloads go inline.
        self._areas: list[tuple[_Area, _Area] | None] = [None] * len(placement.shards)
        # Each shard's data stream where payloads do not go through shared memory.
        self._streams: list[DataStream | None] = [None] * len(placement.shards)
        self._reopening = threading.Lock()
        self._closed = False
        self._pinned = False
        for shard in self._owners:
            if transport == "shm" and (local_shards is None or shard in local_shards):
                self._areas[shard] = self._map_segment(shard)
            if transport != "grpc" and self._areas[shard] is None:
                self._streams[shard] = self._open_stream(shard)
        _LOGGER.info(
            "run %s: payloads to shards %s through shared memory, to %s on data streams, to %s inline",
            run_id,
            self.shared_shards,
            self.streamed_shards,
            [s for s in self._owners if self._areas[s] is None and self._streams[s] is None],
        )

    @property
    def shared_shards(self) -> list[int]:
        """Shards whose payloads go through shared memory."""
        return [s for s, areas in enumerate(self._areas) if areas is not None]

    @property
    def streamed_shards(self) -> list[int]:
        """Shards whose payloads go through a data stream (that is still open)."""
        return [s for s, stream in enumerate(self._streams) if stream is not None and not stream.closed]

    def _open_stream(self, shard: int) -> DataStream | None:
        """A data stream to `shard`; None when it cannot be opened (no data port, a firewall):
        payloads go inline."""
        request = shard_pb2.OpenStreamRequest(run_id=self.run_id, worker_id=self.worker_id)
        host = self.placement.shards[shard].rsplit(":", 1)[0].strip("[]")
        try:
            response = self._stubs[shard].OpenStream(request, timeout=min(self.timeout_s, 10.0))
            return DataStream.connect(host, response.port, response.token, response.stream, min(self.timeout_s, 10.0))
        except grpc.RpcError as e:
            _LOGGER.info("shard %d: payloads inline (%s: %s)", shard, e.code().name, e.details())
        except StreamError as e:
            _LOGGER.info("shard %d: payloads inline (%s)", shard, e)
        return None

    @contextmanager
    def _stream_call(
        self, shard: int, direction: str, area: _Area | None, call: int | None = None
    ) -> Iterator[CallSender | CallReceiver | None]:
        """The shard's data stream in `direction` ("send": a push; "receive": a pull) for one
        call (numbered `call`, else a new number), None when the call has a shared area, or there
        is no open stream, or another call has it. A call that fails with it closes the stream
        (DataStream.sending/receiving)."""
        stream = self._streams[shard]
        if area is not None or stream is None:
            yield None
            return
        claim = stream.sending if direction == "send" else stream.receiving
        try:
            with claim(stream.next_call() if call is None else call, self.timeout_s) as io:
                yield io
        finally:
            if stream.closed:
                self._reopen_later(shard, stream, _REOPEN_S)

    def _reopen_later(self, shard: int, broken: DataStream | None, delay_s: float) -> None:
        """Forget the shard's stream `broken` (once, whichever call saw it break) and open a new
        one `delay_s` from now, in the background."""
        with self._reopening:
            if self._closed or self._streams[shard] is not broken:
                return
            self._streams[shard] = None
        timer = threading.Timer(delay_s, self._reopen, args=(shard, delay_s))
        timer.daemon = True
        timer.start()

    def _reopen(self, shard: int, delay_s: float) -> None:
        if self._closed:
            return
        try:
            stream = self._open_stream(shard)
        except ValueError:  # close() closed the channel meanwhile
            return
        if stream is None:
            self._reopen_later(shard, None, min(2 * delay_s, _REOPEN_MAX_S))
            return
        with self._reopening:
            if not self._closed and self._streams[shard] is None:
                self._streams[shard] = stream
                _LOGGER.info("shard %d: data stream open again", shard)
                return
        stream.close()

    def _map_segment(self, shard: int) -> tuple[_Area, _Area] | None:
        """A segment with room for every part of `shard` twice (a push and a pull at once), mapped
        by the shard; None when it cannot be (another host, no /dev/shm): payloads go inline."""
        # Any codec's payload of a part fits in its float32 bytes (top-k above half does not:
        # such parts go inline).
        length = sum(aligned(4 * p.count) for p in self._parts_by_shard[shard])
        try:
            segment = Segment.create(2 * length)
        except SegmentError as e:
            _LOGGER.info("shard %d: payloads inline (%s)", shard, e)
            return None
        try:
            request = shard_pb2.MapSegmentRequest(
                run_id=self.run_id, worker_id=self.worker_id, segment=segment.name, token=segment.token
            )
            # A short deadline: until the shard answers, the segment has a name that could leak.
            self._stubs[shard].MapSegment(request, timeout=min(self.timeout_s, 10.0))
        except grpc.RpcError as e:
            _LOGGER.info("shard %d: payloads inline (%s: %s)", shard, e.code().name, e.details())
            return None
        finally:
            segment.unlink()  # both processes hold it now: it goes when the last one drops it
        return _Area(segment, ALIGN, length), _Area(segment, ALIGN + length, length)

    @contextmanager
    def _claim(self, shard: int, which: int) -> Iterator[_Area | None]:
        """The shard's push (0) or pull (1) area for one call, None when there is none or another
        call holds it."""
        areas = self._areas[shard]
        area = areas[which] if areas else None
        if area is None or not area.lock.acquire(blocking=False):
            yield None
            return
        try:
            yield area
        finally:
            area.lock.release()

    def close(self) -> None:
        with self._reopening:
            self._closed = True
        self._pool.shutdown(wait=False)
        self._push_pool.shutdown(wait=False)
        for channel in self._channels:
            channel.close()
        for stream in self._streams:
            if stream is not None:
                stream.close()
        # Unmapped when the last view goes (at once, unless a call is still running); the shards
        # drop theirs when the run closes.
        self._areas = [None] * len(self._areas)

    def _each_shard(self, fn, pool: ThreadPoolExecutor | None = None) -> list:
        """Run fn(shard_index) for every shard that owns parts, in parallel."""
        return list((pool or self._pool).map(fn, self._owners))

    def register(self, tensors: dict[str, torch.Tensor], overwrite: bool = False) -> None:
        """Upload initial values; the first worker's upload wins on each shard. With `overwrite`,
        replace the shards' copy (schemes whose model lives on the workers publish it this way)."""
        flat = {name: t.detach().reshape(-1).float().cpu() for name, t in tensors.items()}

        def upload(shard: int) -> None:
            def requests() -> Iterator[shard_pb2.RegisterTensorsRequest]:
                for p in self._parts_by_shard[shard]:
                    values = flat[p.name][p.offset : p.offset + p.count]
                    request = shard_pb2.RegisterTensorsRequest(run_id=self.run_id, overwrite=overwrite)
                    self._part_message(p, values.numpy().tobytes(), False, out=request.part)
                    yield request

            self._stubs[shard].RegisterTensors(requests(), timeout=self.timeout_s)

        self._each_shard(upload)

    def pull(self, into: dict[str, torch.Tensor], min_version: int = 0, clock: int = 0) -> None:
        """Copy the current global values into `into` (tensors written in place), once every part
        has at least `min_version` (sync) and the slowest worker is within bound of `clock` (ssp)."""
        request = shard_pb2.PullRequest(min_version=min_version, clock=clock, codec=self.pull_codec)
        self._fetch_into(into, request)

    def pull_gradient(self, step: int, into: dict[str, torch.Tensor]) -> None:
        """pseudosync: copy the reduced global gradient of `step` into `into` (waits for it)."""
        self._fetch_into(into, shard_pb2.PullRequest(gradient=True, gradient_step=step))

    def _fetch_into(self, into: dict[str, torch.Tensor], request: shard_pb2.PullRequest) -> None:
        """Pull `request` (run, worker and wait filled in here) from every shard into `into`."""
        request.run_id, request.worker_id = self.run_id, self.worker_id
        request.wait_ms = int(self.timeout_s * 1000)
        flat = {name: t.data.view(-1) for name, t in into.items()}
        self._pin_segments(flat.values())
        start = time.perf_counter()

        def fetch(shard: int) -> tuple[int, float]:
            with self._claim(shard, 1) as area:
                try:
                    with self._stream_call(shard, "receive", area) as receiver:
                        return fetch_into(shard, area, receiver)
                except (grpc.RpcError, StreamError) as e:
                    if not _stream_broke(shard, e):
                        raise
                return fetch_into(shard, area, None)

        def fetch_into(shard: int, area: _Area | None, receiver: CallReceiver | None) -> tuple[int, float]:
            shard_request = request
            if area is not None or receiver is not None:
                shard_request = shard_pb2.PullRequest()
                shard_request.CopyFrom(request)
                if area is not None:
                    shard_request.into.CopyFrom(area.region())
                else:
                    shard_request.stream.CopyFrom(_stream_call_message(receiver))
            received, decode_s = 0, 0.0
            for message in self._pull_calls[shard](shard_request, timeout=self.timeout_s + 5):
                began = time.perf_counter()
                rest, first, payload = wire.split_message(message, _PULL_PART_FIELD)
                parts = [(first, payload)] if first is not None else []
                # The parts the shard wrote into the shared area arrive together, in `parts`.
                for p in shard_pb2.PullResponse.FromString(rest).parts:
                    parts.append((p, _shared_payload(area, p.shared) if p.HasField("shared") else p.payload))
                for part, payload in parts:
                    target = flat[part.name][part.offset : part.offset + part.count]
                    if part.streamed:
                        receive_part_into(target, part, receiver)
                    else:
                        copy_part_into(target, part, payload)
                    if not request.gradient:  # a weight's version: what the next push was computed on
                        self.versions[(part.name, part.index)] = part.version
                    received += part.streamed or len(payload)
                decode_s += time.perf_counter() - began
            return received, decode_s

        results = self._each_shard(fetch)
        self.traffic.bytes_pulled += sum(n for n, _ in results)
        self.traffic.decode_s += sum(d for _, d in results)
        elapsed = time.perf_counter() - start
        self.traffic.pull_s += elapsed
        self.traffic.wait_s += elapsed

    def push(self, grads: dict[str, torch.Tensor], step: int) -> int:
        """Push one gradient (compressed with the run's codec); returns the max staleness."""
        # On the gradients' device: a lossless part goes from there into shared memory in one copy.
        flat = {name: g.detach().reshape(-1).float() for name, g in grads.items()}
        self._pin_segments(flat.values())
        start = time.perf_counter()

        header = shard_pb2.PushRequest(run_id=self.run_id, worker_id=self.worker_id, step=step).SerializeToString()

        def send(shard: int) -> tuple[int, int, float]:
            # Messages are encoded while earlier ones are on the wire (gRPC consumes the iterator
            # from its own thread), and kept: a retry resends them without encoding again, which
            # would apply the error feedback twice.
            parts = iter(self._parts_by_shard[shard])
            # Messages sent, and (metadata, payload) of the parts sent on the data stream: a retry
            # sends those inline.
            sent: list[bytes | tuple[tensor_pb2.TensorPart, wire.Buffer]] = []
            sizes = [0, 0.0]  # payload bytes, encode seconds

            def keep(message: bytes | shard_pb2.PushRequest) -> bytes:
                """`message` serialized, and kept for a retry."""
                sent.append(message if isinstance(message, bytes) else message.SerializeToString())
                return sent[-1]

            def messages(writer: RegionWriter | None, sender: CallSender | None) -> Iterator[bytes]:
                for item in list(sent):
                    if isinstance(item, tuple):
                        meta, payload = item
                        meta.streamed = 0
                        yield b"".join(wire.part_message(header, _PUSH_PART_FIELD, meta, payload))
                    else:
                        yield item
                for p in parts:
                    began = time.perf_counter()
                    payload, lz4 = self._encode(flat[p.name][p.offset : p.offset + p.count], (p.name, p.index))
                    meta = self._part_message(p, b"", lz4, codec=self.codec)
                    size = nbytes(payload)
                    # The payload's one copy goes into the segment, where the shard reads it.
                    if writer is not None and (region := writer.put(payload)) is not None:
                        meta.shared.CopyFrom(region)
                        ready = batch.add(meta)
                    else:
                        if isinstance(payload, torch.Tensor):  # lossless: sent from the values' memory
                            payload = memoryview(payload.cpu().numpy()).cast("B")
                        if sender is not None and size > wire.SMALL_PAYLOAD:
                            meta.streamed = size
                            sent.append((meta, payload))
                            message = shard_pb2.PushRequest.FromString(header)
                            message.stream.CopyFrom(_stream_call_message(sender))
                            message.part.CopyFrom(meta)
                            yield message.SerializeToString()
                            sizes[0] += size
                            sizes[1] += time.perf_counter() - began
                            try:
                                sender.send(payload)  # its message is on its way: the shard reads after it
                            except StreamError:
                                # The send closed the stream: the shard, short of this part's bytes,
                                # fails the call (DATA_LOSS), and the push is sent again, inline.
                                return
                            continue
                        if size <= wire.SMALL_PAYLOAD:
                            ready = batch.add(meta, payload)
                        else:
                            ready = b"".join(wire.part_message(header, _PUSH_PART_FIELD, meta, payload))
                    sizes[0] += size
                    sizes[1] += time.perf_counter() - began
                    if ready is not None:
                        yield keep(ready)
                if (rest := batch.take()) is not None:
                    yield keep(rest)

            # Pushes are idempotent per (worker, step): retrying after a timeout is safe. The area
            # is held until the shard answered: its bytes are the push until then.
            with self._claim(shard, 0) as area:
                # Across retries: the next free byte of the area, and the parts batched but not sent.
                writer = area.writer() if area else None
                batch = wire.PartBatch(lambda: shard_pb2.PushRequest.FromString(header))
                for attempt in range(3):
                    try:
                        with self._stream_call(shard, "send", area) as sender:
                            response = self._push_calls[shard](messages(writer, sender), timeout=self.timeout_s)
                        return response.staleness, sizes[0], sizes[1]
                    except (grpc.RpcError, StreamError) as e:
                        if attempt < 2 and _stream_broke(shard, e):  # the stream is closed now: inline
                            continue
                        if not isinstance(e, grpc.RpcError) or e.code() not in _RETRYABLE or attempt == 2:
                            raise
                        time.sleep(0.2 * (attempt + 1))
            raise AssertionError("unreachable")

        results = self._each_shard(send, pool=self._push_pool)
        staleness = max((s for s, _, _ in results), default=0)
        self.traffic.bytes_pushed += sum(n for _, n, _ in results)
        self.traffic.encode_s += sum(e for _, _, e in results)
        self.traffic.pushes += 1
        self.traffic.staleness_sum += staleness
        self.traffic.staleness_max = max(self.traffic.staleness_max, staleness)
        elapsed = time.perf_counter() - start
        self.traffic.push_s += elapsed
        self.traffic.wait_s += elapsed
        return staleness

    def _pin_segments(self, tensors: Iterable[torch.Tensor]) -> None:
        """Page-lock the shared segments for CUDA once GPU tensors use them (Segment.pin): a
        worker that trains on the CPU never makes a CUDA context for it."""
        if not self._pinned and any(t.is_cuda for t in tensors):
            self._pinned = True
            for areas in self._areas:
                if areas is not None:
                    areas[0].segment.pin()

    def _encode(self, values: torch.Tensor, key: PartKey) -> tuple[torch.Tensor | bytes, bool]:
        """One part's payload and lz4 flag. Lossless `none` gives the values themselves (on their
        device), after the same NaN/Inf check the codec makes: they are copied once, into the
        segment or the message."""
        if is_plain(self.codec) and values.is_contiguous():
            require_finite(values, "none: values to encode")
            return values, False
        return encode_part(values.cpu(), self.codec, feedback=self.feedback, key=key)

    def group_average(
        self, values: dict[str, torch.Tensor], step: int, members: list[int], is_global: bool
    ) -> tuple[dict[str, torch.Tensor], int]:
        """wagma: deposit `values` for the round (step, members); returns the round's average and
        the highest step any worker has deposited (a late worker skips to it)."""
        flat = {name: t.detach().reshape(-1).float() for name, t in values.items()}
        average = {name: torch.empty_like(t) for name, t in values.items()}
        out = {name: t.view(-1) for name, t in average.items()}
        self._pin_segments(flat.values())
        start = time.perf_counter()

        def exchange(shard: int) -> tuple[int, int, int]:
            # The deposit goes through the shard's push area and the average comes back through
            # its pull area where this worker has them; else on its data stream, both ways (the
            # call holds both directions, under one call number); otherwise in the messages.
            with self._claim(shard, 0) as deposit_area, self._claim(shard, 1) as average_area:
                try:
                    with self._stream_call(shard, "send", deposit_area) as sender:
                        call = sender.call if sender is not None else None
                        with self._stream_call(shard, "receive", average_area, call) as receiver:
                            both = (sender, receiver) if sender and receiver else (None, None)
                            return exchange_through(shard, deposit_area, average_area, *both)
                except (grpc.RpcError, StreamError) as e:
                    if not _stream_broke(shard, e):
                        raise
                # A deposit sent again replaces the first; a fixed round answers again the same.
                return exchange_through(shard, deposit_area, average_area, None, None)

        def exchange_through(
            shard: int,
            deposit_area: _Area | None,
            average_area: _Area | None,
            sender: CallSender | None,
            receiver: CallReceiver | None,
        ) -> tuple[int, int, int]:
            def request() -> shard_pb2.GroupAverageRequest:
                return shard_pb2.GroupAverageRequest(
                    run_id=self.run_id, worker_id=self.worker_id, step=step, members=members, is_global=is_global
                )

            # Shared and small parts travel together, up to wire.BATCH_BYTES a message; a large
            # inline one alone; a streamed one's message alone, its bytes after it. Each message
            # comes with the bytes to send on the stream after it (None for none).
            messages: list[tuple[shard_pb2.GroupAverageRequest, wire.Buffer | None]] = []
            batch, deposited = wire.PartBatch(request), 0
            writer = deposit_area.writer() if deposit_area else None
            for p in self._parts_by_shard[shard]:
                values = flat[p.name][p.offset : p.offset + p.count]  # the shard checks them
                size = 4 * p.count
                deposited += size
                if writer is not None and (region := writer.put(values)) is not None:
                    meta = self._part_message(p, b"", False)
                    meta.shared.CopyFrom(region)
                    full = batch.add(meta)
                elif sender is not None and size > wire.SMALL_PAYLOAD:
                    messages.append((request(), memoryview(values.cpu().numpy()).cast("B")))
                    self._part_message(p, b"", False, out=messages[-1][0].part).streamed = size
                    continue
                else:
                    payload = values.cpu().numpy().tobytes()
                    if size > wire.SMALL_PAYLOAD:
                        messages.append((request(), None))
                        self._part_message(p, payload, False, out=messages[-1][0].part)
                        continue
                    full = batch.add(self._part_message(p, b"", False), payload)
                if full is not None:
                    messages.append((full, None))
            if (rest := batch.take()) is not None:
                messages.append((rest, None))
            if messages:  # the shard reads these from the first message
                if average_area is not None:
                    messages[0][0].into.CopyFrom(average_area.region())
                if sender is not None:
                    messages[0][0].stream.CopyFrom(_stream_call_message(sender))

            def deposit() -> Iterator[shard_pb2.GroupAverageRequest]:
                for message, streamed in messages:
                    yield message
                    if streamed is not None:
                        try:
                            sender.send(streamed)  # its message is on its way: the shard reads after it
                        except StreamError:
                            return  # the send closed the stream: the shard, short of these bytes, fails the call

            frontier, received = 0, 0
            for response in self._stubs[shard].GroupAverage(deposit(), timeout=self.timeout_s):
                for part in wire.parts_of(response):
                    target = out[part.name][part.offset : part.offset + part.count]
                    if part.streamed:
                        receive_part_into(target, part, receiver)
                        received += part.streamed
                    else:
                        shared = part.HasField("shared")
                        payload = _shared_payload(average_area, part.shared) if shared else part.payload
                        copy_part_into(target, part, payload)
                        received += len(payload)
                    frontier = max(frontier, part.version)
            return frontier, deposited, received

        results = self._each_shard(exchange)
        self.traffic.bytes_pushed += sum(r[1] for r in results)
        self.traffic.bytes_pulled += sum(r[2] for r in results)
        elapsed = time.perf_counter() - start
        self.traffic.average_s += elapsed
        self.traffic.wait_s += elapsed
        return average, max((r[0] for r in results), default=0)

    def _part_message(
        self,
        p: shard_pb2.PartPlacement,
        payload: bytes,
        lz4: bool,
        codec: tensor_pb2.CodecParams | None = None,
        out: tensor_pb2.TensorPart | None = None,
    ) -> tensor_pb2.TensorPart:
        """Fill `out` (a new TensorPart when None) in place: a message built with a nested
        `part=TensorPart(...)` argument costs about 1 ms per MiB of payload, field assignment
        a plain copy."""
        out = tensor_pb2.TensorPart() if out is None else out
        out.name, out.index, out.offset, out.count = p.name, p.index, p.offset, p.count
        out.dtype = tensor_pb2.DTYPE_FLOAT32
        if codec is None:
            out.codec.codec = tensor_pb2.CODEC_NONE
        else:
            out.codec.CopyFrom(codec)
        out.payload = payload
        out.version = self.versions.get((p.name, p.index), 0)
        out.lz4 = lz4
        return out


def _stream_broke(shard: int, e: Exception) -> bool:
    """Whether a call to `shard` failed because its data stream broke (the shard says DATA_LOSS);
    if so, the call is to be made again inline, and this says so in the log."""
    broke = isinstance(e, StreamError) or (isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.DATA_LOSS)
    if broke:
        _LOGGER.warning("shard %d: %s; payloads inline for now", shard, _reason(e))
    return broke


def _stream_call_message(io: CallSender | CallReceiver) -> shard_pb2.StreamCall:
    return shard_pb2.StreamCall(stream=io.stream.id, call=io.call)


def _reason(e: Exception) -> str:
    return f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)


def receive_part_into(target: torch.Tensor, part: tensor_pb2.TensorPart, receiver: CallReceiver | None) -> None:
    """Read a part's payload from the pull's data stream into its slice of the model: straight
    into the tensor for `none` on the CPU (the kernel's copy and no other)."""
    if receiver is None:
        raise CodecError(f"part {part.name}/{part.index} arrived on a data stream this pull did not offer")
    if part.streamed > max_wire_bytes(part):
        raise CodecError(f"part {part.name}/{part.index}: {part.streamed} streamed bytes for {part.count} values")
    in_place = target.device.type == "cpu" and target.is_contiguous()
    if in_place and plain_payload(part) and part.streamed == 4 * part.count:
        receiver.receive_into(memoryview(target.numpy()).cast("B"))
        return
    buffer = np.empty(part.streamed, dtype=np.uint8)
    receiver.receive_into(memoryview(buffer))
    copy_part_into(target, part, memoryview(buffer))


def _shared_payload(area: _Area | None, region: tensor_pb2.SharedRegion) -> memoryview:
    """The bytes a shard wrote into this pull's area."""
    if area is None or region.segment != area.segment.name:
        raise CodecError(f"a part arrived in segment {region.segment!r}, which this pull did not offer")
    if region.offset < area.offset or region.offset + region.length > area.end:
        raise CodecError(f"a part arrived at [{region.offset}, {region.offset + region.length}), outside the pull area")
    return area.segment.region(region.offset, region.length)


def copy_part_into(target: torch.Tensor, part: tensor_pb2.TensorPart, payload: memoryview) -> None:
    """Decode a pulled (or exported) part straight into its slice of the model: one copy for `none`."""
    if plain_payload(part):
        if len(payload) != 4 * part.count:
            raise CodecError(f"none: payload is {len(payload)} bytes, expected {4 * part.count}")
        if part.count:
            target.copy_(torch.frombuffer(payload, dtype=torch.float32, count=part.count))
        return
    target.copy_(decode_part(payload, part.lz4, part.codec, part.count, torch.device("cpu")))
