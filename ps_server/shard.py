"""The shard service: a slice of every run's parameters, updated by the run's scheme rule."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager

import click
import grpc
import numpy as np
import torch
from google.protobuf.message import DecodeError

from gradps import wire
from gradps.channel import (
    MAX_PART_BYTES,
    add_health,
    bind,
    coordinator_option,
    log_level_option,
    make_server,
    open_channel,
    port_file_option,
    port_option,
    serve_until_signal,
    wait_for_call,
    write_port_file,
)
from gradps.codecs import (
    CodecError,
    decode_part,
    decode_summand,
    encode_part,
    format_codec,
    get_pull_codec,
    is_plain,
    max_wire_bytes,
    plain_payload,
)
from gradps.codecs.base import require_finite
from gradps.data_stream import CallReceiver, CallSender, DataStream, StreamError, StreamListener
from gradps.device import device_option
from gradps.placement import dtype_name
from gradps.shared_memory import RegionWriter, Segment, SegmentError, check_name
from gradps.v1 import coordinator_pb2, coordinator_pb2_grpc, run_pb2, shard_pb2, shard_pb2_grpc, tensor_pb2
from ps_server.optimizer import validate as validate_optimizer
from ps_server.run_state import CallEnded, Part, PartKey, Push, PushRejected, RunState, Wait
from ps_server.schemes import RULES, ShardRule

_LOGGER = logging.getLogger("gradps.shard")
_DEFAULT_WAIT_S = 60.0
# The longest a pull waits when it asks for longer (PullRequest.wait_ms), and the slices in which
# a waiting call checks that its client is still there and its deadline not passed.
_MAX_WAIT_S = 600.0
_WAIT_SLICE_S = 0.25
# The most values one part may hold: a part's float32 values within the part size limit.
_MAX_PART_COUNT = MAX_PART_BYTES // 4
_NONE = tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_NONE)
# PushRequest.part, PullResponse.part, RegisterTensorsRequest.part and GroupAverageResponse.part
# (gradps/v1/shard.proto).
_PUSH_PART_FIELD, _PULL_PART_FIELD, _REGISTER_PART_FIELD, _AVERAGE_PART_FIELD = 4, 1, 2, 1
# A worker maps one segment per client of a run (see gpu_worker/ps_client.py); a few spare.
_MAX_SEGMENTS_PER_WORKER = 4
# Likewise data streams.
_MAX_STREAMS_PER_WORKER = 4


def _unpack(message, request_type, part_field: int, context: grpc.ServicerContext):
    """(request, [(part, payload), ...]) of one streamed message with TensorParts: the one in
    `part_field`, if any, then the repeated `parts`.

    Registered raw (see add_shard_servicer), a message arrives as bytes and the first part's
    payload is viewed in place rather than copied out of a parsed message (the repeated parts are
    small: their payloads, if any, lie in shared memory); parsed, each payload is read once
    (every read of a protobuf bytes field copies it).
    """
    if not isinstance(message, bytes):
        return message, [(p, p.payload) for p in wire.parts_of(message)]
    try:
        rest, part, payload = wire.split_message(message, part_field)
        request = request_type.FromString(rest)
    except (wire.WireError, DecodeError) as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {request_type.__name__}: {e}")
    first = [(part, payload)] if part is not None else []
    return request, first + [(p, p.payload) for p in getattr(request, "parts", ())]


class ShardServicer(shard_pb2_grpc.ShardServiceServicer):
    """Runs by id; each run has its own lock, so runs never contend."""

    def __init__(self, device: torch.device, listener: StreamListener | None = None) -> None:
        """`listener`: the data port workers on other hosts open streams to (None: no streams)."""
        self.device = device
        self.listener = listener
        self._runs: dict[str, tuple[RunState, ShardRule]] = {}
        self._lock = threading.Lock()

    def _run(self, run_id: str, context: grpc.ServicerContext) -> tuple[RunState, ShardRule]:
        with self._lock:
            found = self._runs.get(run_id)
        if found is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown run {run_id!r} on this shard")
        return found

    def OpenRun(self, request, context):
        problem = _open_run_problem(request)
        if problem is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        with self._lock:
            found = self._runs.get(request.run_id)
        if found is None:
            try:
                rule_type = RULES[request.spec.scheme]
                per_step = rule_type.updates_per_step(request.spec, len(request.workers))
                run = RunState.open(request, self.device, per_step)
                rule = rule_type(run)
            except ValueError as e:  # what torch's optimizers refuse (betas, eps out of range)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"run {request.run_id!r}: {_one_line(e)}")
            except (RuntimeError, MemoryError) as e:  # the parts do not fit the device
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"run {request.run_id!r}: cannot allocate its parts: {_one_line(e)}",
                )
            with self._lock:
                found = self._runs.setdefault(request.run_id, (run, rule))
            if found[0] is run:
                _LOGGER.info("run %s: %d parts, %d bytes", request.run_id, len(run.parts), run.param_bytes())
                return shard_pb2.OpenRunResponse()
        # Opened before: a retry is answered again; anything else would be silently ignored.
        if not _opened_by(found[0], request):
            context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"run {request.run_id!r} is already open on this shard with another spec, placement or "
                "workers; close it first",
            )
        return shard_pb2.OpenRunResponse()

    def CloseRun(self, request, context):
        with self._lock:
            found = self._runs.pop(request.run_id, None)
        if found is not None:
            with found[0].cond:
                found[0].close()
        return shard_pb2.CloseRunResponse()

    def EndRun(self, request, context):
        run, _ = self._run(request.run_id, context)
        with run.cond:
            run.end()
        _LOGGER.info("run %s ended", request.run_id)
        return shard_pb2.EndRunResponse()

    def SetMembership(self, request, context):
        run, rule = self._run(request.run_id, context)
        _check_workers(run, request.live_workers, "workers", context)
        # The coordinator counts one epoch per worker that leaves (the live set only shrinks): a
        # run of N workers has at most N. A larger one would lock every later change out.
        if request.epoch > len(run.workers):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"membership epoch {request.epoch} is beyond the {len(run.workers)} changes a run of "
                f"{len(run.workers)} workers can have",
            )
        with run.cond:
            if request.epoch > run.membership_epoch:
                run.membership_epoch = request.epoch
                run.set_live_workers(set(request.live_workers))
                rule.membership_changed()
                run.cond.notify_all()
        return shard_pb2.SetMembershipResponse()

    def RegisterTensors(self, request_iterator, context):
        decoded: list[tuple[Part, torch.Tensor]] = []
        run = None
        overwrite = False
        for message in request_iterator:
            request, parts = _unpack(message, shard_pb2.RegisterTensorsRequest, _REGISTER_PART_FIELD, context)
            if len(parts) != 1:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a RegisterTensorsRequest carries one part")
            ((msg, payload),) = parts
            overwrite = overwrite or request.overwrite
            if run is None:
                run, _ = self._run(request.run_id, context)
            elif request.run_id != run.run_id:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "one RegisterTensors call per run")
            part = self._part(run, msg, context)
            if not is_plain(msg.codec):
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"part {msg.name}/{msg.index}: initial values travel with codec none, not {_codec_name(msg.codec)}",
                )
            try:
                values = decode_part(payload, msg.lz4, msg.codec, part.count, self.device)
            except CodecError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"part {msg.name}/{msg.index}: {e}")
            # Validated either way; kept only where it may still be needed (every later worker
            # registers the same values, which the first upload already set).
            if overwrite or not part.initialised:
                decoded.append((part, values))
            del values, payload, msg, request, message
        if run is None:
            return shard_pb2.RegisterTensorsResponse()
        initialised = 0
        with run.cond:
            for part, values in decoded:
                if overwrite or not part.initialised:
                    part.values.copy_(values)
                    part.initialised = True
                    initialised += 1
            run.cond.notify_all()
        return shard_pb2.RegisterTensorsResponse(initialised=initialised)

    def Pull(self, request, context) -> Iterator[shard_pb2.PullResponse]:
        run, rule = self._run(request.run_id, context)
        try:
            get_pull_codec(request.codec)
        except CodecError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.parts:
            parts = []
            for ref in request.parts:
                part = run.parts.get((ref.name, ref.index))
                if part is None:
                    context.abort(grpc.StatusCode.NOT_FOUND, f"part {ref.name}/{ref.index} is not on this shard")
                parts.append(part)
        else:
            parts = list(run.parts.values())
        wait_s = min(request.wait_ms / 1000, _MAX_WAIT_S) if request.wait_ms else _DEFAULT_WAIT_S
        raw = getattr(self, "raw_bulk", False)  # registered raw (add_shard_servicer): yield bytes
        into = self._writer(run, request, context) if request.HasField("into") else None  # checked before any wait
        stream = self._stream(run, request.worker_id, request.stream, context) if request.HasField("stream") else None
        # Each part's bytes are a snapshot taken under the lock. The live weights are copied part
        # by part as they are sent, each at the version its response reports: the first part
        # leaves before the last is copied, and no pull holds a copy of every part (under sync,
        # where no update can land before the puller's next push, they are sent as they are).
        # Anything else a rule serves (a reduced gradient, ...) is copied at once, under the lock
        # that found it ready. Parts written into the worker's shared region, and small ones,
        # leave together (up to wire.BATCH_BYTES a message); a large payload leaves alone, framed
        # by hand, or on the worker's data stream after its message.
        snapshot: list[tuple[Part, tuple[tensor_pb2.TensorPart, wire.Buffer] | None]] = []
        with run.cond:
            waiting = f"parts not ready (version {request.min_version}, clock {request.clock})"
            try:
                if not _waiter(run, context)(lambda: rule.pull_ready(parts, request), wait_s):
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"{waiting} after {wait_s:.1f}s")
            except PushRejected as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            except CallEnded as e:
                context.abort(_ended_code(e), f"{waiting}: {e}")
            for p in parts:
                values = rule.pull_values(p, request)
                live = values.data_ptr() == p.values.data_ptr()  # the weights themselves, not a copy
                snapshot.append((p, None if live else _pulled(p, values, request.codec, into, context)))
            rule.on_pull(request.worker_id, parts)

        def replies() -> Iterator[tuple[tensor_pb2.TensorPart, wire.Buffer]]:
            for p, early in snapshot:
                if into is not None and not context.is_active():
                    return  # cancelled: the worker may have reused its area for its next pull
                if early is None:
                    with run.cond:
                        early = _pulled(p, p.values, request.codec, into, context)
                        if rule.pulls_race_updates and _aliases(early[1], p.values):
                            # The bytes leave after the lock is released (on a stream, as fast as
                            # the worker reads), and updates go on meanwhile: send a copy.
                            early = early[0], memoryview(bytes(early[1]))
                meta, payload = early
                with run.cond:
                    run.bytes_pulled += meta.shared.length if meta.HasField("shared") else len(payload)
                yield meta, payload

        yield from _send(shard_pb2.PullResponse, _PULL_PART_FIELD, replies(), raw, stream, request.stream, context)

    def Push(self, request_iterator, context):
        run = None
        grads: dict[PartKey, torch.Tensor] = {}
        versions: dict[PartKey, int] = {}
        nbytes = 0
        header = None
        receiver, stream_call = None, None
        # Validate and decode the whole push before touching any state: a bad part changes nothing.
        # A push on a data stream holds its receive direction until every part is read; a push
        # that fails closes the stream (ExitStack: DataStream.receiving).
        with ExitStack() as claims:
            for message in request_iterator:
                request, parts = _unpack(message, shard_pb2.PushRequest, _PUSH_PART_FIELD, context)
                if not parts:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a PushRequest without a part")
                if run is None:
                    run, rule = self._run(request.run_id, context)
                    header = (request.run_id, request.worker_id, request.step)
                    _check_step(run, request.step, context)
                    # Rules that only sum take sparse parts as (indices, values): no full-size copy.
                    decode = decode_summand if rule.sums_sparse_parts else decode_part
                elif (request.run_id, request.worker_id, request.step) != header:
                    context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, "all parts of a push need the same run, worker and step"
                    )
                if request.HasField("stream"):
                    if stream_call is None:
                        stream_call = request.stream
                        stream = self._stream(run, request.worker_id, stream_call, context)
                        receiver = claims.enter_context(_claimed(stream, "receive", stream_call, context))
                    elif request.stream != stream_call:
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "all messages of a push name the same stream")
                for msg, payload in parts:
                    part = self._part(run, msg, context)
                    if part.key in grads:
                        context.abort(
                            grpc.StatusCode.INVALID_ARGUMENT, f"part {part.key[0]}/{part.key[1]} pushed twice"
                        )
                    # Decoding rejects NaN/Inf (every codec checks what it decodes): no second pass.
                    try:
                        if msg.streamed and plain_payload(msg) and msg.streamed == 4 * part.count:
                            # Read from the stream straight into the gradient: nothing to decode.
                            values = torch.empty(part.count)
                            self._streamed(msg, payload, receiver, context, into=values.numpy())
                            require_finite(values, "none: decoded values")
                            grads[part.key], size = values.to(self.device), msg.streamed
                        else:
                            payload = self._payload(run, request.worker_id, msg, payload, context, receiver)
                            grads[part.key] = decode(payload, msg.lz4, msg.codec, part.count, self.device)
                            size = len(payload)
                    except CodecError as e:
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"gradient of {msg.name}/{msg.index}: {e}")
                    versions[part.key] = msg.version
                    nbytes += size
                del payload, msg, parts, request, message  # the received bytes are dead weight once decoded
        if run is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty push")
        _, worker_id, step = header
        with run.cond:
            if run.ended:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"run {run.run_id!r} ended: no more pushes")
            if worker_id not in run.live_workers:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION, f"worker {worker_id} is not a live member of the run"
                )
            if step <= run.last_step.get(worker_id, -1):
                return shard_pb2.PushResponse(parts=len(grads), applied=False)
            try:
                staleness = rule.push(Push(worker_id, step, grads, versions))
            except PushRejected as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            run.last_step[worker_id] = step
            run.pushes += 1
            run.bytes_pushed += nbytes
            run.cond.notify_all()
        return shard_pb2.PushResponse(parts=len(grads), staleness=staleness, applied=True)

    def MapSegment(self, request, context):
        run, _ = self._run(request.run_id, context)
        try:
            check_name(request.segment)
        except SegmentError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            segment = Segment.open(request.segment, request.token)
        except SegmentError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        key = (request.worker_id, request.segment)
        with run.cond:
            if request.worker_id not in run.live_workers:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION, f"worker {request.worker_id} is not a live member of the run"
                )
            mapped = sum(1 for worker, _ in run.segments if worker == request.worker_id)
            if key not in run.segments and mapped >= _MAX_SEGMENTS_PER_WORKER:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"worker {request.worker_id} already has {mapped} segments mapped in this run",
                )
            run.segments[key] = segment
        if self.device.type == "cuda":
            segment.pin()  # payloads then cross between the segment and the GPU by DMA
        return shard_pb2.MapSegmentResponse(size=segment.size)

    def OpenStream(self, request, context):
        run, _ = self._run(request.run_id, context)
        if self.listener is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this shard has no data port")
        worker = request.worker_id
        with run.cond:
            if worker not in run.live_workers:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"worker {worker} is not a live member of the run")
            opened = run.open_streams(worker)
            if opened >= _MAX_STREAMS_PER_WORKER:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, f"worker {worker} already has {opened} data streams in this run"
                )

        def attach(stream: DataStream) -> bool:
            # Checked again: tokens asked for before any of them connected all passed the check above.
            with run.cond:
                if run.closed or worker not in run.live_workers or run.open_streams(worker) >= _MAX_STREAMS_PER_WORKER:
                    return False
                run.streams[(worker, stream.id)] = stream
                return True

        token, stream_id = self.listener.expect(attach)
        return shard_pb2.OpenStreamResponse(port=self.listener.port, token=token, stream=stream_id)

    def GetStats(self, request, context):
        run, _ = self._run(request.run_id, context)
        with run.cond:
            return shard_pb2.GetStatsResponse(
                parts=len(run.parts),
                param_bytes=run.param_bytes(),
                pushes=run.pushes,
                bytes_pushed=run.bytes_pushed,
                bytes_pulled=run.bytes_pulled,
                min_version=min((p.version for p in run.parts.values()), default=0),
                device=str(self.device),
            )

    def GroupAverage(self, request_iterator, context) -> Iterator[shard_pb2.GroupAverageResponse]:
        run = None
        deposit: dict[PartKey, torch.Tensor] = {}
        header = None
        into, stream, call = None, None, None
        # The deposit is read whole (from the stream too, holding its receive direction) before
        # the round; the average is sent after it (holding the send direction).
        with ExitStack() as claims:
            receiver = None
            for request in request_iterator:
                if run is None:
                    run, rule = self._run(request.run_id, context)
                    header = _round_of(request)
                    _check_step(run, request.step, context)
                    _check_workers(run, request.members, "members", context)
                    if request.HasField("into"):  # checked before any wait, like a pull's
                        into = self._writer(run, request, context)
                    if request.HasField("stream"):
                        call = request.stream
                        stream = self._stream(run, request.worker_id, call, context)
                        receiver = claims.enter_context(_claimed(stream, "receive", call, context))
                elif _round_of(request) != header:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "all parts of a deposit need the same header")
                parts = wire.parts_of(request)
                if not parts:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a GroupAverageRequest without a part")
                for msg in parts:
                    part = self._part(run, msg, context)
                    if part.key in deposit:
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"part {msg.name}/{msg.index} deposited twice")
                    payload = self._payload(run, request.worker_id, msg, msg.payload, context, receiver)
                    try:
                        deposit[part.key] = decode_part(payload, msg.lz4, msg.codec, part.count, self.device)
                    except CodecError as e:
                        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"part {msg.name}/{msg.index}: {e}")
        if run is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty deposit")
        _, worker_id, step, members, is_global = header
        if worker_id not in members:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"worker {worker_id} is not in its own group {members}")
        # A round averages whole models: every member deposits every part this shard holds.
        missing = sorted(key for key in run.parts if key not in deposit)
        if missing:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a deposit carries all {len(run.parts)} parts this shard holds for the run; "
                f"{len(missing)} missing, first {missing[0][0]}/{missing[0][1]}",
            )
        with run.cond:
            if run.ended:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"run {run.run_id!r} ended: no more rounds")
            try:
                averages, frontier = rule.group_average(
                    worker_id, step, frozenset(members), is_global, deposit, wait=_waiter(run, context)
                )
            except PushRejected as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            except CallEnded as e:
                context.abort(_ended_code(e), f"round {step} of {sorted(members)}: {e}")
            run.cond.notify_all()
            # Copied under the lock, into the worker's region or into bytes: a round's result is
            # fixed, but the copy is the snapshot.
            replies = []
            for key, avg in averages.items():
                meta = _part_meta(run.parts[key], _NONE, frontier)
                if into is not None and (region := into.put(avg)) is not None:
                    meta.shared.CopyFrom(region)
                    replies.append((meta, b""))
                else:
                    replies.append((meta, encode_part(avg.cpu(), _NONE, lz4_threshold=None)[0]))
        yield from _send(shard_pb2.GroupAverageResponse, _AVERAGE_PART_FIELD, replies, False, stream, call, context)

    @staticmethod
    def _part(run: RunState, msg: tensor_pb2.TensorPart, context: grpc.ServicerContext) -> Part:
        part = run.parts.get((msg.name, msg.index))
        if part is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown tensor part {msg.name}/{msg.index} in this shard")
        if msg.dtype != tensor_pb2.DTYPE_FLOAT32:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"part {msg.name}/{msg.index}: dtype {dtype_name(msg.dtype)}, expected DTYPE_FLOAT32",
            )
        if msg.offset != part.offset or msg.count != part.count:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"part {msg.name}/{msg.index}: shape mismatch, got offset {msg.offset} count {msg.count}, "
                f"expected offset {part.offset} count {part.count}",
            )
        return part

    @staticmethod
    def _segment(run: RunState, worker_id: int, name: str, context: grpc.ServicerContext) -> Segment:
        with run.cond:
            segment = run.segments.get((worker_id, name))
        if segment is None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"segment {name!r} is not mapped for worker {worker_id} in the run"
            )
        return segment

    @staticmethod
    def _stream(run: RunState, worker_id: int, call: shard_pb2.StreamCall, context: grpc.ServicerContext) -> DataStream:
        with run.cond:
            stream = run.streams.get((worker_id, call.stream))
        if stream is None or stream.closed:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"data stream {call.stream} is not open for worker {worker_id}"
            )
        return stream

    def _payload(
        self,
        run: RunState,
        worker_id: int,
        msg: tensor_pb2.TensorPart,
        received: wire.Buffer,
        context: grpc.ServicerContext,
        receiver: CallReceiver | None = None,
    ) -> wire.Buffer:
        """A part's payload: the bytes `received` with it, the region of the worker's segment it
        names (TensorPart.shared) or its bytes on the call's data stream (TensorPart.streamed);
        in the latter two cases nothing may be received."""
        if msg.streamed:
            return self._streamed(msg, received, receiver, context)
        if not msg.HasField("shared"):
            return received
        if len(received):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"part {msg.name}/{msg.index} has a payload and a shared one"
            )
        segment = self._segment(run, worker_id, msg.shared.segment, context)
        try:
            return segment.region(msg.shared.offset, msg.shared.length)
        except SegmentError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    @staticmethod
    def _streamed(
        msg: tensor_pb2.TensorPart,
        received: wire.Buffer,
        receiver: CallReceiver | None,
        context: grpc.ServicerContext,
        into: np.ndarray | None = None,
    ) -> memoryview:
        """The next `msg.streamed` bytes of the call's data stream, read into `into` (an array of
        that many bytes) or a fresh buffer."""
        name = f"{msg.name}/{msg.index}"
        if receiver is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"part {name} is streamed, but the call has no stream")
        if len(received) or msg.HasField("shared"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"part {name} is streamed and has another payload")
        try:
            limit = max_wire_bytes(msg)
        except CodecError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"part {name}: {e}")
        if msg.streamed > limit:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"part {name}: {msg.streamed} streamed bytes, more than {limit}"
            )
        buffer = np.empty(msg.streamed, dtype=np.uint8) if into is None else into.view(np.uint8)
        try:
            receiver.receive_into(memoryview(buffer))
        except StreamError as e:
            context.abort(grpc.StatusCode.DATA_LOSS, str(e))
        return memoryview(buffer)

    def _writer(self, run: RunState, request, context: grpc.ServicerContext) -> RegionWriter:
        """Where a pull or group average writes its payloads: the region `request.into` of one of
        the requesting worker's segments, checked."""
        into = request.into
        segment = self._segment(run, request.worker_id, into.segment, context)
        try:
            return RegionWriter(segment, into.offset, into.length)
        except SegmentError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


