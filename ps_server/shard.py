"""The shard service: a slice of every run's parameters, updated by the run's scheme rule.

Each handler reads parse -> rule -> reply: the request is read and checked whole
(ps_server/received.py, run_checks.py), the run's rule changes the state under the run's lock,
and the answer's parts go by the route the worker named (ps_server/call_routes.py,
gradps/transport/). Refusals are domain errors (gradps/errors.py), turned into status codes by
the server's interceptor.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path

import click
import grpc
import torch

from gradps import metrics, wire
from gradps.auth.access import acting_worker
from gradps.auth.client_tokens import set_process_token
from gradps.auth.limits import max_calls_option
from gradps.auth.options import secret_options, server_secret, service_tls, tls_options
from gradps.auth.tokens import SHARD
from gradps.channel import (
    add_health,
    bind,
    bind_option,
    coordinator_option,
    make_server,
    metrics_options,
    open_channel,
    port_file_option,
    port_option,
    serve_metrics,
    serve_until_signal,
    time_left,
    write_port_file,
)
from gradps.codec_table import check_pull_codec, codec_family
from gradps.codecs import CodecError, decode_part, decode_summand, is_plain
from gradps.data_stream import DataStream, StreamListener
from gradps.device import device_option
from gradps.errors import (
    AlreadyExists,
    DataLost,
    Ended,
    Invalid,
    NotFound,
    NotNow,
    PermissionDenied,
    TimedOut,
    TooLarge,
    Unavailable,
)
from gradps.logs import configure_logging, log_options, set_log_context
from gradps.placement import PartKey
from gradps.serving import Park
from gradps.shared_memory import Segment, SegmentError, check_name
from gradps.transport.base import INLINE_IN, INLINE_OUT, Outbound
from gradps.transport.framing import Item, frame, unframe
from gradps.v1 import coordinator_pb2, coordinator_pb2_grpc, shard_pb2, shard_pb2_grpc, tensor_pb2
from ps_server.call_routes import MAX_CLAIM_S, sending
from ps_server.checkpoint import CheckpointError, Written
from ps_server.checkpointing import KEEP, Listed, Outcome, RunCheckpoints, ShardCheckpoints
from ps_server.pulled import codec_name, fixed_payload, part_meta, pulled_parts
from ps_server.received import (
    Call,
    Decode,
    Received,
    check_alive,
    check_whole,
    decode_received,
    expected_parts,
    receive,
)
from ps_server.run_checks import (
    check_epoch,
    check_group,
    check_membership,
    check_open_run,
    check_part,
    check_restore,
    check_step,
    opened_by,
)
from ps_server.run_state import Part, Push, RunState
from ps_server.schemes import ShardRule, open_run
from ps_server.waiting import call_park, call_wait

_LOGGER = logging.getLogger("gradps.shard")


def _about(run_id: str) -> dict[str, str]:
    """A log line's fields (gradps.logs): the run it is about."""
    return {"run_id": run_id}


_DEFAULT_WAIT_S = 60.0
_NONE = tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_NONE)
_REGISTER = "RegisterTensors call"
# A worker maps one segment per client of a run (see gradps/parameter_client.py); a few spare.
_MAX_SEGMENTS_PER_WORKER = 4
# Likewise data streams.
_MAX_STREAMS_PER_WORKER = 4
# The longest CheckpointRun waits for a checkpoint to be written.
_CHECKPOINT_WAIT_S = 600.0
# The longest a stopping shard waits for the checkpoints being written: within the 15 s that
# compose and Kubernetes give it after SIGTERM, with the server's own 2 s.
_STOP_CHECKPOINT_WAIT_S = 10.0
# Called with the run's lock held after a push or deposit changed it.
Changed = Callable[[RunState, ShardRule], None]