def _part_meta(part: Part, codec: tensor_pb2.CodecParams, version: int) -> tensor_pb2.TensorPart:
    """The metadata of one of `part`'s float32 payloads sent back to a worker."""
    meta = tensor_pb2.TensorPart(
        name=part.key[0], index=part.key[1], offset=part.offset, count=part.count, dtype=tensor_pb2.DTYPE_FLOAT32
    )
    meta.codec.CopyFrom(codec)
    meta.version = version
    return meta


def _open_run_problem(request: shard_pb2.OpenRunRequest) -> str | None:
    """What makes an OpenRun request unusable (one line), or None; checked before any allocation."""
    if not request.run_id:
        return "OpenRun needs a run_id"
    if request.spec.scheme not in RULES:
        return f"unknown scheme {request.spec.scheme!r}; choose one of {', '.join(sorted(RULES))}"
    optimizer = run_pb2.OptimizerSpec()
    optimizer.CopyFrom(request.spec.optimizer)
    optimizer.schedule = optimizer.schedule or "constant"  # as learning_rate reads an unset one
    try:
        validate_optimizer(optimizer)
    except ValueError as e:
        return f"optimizer: {_one_line(e)}"
    if not request.workers:
        return "a run needs at least one worker"
    if len(set(request.workers)) != len(request.workers):
        return f"worker ids repeat: {list(request.workers)}"
    seen: set[PartKey] = set()
    for p in request.placement.parts:
        if (p.name, p.index) in seen:
            return f"part {p.name}/{p.index} is placed twice"
        seen.add((p.name, p.index))
        if p.count > _MAX_PART_COUNT:
            return f"part {p.name}/{p.index}: {p.count} values, more than the {_MAX_PART_COUNT} a part may hold"
    return None


def _opened_by(run: RunState, request: shard_pb2.OpenRunRequest) -> bool:
    """Whether `run` is what `request` opens (a retried OpenRun)."""
    return (
        run.spec == request.spec
        and run.placement == request.placement
        and run.shard_index == request.shard_index
        and run.total_steps == request.total_steps
        and run.workers == frozenset(request.workers)
    )


def _check_step(run: RunState, step: int, context: grpc.ServicerContext) -> None:
    """INVALID_ARGUMENT for a step past the run's end: steps count from 0 and the last exchange
    (asgd's final push, wagma's final global round) is at step total_steps."""
    if run.total_steps and step > run.total_steps:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step {step} is beyond the run's {run.total_steps} steps")


def _check_workers(run: RunState, ids: Iterable[int], what: str, context: grpc.ServicerContext) -> None:
    """INVALID_ARGUMENT unless every one of `ids` (a membership, a group) is a worker of the run."""
    if strangers := sorted(set(ids) - run.workers):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what} {strangers} are not workers of run {run.run_id!r}")


def _waiter(run: RunState, context: grpc.ServicerContext) -> Wait:
    """How a call waits on `run.cond` (held): `wait_for_call`, so that a call whose client
    cancelled or whose deadline passed frees its thread at once (CallEnded, saying which) rather
    than after its whole wait, and a run ended or closed meanwhile ends the wait (PushRejected)."""

    def ready_or_over(ready) -> bool:
        if ready():
            return True
        if run.closed or run.ended:
            raise PushRejected(f"run {run.run_id!r} {'was closed on this shard' if run.closed else 'ended'}")
        return False

    def wait(ready, timeout_s: float) -> bool:
        if wait_for_call(run.cond, lambda: ready_or_over(ready), timeout_s, context, _WAIT_SLICE_S):
            return True
        if not context.is_active():
            raise CallEnded("the call was cancelled", deadline=False)
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            raise CallEnded("the call's deadline passed", deadline=True)
        return False

    return wait