class ShardServicer(shard_pb2_grpc.ShardServiceServicer):
    """Runs by id; each run has its own lock, so runs never contend."""

    def __init__(
        self, device: torch.device, listener: StreamListener | None = None, checkpoints: ShardCheckpoints | None = None
    ) -> None:
        """`listener`: the data port workers on other hosts open streams to (None: no streams).
        `checkpoints`: where runs are checkpointed (None: nowhere); the runs checkpointed there
        are served again from their newest complete checkpoint."""
        self.device = device
        self.listener = listener
        self.checkpoints = checkpoints
        self._runs: dict[str, tuple[RunState, ShardRule]] = {}
        self._saving: dict[str, RunCheckpoints] = {}
        self._lock = threading.Lock()
        for run, rule, saving in checkpoints.restore(device) if checkpoints else []:
            # A run that was going on waits for the coordinator to say from which cut (RestoreRun).
            run.held = not run.ended
            self._runs[run.run_id] = (run, rule)
            self._saving[run.run_id] = saving
        self._push = Call(shard_pb2.PushRequest, "push", "pushed", _push_header, self._pushed_run, _push_decode)
        self._push_pull = Call(
            shard_pb2.PushPullRequest, "push", "pushed", _push_header, self._pushed_run, _push_decode
        )
        self._deposit = Call(shard_pb2.GroupAverageRequest, "deposit", "deposited", _round_of, self._round_run)

    def _run(self, run_id: str) -> tuple[RunState, ShardRule]:
        """The run `run_id`, for a call by an admin or by one of the run's workers only: a worker's
        own token opens no other run (PERMISSION_DENIED), whatever worker id its request names."""
        with self._lock:
            found = self._runs.get(run_id)
        if found is None:
            raise NotFound(f"unknown run {run_id!r} on this shard")
        worker = acting_worker()
        if worker is not None and worker not in found[0].workers:
            raise PermissionDenied(f"worker {worker} is not a worker of run {run_id!r}")
        return found

    def OpenRun(self, request: shard_pb2.OpenRunRequest, context: grpc.ServicerContext) -> shard_pb2.OpenRunResponse:
        check_open_run(request)
        with self._lock:
            found = self._runs.get(request.run_id)
        if found is None:
            run, rule = open_run(request, self.device)
            with self._lock:
                found = self._runs.setdefault(request.run_id, (run, rule))
                if found[0] is run and self.checkpoints is not None:
                    self._saving[request.run_id] = self.checkpoints.for_run(request)
            if found[0] is run:
                _LOGGER.info(
                    "run %s: %d parts, %d bytes",
                    request.run_id,
                    len(run.parts),
                    run.param_bytes(),
                    extra=_about(request.run_id),
                )
                return shard_pb2.OpenRunResponse()
        # Opened before (or restored from a checkpoint: its state is kept): a retry is answered
        # again; anything else would be silently ignored.
        if not opened_by(found[0], request):
            raise AlreadyExists(
                f"run {request.run_id!r} is already open on this shard with another spec, placement or "
                "workers; close it first"
            )
        return shard_pb2.OpenRunResponse()

    def CloseRun(self, request: shard_pb2.CloseRunRequest, context: grpc.ServicerContext) -> shard_pb2.CloseRunResponse:
        with self._lock:
            found = self._runs.pop(request.run_id, None)
            saving = self._saving.pop(request.run_id, None)
        if found is not None:
            with found[0].cond:
                found[0].close()
        if saving is not None:
            saving.remove()
        return shard_pb2.CloseRunResponse()

    def finish_checkpoints(self, timeout_s: float) -> bool:
        """For a stopping shard: no more checkpoints, and those being written finished, waited
        for at most `timeout_s` in all; False, and a line for each, when some are not."""
        end = time.monotonic() + timeout_s
        with self._lock:
            saving = dict(self._saving)
        finished = True
        for run_id, run_saving in saving.items():
            if not run_saving.finish(time_left(end)):
                _LOGGER.warning("run %s: checkpoint work still going on is abandoned", run_id, extra=_about(run_id))
                finished = False
        return finished

    def EndRun(self, request: shard_pb2.EndRunRequest, context: grpc.ServicerContext) -> shard_pb2.EndRunResponse:
        run, rule = self._run(request.run_id)
        with self._lock:
            saving = self._saving.get(request.run_id)
        with run.cond:
            first = not run.ended
            run.end()
        if first and saving is not None and (saving.every_steps or saving.every_s):
            # The state it ended with, for export after a restart: after the one in flight, which
            # holds the run as still going on (a restarted shard would hold it for a restore).
            saving.wait_idle(_CHECKPOINT_WAIT_S)
            with run.cond:
                if rule.cut_ready():
                    saving.start(run, rule)
        _LOGGER.info("run %s ended", request.run_id, extra=_about(request.run_id))
        return shard_pb2.EndRunResponse()

    def SetMembership(
        self, request: shard_pb2.SetMembershipRequest, context: grpc.ServicerContext
    ) -> shard_pb2.SetMembershipResponse:
        run, rule = self._run(request.run_id)
        check_membership(run, request)
        with run.cond:
            if request.epoch > run.membership_epoch:
                run.membership_epoch = request.epoch
                if request.workers:
                    run.set_workers(request.workers)
                run.set_live_workers(set(request.live_workers))
                rule.membership_changed()
                run.cond.notify_all()
        return shard_pb2.SetMembershipResponse()

    def RegisterTensors(
        self, request_iterator: Iterable[bytes], context: grpc.ServicerContext
    ) -> shard_pb2.RegisterTensorsResponse:
        run: RunState | None = None
        rule: ShardRule | None = None
        header: tuple = ()
        seen: set[PartKey] = set()
        decoded: list[tuple[Part, torch.Tensor]] = []
        for message in request_iterator:
            request, parts = unframe(message, shard_pb2.RegisterTensorsRequest)
            if len(parts) != 1:
                raise Invalid("a RegisterTensorsRequest carries one part")
            said = (request.run_id, request.overwrite, request.part_count, request.replica_step, request.restore_epoch)
            if run is None:
                run, rule = self._run(request.run_id)
                _check_hand_in(run, rule, request)
                header = (*said[:2], expected_parts(request.part_count, run, _REGISTER), *said[3:])
            elif said != header:
                raise Invalid(
                    "every message of a RegisterTensors call repeats its run_id, overwrite, part_count, "
                    "replica_step and restore_epoch"
                )
            ((meta, data),) = parts
            part = _initial_part(run, meta, seen, header[2])
            values, _ = decode_received(meta, data, INLINE_IN, decode_part, self.device)
            # Validated either way; kept only where it may still be needed (every later worker
            # registers the same values, which the first upload already set).
            if request.overwrite or not part.initialised:
                decoded.append((part, values))
            del values, data, meta, request, message
        if run is None or rule is None:
            return shard_pb2.RegisterTensorsResponse()
        check_whole(len(seen), header[2], _REGISTER, context)  # a call cut short sets nothing
        replica_step, restore_epoch = header[3], header[4]
        with run.cond:
            check_alive(context, _REGISTER)
            if replica_step:  # gone back meanwhile: the replica is of a step to be done again
                check_epoch(run, restore_epoch)
            initialised = run.initialise(decoded, header[1])
            if replica_step:
                rule.hand_in(replica_step)
                self._changed(run, rule)  # the checkpoint of that step may be due now
            return shard_pb2.RegisterTensorsResponse(initialised=initialised)

    def Pull(self, request: shard_pb2.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes | Park]:
        run, rule = self._run(request.run_id)
        with run.cond:
            check_epoch(run, request.restore_epoch)
        route = _pull_route(run, rule, request, context)
        yield from _answer(run, rule, request, route, shard_pb2.PullResponse(), context)

    def Push(self, request_iterator: Iterable[bytes], context: grpc.ServicerContext) -> shard_pb2.PushResponse:
        began = time.perf_counter()
        with ExitStack() as claims:
            got = receive(self._push, request_iterator, claims, context)
        self._declared(got)
        return _apply(got, context, began, self._changed)

    def PushPull(self, request_iterator: Iterable[bytes], context: grpc.ServicerContext) -> Iterator[bytes | Park]:
        began = time.perf_counter()
        with ExitStack() as claims:
            got = receive(self._push_pull, request_iterator, claims, context)
        run, rule = got.found
        pull = shard_pb2.PullRequest()
        pull.CopyFrom(got.header.pull)
        pull.run_id, pull.worker_id = run.run_id, got.header.worker_id
        pull.restore_epoch = got.header.restore_epoch
        route = _pull_route(run, rule, pull, context)  # checked before the push changes anything
        self._declared(got)
        header = shard_pb2.PushPullResponse(push=_apply(got, context, began, self._changed))
        yield from _answer(run, rule, pull, route, header, context)

    def GroupAverage(self, request_iterator: Iterable[bytes], context: grpc.ServicerContext) -> Iterator[bytes | Park]:
        # The deposit is read whole (from the stream too, holding its receive direction) before
        # the round; the average is sent after it (holding the send direction).
        began = time.perf_counter()
        with ExitStack() as claims:
            got = receive(self._deposit, request_iterator, claims, context)
        run, rule = got.found
        header = got.header
        if header.worker_id not in header.members:
            raise Invalid(f"worker {header.worker_id} is not in its own group {list(header.members)}")
        # A round averages whole models: every member deposits every part this shard holds.
        if missing := sorted(key for key in run.parts if key not in got.values):
            raise Invalid(
                f"a deposit carries all {len(run.parts)} parts this shard holds for the run; "
                f"{len(missing)} missing, first {missing[0][0]}/{missing[0][1]}"
            )
        route = sending(run, header.worker_id, header, context, snapshot=False)  # checked before the round
        with run.cond:
            members = run.holders(header.members)
            if run.ended:
                raise Ended(f"run {run.run_id!r} ended: no more rounds")
            check_epoch(run, header.restore_epoch)
            check_alive(context, "deposit")  # a deposit of a call that went first is not stored
            round_of = (header.worker_id, header.step, members, header.is_global)
            everyone = None
            if header.consensus:  # the average of the latest deposits: nothing deposited, no round
                averages, frontier = rule.consensus(header.worker_id, list(got.values))
            else:
                everyone = rule.deposit(*round_of, got.values)
                if everyone is None:
                    averages, frontier = rule.answer_round(*round_of, got.values)
            if everyone is None:
                self._changed(run, rule)
                run.cond.notify_all()
        if everyone is not None:  # a global round: answered once every member deposited
            end = time.monotonic() + rule.round_wait_s
            yield from call_park(run, everyone, rule.round_wait_s)  # holding no thread
            with run.cond:
                check_epoch(run, header.restore_epoch)  # the run may have gone back meanwhile
                if not call_wait(run, context, f"round {header.step} of {sorted(members)}")(everyone, time_left(end)):
                    rule.missed_round(header.step)
                averages, frontier = rule.answer_round(*round_of, got.values)
                self._changed(run, rule)
                run.cond.notify_all()
        # A round's result is fixed: its parts need no lock.
        items = [(part_meta(run.parts[key], _NONE, frontier), avg) for key, avg in averages.items()]
        with route as out:
            yield from frame(shard_pb2.GroupAverageResponse(), items, out)
        metrics.SHARD_ROUND_SECONDS.labels(run.spec.scheme).observe(time.perf_counter() - began)

    def MapSegment(
        self, request: shard_pb2.MapSegmentRequest, context: grpc.ServicerContext
    ) -> shard_pb2.MapSegmentResponse:
        run, _ = self._run(request.run_id)
        try:
            check_name(request.segment)
        except SegmentError as e:
            raise Invalid(str(e)) from None
        with run.cond:
            _check_live(run, request.worker_id)  # before any descriptor is opened
        try:
            # Only a memfd sealed against shrinking: no client can cut pages the shard maps.
            segment = Segment.open(request.segment, request.token, request.pid, request.fd, request.pid_namespace)
        except SegmentError as e:
            raise NotNow(str(e)) from None
        key = (request.worker_id, request.segment)
        with run.cond:
            _check_live(run, request.worker_id)
            mapped = sum(1 for worker, _ in run.segments if worker == request.worker_id)
            if key not in run.segments and mapped >= _MAX_SEGMENTS_PER_WORKER:
                raise TooLarge(f"worker {request.worker_id} already has {mapped} segments mapped in this run")
            run.segments[key] = segment
        if self.device.type == "cuda":
            segment.pin()  # payloads then cross between the segment and the GPU by DMA
        return shard_pb2.MapSegmentResponse(size=segment.size)

    def OpenStream(
        self, request: shard_pb2.OpenStreamRequest, context: grpc.ServicerContext
    ) -> shard_pb2.OpenStreamResponse:
        run, _ = self._run(request.run_id)
        if self.listener is None:
            raise NotNow("this shard has no data port")
        worker = request.worker_id
        with run.cond:
            _check_live(run, worker)
            if (opened := run.open_streams(worker)) >= _MAX_STREAMS_PER_WORKER:
                raise TooLarge(f"worker {worker} already has {opened} data streams in this run")

        def attach(stream: DataStream) -> bool:
            # Checked again: tokens asked for before any of them connected all passed the check above.
            with run.cond:
                if run.closed or worker not in run.live_workers or run.open_streams(worker) >= _MAX_STREAMS_PER_WORKER:
                    return False
                run.streams[(worker, stream.id)] = stream
                return True

        token, stream_id = self.listener.expect(attach)
        return shard_pb2.OpenStreamResponse(port=self.listener.port, token=token, stream=stream_id)

    def GetStats(self, request: shard_pb2.GetStatsRequest, context: grpc.ServicerContext) -> shard_pb2.GetStatsResponse:
        run, _ = self._run(request.run_id)
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

    def CheckpointRun(
        self, request: shard_pb2.CheckpointRunRequest, context: grpc.ServicerContext
    ) -> shard_pb2.CheckpointRunResponse:
        run, rule = self._run(request.run_id)
        with self._lock:
            saving = self._saving.get(request.run_id)
        if saving is None:
            raise NotNow("this shard has no state dir (--state-dir) to write checkpoints to")
        deadline = time.monotonic() + min(context.time_remaining() or _CHECKPOINT_WAIT_S, _CHECKPOINT_WAIT_S)
        with run.cond:
            at_cut = saving.common_cut and not run.ended  # an ended run's state is one final step
        if at_cut:
            return _at_cut(run, saving, request.step, deadline)
        sequence = None
        while sequence is None:  # one in flight is waited for first: this one starts from now
            if not saving.wait_idle(max(0.0, deadline - time.monotonic())):
                raise TimedOut("a checkpoint of the run is still being written")
            with run.cond:
                if run.closed:
                    raise NotFound(f"run {run.run_id!r} was closed on this shard")
                if not rule.cut_ready():  # an ended pseudosync run whose rank 0 never handed in
                    raise NotNow(f"run {run.run_id!r} ended without its replica handed in: nothing to checkpoint")
                sequence = saving.start(run, rule)
        outcome = saving.outcome(sequence, max(0.0, deadline - time.monotonic()))
        if outcome is None:
            raise TimedOut(f"checkpoint {sequence} of run {run.run_id!r} is still being written")
        if outcome.written is None:
            raise Unavailable(outcome.error)
        return _checkpointed(outcome.written, outcome)

    def ListCheckpoints(
        self, request: shard_pb2.ListCheckpointsRequest, context: grpc.ServicerContext
    ) -> shard_pb2.ListCheckpointsResponse:
        run, rule = self._run(request.run_id)
        with self._lock:
            saving = self._saving.get(request.run_id)
        listed = saving.listing().values() if saving is not None else []
        with run.cond:
            return shard_pb2.ListCheckpointsResponse(
                checkpoints=[
                    shard_pb2.CheckpointInfo(
                        sequence=c.sequence,
                        step=c.step,
                        min_version=c.min_version,
                        max_version=c.max_version,
                        bytes=c.nbytes,
                        created_unix=c.created_unix,
                        seconds=c.seconds,
                    )
                    for c in listed
                ],
                restored=run.held,
                step=rule.step(),
                restore_epoch=run.restore_epoch,
            )

    def ReadCheckpoint(
        self, request: shard_pb2.ReadCheckpointRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        run, _ = self._run(request.run_id)
        with self._lock:
            saving = self._saving.get(request.run_id)
        if saving is None:
            raise NotNow("this shard has no state dir (--state-dir): it has no checkpoints")
        try:  # on the CPU: a copy beside the run's own state, read and sent once
            stored = saving.read_step(request.step, torch.device("cpu"))
        except CheckpointError as e:
            raise DataLost(str(e)) from None
        if stored is None:
            steps = ", ".join(str(s) for s in sorted({c.step for c in saving.listing().values()})) or "none"
            raise NotFound(
                f"no checkpoint of run {run.run_id!r} at step {request.step} on this shard (its steps: {steps})"
            )
        items = ((part_meta(p, _NONE, p.version), p.values) for p in stored.parts.values())
        yield from frame(shard_pb2.ReadCheckpointResponse(), items, INLINE_OUT)

    def RestoreRun(
        self, request: shard_pb2.RestoreRunRequest, context: grpc.ServicerContext
    ) -> shard_pb2.RestoreRunResponse:
        run, rule = self._run(request.run_id)
        check_restore(run, request)
        with self._lock:
            saving = self._saving.get(request.run_id)
        if request.HasField("step"):
            with run.cond:
                # Held, the state is the checkpoint it was taken back from; the same request
                # again finds it restored already.
                here = rule.step() == request.step and (run.held or request.epoch == run.restore_epoch)
                if here:
                    run.restore_epoch, run.restored_step = request.epoch, request.step
            if here and saving is not None:
                saving.drop_after(request.step)
            elif not here:
                run, rule = self._go_back(run, rule, saving, request.step, request.epoch)
        with run.cond:
            if request.workers:  # the coordinator's, which the checkpoint's may predate: taken as they are
                run.set_workers(request.workers)
                run.membership_epoch = 0
            if request.membership_epoch >= run.membership_epoch:
                run.membership_epoch = request.membership_epoch
                run.set_live_workers(set(request.live_workers))
                rule.membership_changed()
            run.held = run.ended = False
            run.cond.notify_all()
            step = rule.step()
        _LOGGER.info(
            "run %s: served again from step %d (restore epoch %d)",
            run.run_id,
            step,
            run.restore_epoch,
            extra=_about(run.run_id),
        )
        return shard_pb2.RestoreRunResponse(step=step)

    def _go_back(
        self, run: RunState, rule: ShardRule, saving: RunCheckpoints | None, step: int, epoch: int
    ) -> tuple[RunState, ShardRule]:
        """The run's state becomes its checkpoint at `step`, at restore epoch `epoch`: the new
        state takes the workers' segments and streams, calls on the old one are told to go back."""
        if saving is None:
            raise NotNow("this shard has no state dir (--state-dir): it has no checkpoints to go back to")
        loaded = saving.load_step(step, self.device)
        if loaded is None:
            raise NotNow(f"no checkpoint of run {run.run_id!r} at step {step} reads back whole on this shard")
        restored, restored_rule, written = loaded
        with run.cond:
            restored.restore_epoch, restored.restored_step = epoch, step
            restored.segments, restored.streams = run.segments, run.streams
            with self._lock:
                self._runs[run.run_id] = (restored, restored_rule)
            run.superseded(epoch, step)
        saving.drop_after(step)
        _LOGGER.info(
            "run %s went back to step %d from %s (restore epoch %d)",
            run.run_id,
            step,
            written.path,
            epoch,
            extra=_about(run.run_id),
        )
        return restored, restored_rule

    def _changed(self, run: RunState, rule: ShardRule) -> None:
        """A push or deposit changed the run (its lock held): a checkpoint starts if one is due."""
        saving = self._saving.get(run.run_id)
        if saving is None:
            return
        saving.prepare(rule)
        if saving.due(rule):
            saving.start(run, rule)

    def _declared(self, got: Received) -> None:
        """A push read whole that declares a cut (PushRequest.cut_step): before it is applied."""
        run, rule = got.found
        saving = self._saving.get(run.run_id)
        if got.header.cut_step and saving is not None:
            with run.cond:
                saving.declare(rule, got.header.cut_step)

    def _pushed_run(self, request: shard_pb2.PushRequest) -> tuple[RunState, ShardRule]:
        found = self._run(request.run_id)
        with found[0].cond:
            check_epoch(found[0], request.restore_epoch)  # before its payloads are read
        check_step(found[0], request.step)
        return found

    def _round_run(self, request: shard_pb2.GroupAverageRequest) -> tuple[RunState, ShardRule]:
        found = self._run(request.run_id)
        with found[0].cond:
            check_epoch(found[0], request.restore_epoch)
        check_step(found[0], request.step)
        check_group(found[0], request.members)
        return found


def _check_hand_in(run: RunState, rule: ShardRule, request: shard_pb2.RegisterTensorsRequest) -> None:
    """Before a RegisterTensors call's values are read: a replica handed in (replica_step) only
    where the scheme takes one, overwriting, at a step of the run and of the run's restore epoch."""
    with run.cond:
        if not request.replica_step:
            check_epoch(run, run.restore_epoch)  # not while held: initial values come first
            return
        if not rule.takes_replicas:
            raise Invalid(f"a {run.spec.scheme} run takes no replica from its workers: its model is on the shards")
        if not request.overwrite:
            raise Invalid("a replica handed in (replica_step) replaces the values: set overwrite")
        check_epoch(run, request.restore_epoch)
    check_step(run, request.replica_step)


def _at_cut(run: RunState, saving: RunCheckpoints, step: int, deadline: float) -> shard_pb2.CheckpointRunResponse:
    """CheckpointRun where checkpoints are cuts (sync, pseudosync): the one at `step` once it is
    written; without one, the next cut, which rank 0 is asked to declare."""
    if step:
        accept: Callable[[Listed], bool] = lambda c: c.step == step  # noqa: E731
        waiting = f"no checkpoint of step {step}"
    else:
        after = saving.sequence
        with run.cond:
            run.cut_asked = True
        accept = lambda c: c.sequence > after  # noqa: E731
        waiting = "no cut reached: its rank 0 declares one in its next push"
    found = saving.wait_written(accept, max(0.0, deadline - time.monotonic()))
    if found is None:
        raise TimedOut(f"run {run.run_id!r}: {waiting}")
    listed, outcome = found
    return _checkpointed(listed, outcome)


def _checkpointed(c: Listed | Written, outcome: Outcome | None) -> shard_pb2.CheckpointRunResponse:
    """CheckpointRun's answer: checkpoint `c`, with the times of its writing where this shard
    process wrote it (`outcome`)."""
    return shard_pb2.CheckpointRunResponse(
        sequence=c.sequence,
        step=c.step,
        min_version=c.min_version,
        max_version=c.max_version,
        bytes=c.nbytes,
        snapshot_seconds=outcome.snapshot_seconds if outcome else 0.0,
        write_seconds=outcome.written.seconds if outcome and outcome.written else 0.0,
    )


def _pull_route(
    run: RunState, rule: ShardRule, request: shard_pb2.PullRequest, context: grpc.ServicerContext
) -> AbstractContextManager[Outbound]:
    """Where a pull's answer goes, checked before any wait (a data stream is held only once
    the parts are ready), with its codec."""
    try:
        check_pull_codec(request.codec)
    except CodecError as e:
        raise Invalid(str(e)) from None
    return sending(run, request.worker_id, request, context, snapshot=rule.pulls_race_updates)


def _answer(
    run: RunState,
    rule: ShardRule,
    request: shard_pb2.PullRequest,
    route: AbstractContextManager[Outbound],
    header: shard_pb2.PullResponse | shard_pb2.PushPullResponse,
    context: grpc.ServicerContext,
) -> Iterator[bytes | Park]:
    """A pull's answer, once the rule says its parts are ready: messages repeating `header`,
    which names the run's declared cut as it is then and whether the weights are final."""
    began = time.perf_counter()
    parts = list(run.parts.values())
    wait_s = min(request.wait_ms / 1000, MAX_CLAIM_S) if request.wait_ms else _DEFAULT_WAIT_S
    waiting = f"parts not ready (version {request.min_version}, clock {request.clock})"
    end = time.monotonic() + wait_s
    # Pulls that wait for the same version, clock or gradient wait for the same thing.
    waits_for = (request.min_version, request.clock, request.gradient, request.gradient_step)
    yield from call_park(run, lambda: rule.pull_ready(parts, request), wait_s, key=waits_for)
    with run.cond:
        check_epoch(run, request.restore_epoch)  # again: the run may have gone back meanwhile
        if not call_wait(run, context, waiting)(lambda: rule.pull_ready(parts, request), time_left(end)):
            raise TimedOut(f"{waiting} after {wait_s:.1f}s")
        # What is not the live weights (a reduced gradient, ...) is copied now, under the lock
        # that found it ready; the live weights part by part as they are sent (frame's guard),
        # each at the version its answer reports: no pull holds a copy of every part.
        chosen = [(p, fixed_payload(p, rule.pull_values(p, request), request.codec)) for p in parts]
        rule.on_pull(request.worker_id, parts)
        header.cut_step = run.cut_step
        header.final_weights = rule.weights_final()
    items = pulled_parts(run, chosen, request.codec, request.HasField("into"), context)
    pulled = [0]
    try:
        with route as out:
            yield from frame(header, _tallied(items, pulled), out, guard=run.cond)
    finally:  # what went before a cancel counts too, as in GetStats
        metrics.SHARD_PULLED_BYTES.labels(_pull_transport(request), codec_family(request.codec)).inc(pulled[0])
    metrics.SHARD_PULL_SECONDS.labels(run.spec.scheme).observe(time.perf_counter() - began)


def _tallied(items: Iterator[Item], pulled: list[int]) -> Iterator[Item]:
    """`items` as they pass, their payload bytes added to pulled[0] (as pulled_parts counts them)."""
    for meta, payload in items:
        pulled[0] += 4 * meta.count if isinstance(payload, torch.Tensor) else len(payload)  # type: ignore[arg-type]
        yield meta, payload


def _pull_transport(request: shard_pb2.PullRequest) -> str:
    """Where a pull's payloads go, as its request names it (gradps.transport.TRANSPORTS)."""
    return "shm" if request.HasField("into") else "stream" if request.HasField("stream") else "grpc"


def _push_transport(run: RunState, header: shard_pb2.PushRequest) -> str:
    """Where a push's payloads came from: its data stream, else the worker's shared segments
    when it mapped any in the run (a route that broke goes inline, rarely), else the messages."""
    if header.HasField("stream"):
        return "stream"
    return "shm" if any(worker == header.worker_id for worker, _ in run.segments) else "grpc"


def _apply(got: Received, context: grpc.ServicerContext, began: float, changed: Changed) -> shard_pb2.PushResponse:
    """Apply a push read whole, as one unit under the run's lock, once per (worker, step): one
    made again after an applied one is answered as that one was. `began`: when its call did;
    `changed`: called under the lock once it is applied."""
    run, rule = got.found
    worker_id, step = got.header.worker_id, got.header.step
    with run.cond:
        if run.ended:
            raise Ended(f"run {run.run_id!r} ended: no more pushes")
        check_epoch(run, got.header.restore_epoch)
        _check_live(run, worker_id)
        if (earlier := run.earlier_push(worker_id, step)) is not None:
            applied, staleness = earlier
            return _push_answer(run, len(got.values), staleness, applied)
        check_alive(context, "push")  # its client gave up: it will make the push again
        staleness = rule.push(Push(worker_id, step, got.values, got.versions))
        run.record_push(worker_id, step, got.nbytes, staleness)
        changed(run, rule)
        transport = _push_transport(run, got.header)
        answer = _push_answer(run, len(got.values), staleness, True)
    scheme = run.spec.scheme
    metrics.SHARD_PUSH_SECONDS.labels(scheme).observe(time.perf_counter() - began)
    metrics.SHARD_STALENESS.labels(scheme).observe(staleness)
    metrics.SHARD_PUSHED_BYTES.labels(transport, codec_family(run.spec.codec)).inc(got.nbytes)
    return answer


def _push_answer(run: RunState, parts: int, staleness: int, applied: bool) -> shard_pb2.PushResponse:
    """A push's answer, with the run's declared cut (call with `run.cond` held)."""
    return shard_pb2.PushResponse(
        parts=parts, staleness=staleness, applied=applied, cut_step=run.cut_step, cut_asked=run.cut_asked
    )


def _initial_part(run: RunState, meta: tensor_pb2.TensorPart, seen: set[PartKey], expected: int) -> Part:
    """The part a RegisterTensors message sets, checked: codec none, once per call, within the
    call's part_count (`seen`: the parts before it)."""
    if len(seen) == expected:
        raise Invalid(f"a {_REGISTER} of part_count {expected} carries more parts")
    part = check_part(run, meta)
    if not is_plain(meta.codec):
        codec = codec_name(meta.codec)
        raise Invalid(f"part {meta.name}/{meta.index}: initial values travel with codec none, not {codec}")
    if part.key in seen:
        raise Invalid(f"part {meta.name}/{meta.index} registered twice")
    seen.add(part.key)
    return part


def _push_header(request: shard_pb2.PushRequest) -> tuple:
    """The fields every message of one push repeats: run, worker, step and data stream."""
    return request.run_id, request.worker_id, request.step, request.stream.SerializeToString()


def _round_of(request: shard_pb2.GroupAverageRequest) -> tuple:
    """The fields every message of one deposit repeats: run, worker, step, members, global."""
    return request.run_id, request.worker_id, request.step, tuple(request.members), request.is_global


def _push_decode(found: tuple[RunState, ShardRule]) -> Decode:
    # Rules that only sum take sparse parts as (indices, values): no full-size copy.
    return decode_summand if found[1].sums_sparse_parts else decode_part


def _check_live(run: RunState, worker_id: int) -> None:
    if worker_id not in run.live_workers:
        raise NotNow(f"worker {worker_id} is not a live member of the run")


def add_shard_servicer(servicer: ShardServicer, server: grpc.Server) -> None:
    """Serve `servicer` with the bulk calls' messages as raw bytes: protobuf would copy each
    payload twice more (parse and field read; field write and serialize), a fifth of the shard's
    CPU time at 64 MiB (docs/performance.md). Clients see no difference."""
    wire.add_servicer(
        shard_pb2_grpc.add_ShardServiceServicer_to_server,
        servicer,
        server,
        raw_requests={"Push", "PushPull", "RegisterTensors", "GroupAverage"},
        raw_responses={"Pull", "PushPull", "GroupAverage", "ReadCheckpoint"},
    )


# Heartbeats to the coordinator, when it names no interval.
_HEARTBEAT_S = 0.5


def register_with_coordinator(
    coordinator: str, address: str, device: str, boot_id: str, timeout_s: float = 60.0
) -> tuple[int, float]:
    """Announce this shard (`boot_id`: new for this process); retry while the coordinator starts
    (compose starts them together). Returns the shard's index and how often to heartbeat (seconds)."""
    deadline = time.monotonic() + timeout_s
    warned = False
    with open_channel(coordinator) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        while True:
            try:
                response = stub.RegisterShard(
                    coordinator_pb2.RegisterShardRequest(address=address, device=device, boot_id=boot_id), timeout=5
                )
                set_log_context(shard_index=response.shard_index)
                return response.shard_index, response.heartbeat_interval_ms / 1000 or _HEARTBEAT_S
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # a bad --advertise-host: no retry mends it
                    raise click.ClickException(f"coordinator {coordinator} refused this shard: {e.details()}") from None
                if time.monotonic() > deadline:
                    raise click.ClickException(f"cannot reach coordinator at {coordinator}: {e.details()}") from None
                if not warned:  # say why nothing happens yet
                    _LOGGER.warning("coordinator %s: %s; retrying %.0f s", coordinator, e.code().name, timeout_s)
                    warned = True
                time.sleep(0.5)


def heartbeat_coordinator(
    coordinator: str, address: str, device: str, boot_id: str, interval_s: float, stopped: threading.Event
) -> None:
    """Heartbeat the coordinator with this shard's identity until `stopped`: a coordinator that
    restarted (and knows no shard) takes this one in with the next heartbeat."""
    lost = False
    channel = open_channel(coordinator)
    try:
        while not stopped.wait(interval_s):
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            request = coordinator_pb2.ShardHeartbeatRequest(address=address, device=device, boot_id=boot_id)
            try:
                response = stub.ShardHeartbeat(request, timeout=max(1.0, 2 * interval_s))
            except grpc.RpcError as e:
                if not lost:
                    _LOGGER.warning("coordinator %s: %s; heartbeating on", coordinator, e.code().name)
                    lost = True
                # A new channel connects at once; the old one would wait out gRPC's reconnect
                # backoff (up to minutes), long after the coordinator is back.
                channel.close()
                channel = open_channel(coordinator)
                continue
            if response.registered or lost:
                set_log_context(shard_index=response.shard_index)
                _LOGGER.info("coordinator %s: shard %d at %s", coordinator, response.shard_index, address)
            lost = False
            interval_s = response.heartbeat_interval_ms / 1000 or interval_s
    finally:
        channel.close()


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@port_option(50052)
@bind_option
@secret_options
@tls_options
@max_calls_option
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
@click.option(
    "--state-dir",
    envvar="GRADPS_STATE_DIR",
    show_envvar=True,
    default=None,
    type=click.Path(file_okay=False, path_type=Path),
    help="Write runs' checkpoints here (RunSpec.checkpoint_every_*, CheckpointRun), under shard-<shard id>/; "
    "a shard started again with the same --shard-id serves them. Unset: no checkpoints.",
)
@click.option(
    "--shard-id",
    envvar="GRADPS_SHARD_ID",
    show_envvar=True,
    default=None,
    help="This shard's stable identity in --state-dir (a StatefulSet pod name, a compose service); "
    "default: --advertise-host and --port.",
)
@click.option(
    "--keep-checkpoints",
    envvar="GRADPS_KEEP_CHECKPOINTS",
    show_envvar=True,
    default=KEEP,
    type=click.IntRange(min=1),
    help="Checkpoints kept per run; older ones are removed.",
)
@port_file_option
@metrics_options
@log_options
def main(
    port: int,
    bind_address: str,
    secret_file: str | None,
    secret: str | None,
    insecure: bool,
    tls_cert: str | None,
    tls_key: str | None,
    tls_ca: str | None,
    tls_client_auth: bool,
    max_calls_per_caller: int,
    data_port: int,
    coordinator: str,
    advertise_host: str,
    device: str,
    state_dir: Path | None,
    shard_id: str | None,
    keep_checkpoints: int,
    port_file: str | None,
    metrics_port: int,
    metrics_host: str,
    metrics_port_file: str | None,
    log_level: str,
    log_format: str,
) -> None:
    """gradps shard: holds parts of the parameters and applies the run's update rule."""
    configure_logging("shard", log_level, log_format)
    cluster_secret = server_secret(secret, secret_file, bind_address, insecure)
    if cluster_secret is not None:  # its calls to the coordinator (else GRADPS_TOKEN's)
        set_process_token(cluster_secret.token(SHARD))
    tls = service_tls(tls_cert, tls_key, tls_ca, tls_client_auth)
    serve_metrics(metrics_port, metrics_host, metrics_port_file)
    torch_device = torch.device(device)
    try:
        listener = StreamListener(data_port, bind_address, tls) if data_port >= 0 else None
    except OSError as e:
        raise click.UsageError(f"--data-port {data_port}: {e.strerror or e}") from None
    checkpoints = _checkpoints(state_dir, shard_id, advertise_host, port, keep_checkpoints)
    server = make_server(secret=cluster_secret, max_calls_per_caller=max_calls_per_caller)
    servicer = ShardServicer(torch_device, listener, checkpoints)
    add_shard_servicer(servicer, server)
    add_health(server, ["gradps.v1.ShardService"])
    try:
        bound = bind(server, port, bind_address, tls)
    except OSError as e:
        raise click.UsageError(f"--port {port}: {e}") from None
    server.start()
    address = f"{advertise_host}:{bound}"
    boot_id = uuid.uuid4().hex  # tells the coordinator this process is new (its runs need a restore)
    index, interval_s = register_with_coordinator(coordinator, address, str(torch_device), boot_id)
    stopped = threading.Event()
    threading.Thread(
        target=heartbeat_coordinator,
        args=(coordinator, address, str(torch_device), boot_id, interval_s, stopped),
        name="coordinator-heartbeat",
        daemon=True,
    ).start()
    write_port_file(port_file, bound)  # its folder was checked before registering (port_file_option)
    _LOGGER.info(
        "shard %d serving on port %d, data streams on %s (%s)",
        index,
        bound,
        listener.port if listener else "none",
        torch_device,
    )
    serve_until_signal(server)
    stopped.set()
    if not servicer.finish_checkpoints(_STOP_CHECKPOINT_WAIT_S):
        # The interpreter's exit would stop the writing thread where it stands, which inside
        # torch aborts the process: leave now. A restarted shard removes the unfinished folder.
        logging.shutdown()
        os._exit(0)


def _checkpoints(
    state_dir: Path | None, shard_id: str | None, host: str, port: int, keep: int
) -> ShardCheckpoints | None:
    """Where this shard's checkpoints go (--state-dir, --shard-id), checked at start-up."""
    if state_dir is None:
        if shard_id is not None:
            _LOGGER.warning("--shard-id %s without --state-dir: no checkpoints are written", shard_id)
        return None
    if shard_id is None:
        if port == 0:
            raise click.UsageError("--state-dir needs a --shard-id (or a fixed --port) to find its checkpoints again")
        shard_id = f"{host}-{port}"
    try:
        checkpoints = ShardCheckpoints(state_dir, shard_id, keep)
        checkpoints.root.mkdir(parents=True, exist_ok=True)
    except ValueError as e:
        raise click.UsageError(f"--shard-id: {e}") from None
    except OSError as e:
        raise click.UsageError(f"--state-dir {state_dir}: {e.strerror or e}") from None
    return checkpoints


if __name__ == "__main__":
    main()