def _ended_code(e: CallEnded) -> grpc.StatusCode:
    return grpc.StatusCode.DEADLINE_EXCEEDED if e.deadline else grpc.StatusCode.CANCELLED


def _pulled(
    part: Part,
    values: torch.Tensor,
    codec: tensor_pb2.CodecParams,
    into: RegionWriter | None,
    context: grpc.ServicerContext,
) -> tuple[tensor_pb2.TensorPart, wire.Buffer]:
    """`_pull_part`, or the call's end when the values cannot be sent: FAILED_PRECONDITION when
    they are not finite (the run diverged: no codec can send them), else OUT_OF_RANGE (they do
    not fit the pull codec)."""
    try:
        return _pull_part(part, values, codec, into)
    except CodecError:
        name = f"{part.key[0]}/{part.key[1]}"
        what = "weights" if values.data_ptr() == part.values.data_ptr() else "values"
        if not bool(torch.isfinite(values).all()):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"part {name}: its {what} are not finite (NaN or Inf): the run diverged",
            )
        peak = float(values.abs().max())
        context.abort(
            grpc.StatusCode.OUT_OF_RANGE,
            f"part {name}: its {what} (|value| up to {peak:g}) do not fit {_codec_name(codec)}; pull with codec none",
        )


def _codec_name(params: tensor_pb2.CodecParams) -> str:
    """The CLI name of `params` ("fp16", "topk:0.01"), or the enum number when it is not valid."""
    try:
        return format_codec(params)
    except CodecError:
        return f"codec {params.codec}"


def _one_line(e: Exception) -> str:
    """An exception's message as one line (torch's and others' may span several)."""
    return " ".join(str(e).split()) or type(e).__name__


def _pull_part(
    part: Part, values: torch.Tensor, codec: tensor_pb2.CodecParams, into: RegionWriter | None
) -> tuple[tensor_pb2.TensorPart, wire.Buffer]:
    """`values` as the part's current version: its metadata and payload, or, when the worker's
    shared region has room, its metadata pointing there and no payload. For `none` the values are
    copied once (into the region, or later into the message)."""
    meta = _part_meta(part, codec, part.version)
    if is_plain(codec):
        require_finite(values, "none: values to encode")  # what the none codec checks
        if into is not None and (region := into.put(values)) is not None:
            meta.shared.CopyFrom(region)
            return meta, b""
        payload, lz4 = memoryview(values.cpu().numpy()).cast("B"), False
    else:
        payload, lz4 = encode_part(values.cpu(), codec, lz4_threshold=None)
    meta.lz4 = lz4
    if into is not None and (region := into.put(payload)) is not None:
        meta.shared.CopyFrom(region)
        payload = b""
    return meta, payload


def _responses(response_type, part_field: int, replies, raw: bool, sender: CallSender | None = None) -> Iterator:
    """The messages of a pull or a group average answering with `replies` ((metadata, payload)
    per part): parts in shared memory and small ones together, up to wire.BATCH_BYTES a message;
    a large payload alone, in `part_field`, or, given a data stream's `sender`, on the stream
    after a message with its metadata. Serialized when `raw` (the payload copied once)."""
    batch = wire.PartBatch(response_type)
    for meta, payload in replies:
        if sender is not None and len(payload) > wire.SMALL_PAYLOAD:
            meta.streamed = len(payload)
            response = response_type()
            response.part.CopyFrom(meta)
            yield response.SerializeToString() if raw else response
            sender.send(payload)  # resumed once the message is on its way: the worker reads after it
            continue
        if len(payload) > wire.SMALL_PAYLOAD:
            if raw:
                yield b"".join(wire.part_message(b"", part_field, meta, payload))
                continue
            # Fields set in place: Response(part=TensorPart(...)) costs ~1 ms per MiB of payload.
            response = response_type()
            response.part.CopyFrom(meta)
            response.part.payload = bytes(payload)
            yield response
        elif (full := batch.add(meta, payload)) is not None:
            yield full.SerializeToString() if raw else full
    if (rest := batch.take()) is not None:
        yield rest.SerializeToString() if raw else rest


def _aliases(payload: wire.Buffer, values: torch.Tensor) -> bool:
    """Whether `payload` is a view of `values`' memory (codec none on the CPU), not a copy."""
    return isinstance(payload, memoryview) and len(payload) > 0 and values.device.type == "cpu"


def _round_of(request: shard_pb2.GroupAverageRequest) -> tuple:
    """The header every message of one deposit repeats: run, worker, step, members, global."""
    return request.run_id, request.worker_id, request.step, tuple(request.members), request.is_global


def _send(
    response_type,
    part_field: int,
    replies,
    raw: bool,
    stream: DataStream | None,
    call: shard_pb2.StreamCall | None,
    context: grpc.ServicerContext,
) -> Iterator:
    """`_responses`, with the large payloads on the worker's data stream when the call named one
    (holding its send direction; a failure closes it and ends the call with DATA_LOSS)."""
    if stream is None:
        yield from _responses(response_type, part_field, replies, raw)
        return
    with _claimed(stream, "send", call, context) as sender:
        try:
            yield from _responses(response_type, part_field, replies, raw, sender)
        except StreamError as e:
            context.abort(grpc.StatusCode.DATA_LOSS, str(e))


@contextmanager
def _claimed(
    stream: DataStream, direction: str, call: shard_pb2.StreamCall, context: grpc.ServicerContext
) -> Iterator[CallSender | CallReceiver]:
    """One direction of the worker's stream ("send": a pull's or an average's payloads; "receive":
    a push's or a deposit's) for the call, until its deadline (at most _MAX_WAIT_S);
    FAILED_PRECONDITION while another call has it or it is closed."""
    claim = stream.sending if direction == "send" else stream.receiving
    with claim(call.call, min(_time_left(context), _MAX_WAIT_S)) as io:
        if io is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"data stream {stream.id} is busy or closed")
        finished = False
        # A call that ends before its bytes did (the client cancelled, or left) would leave this
        # thread blocked on the socket until the deadline: closing the stream fails that read or
        # write at once (the worker reopens a stream in the background).
        context.add_callback(lambda: finished or stream.close())
        try:
            yield io
        finally:
            finished = True


def _time_left(context: grpc.ServicerContext) -> float:
    """Seconds until the call's deadline (the default wait when the client set none)."""
    remaining = context.time_remaining()
    return _DEFAULT_WAIT_S if remaining is None else remaining


def add_shard_servicer(servicer: ShardServicer, server: grpc.Server) -> None:
    """Serve `servicer` with Push and RegisterTensors requests and Pull responses as raw bytes:
    protobuf would copy each payload twice more (parse and field read; field write and serialize),
    a fifth of the shard's CPU time at 64 MiB (docs/performance.md). Clients see no difference."""
    servicer.raw_bulk = True
    add_generated = shard_pb2_grpc.add_ShardServiceServicer_to_server
    wire.add_servicer(add_generated, servicer, server, raw_requests={"Push", "RegisterTensors"}, raw_responses={"Pull"})


def register_with_coordinator(coordinator: str, address: str, device: str, timeout_s: float = 60.0) -> int:
    """Announce this shard; retry while the coordinator starts (compose starts them together)."""
    deadline = time.monotonic() + timeout_s
    warned = False
    with open_channel(coordinator) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        while True:
            try:
                response = stub.RegisterShard(
                    coordinator_pb2.RegisterShardRequest(address=address, device=device), timeout=5
                )
                return response.shard_index
            except grpc.RpcError as e:
                if time.monotonic() > deadline:
                    raise click.ClickException(f"cannot reach coordinator at {coordinator}: {e.details()}") from None
                if not warned:  # say why nothing happens yet
                    _LOGGER.warning("coordinator %s: %s; retrying %.0f s", coordinator, e.code().name, timeout_s)
                    warned = True
                time.sleep(0.5)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@port_option(50052)
@click.option(
    "--data-port",
    envvar="GRADPS_DATA_PORT",
    show_envvar=True,
    default=50053,
    type=click.IntRange(-1, 65535),
    help="Port for workers' data streams (payloads as raw TCP beside gRPC; 0: any free, -1: none).",
)
@coordinator_option
@click.option(
    "--advertise-host",
    envvar="GRADPS_ADVERTISE_HOST",
    show_envvar=True,
    default=socket.gethostname(),
    help="Host name by which workers reach this shard.",
)
@device_option("Where parts live and updates run (auto: CUDA when present).", envvar="GRADPS_DEVICE")
@port_file_option
@log_level_option
def main(
    port: int,
    data_port: int,
    coordinator: str,
    advertise_host: str,
    device: str,
    port_file: str | None,
    log_level: str,
) -> None:
    """gradps shard: holds parts of the parameters and applies the run's update rule."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s shard %(levelname)s %(message)s")
    torch_device = torch.device(device)
    try:
        listener = StreamListener(data_port) if data_port >= 0 else None
    except OSError as e:
        raise click.UsageError(f"--data-port {data_port}: {e.strerror or e}") from None
    server = make_server()
    add_shard_servicer(ShardServicer(torch_device, listener), server)
    add_health(server, ["gradps.v1.ShardService"])
    try:
        bound = bind(server, port)
    except OSError as e:
        raise click.UsageError(f"--port {port}: {e}") from None
    server.start()
    index = register_with_coordinator(coordinator, f"{advertise_host}:{bound}", str(torch_device))
    write_port_file(port_file, bound)  # its folder was checked before registering (port_file_option)
    _LOGGER.info(
        "shard %d serving on port %d, data streams on %s (%s)",
        index,
        bound,
        listener.port if listener else "none",
        torch_device,
    )
    serve_until_signal(server)


if __name__ == "__main__":
    main()
