"""The coordinator service: run registry, membership, placement table, metrics fan-in."""

from __future__ import annotations

import heapq
import logging
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import click
import grpc
from google.protobuf.message import Message

from gradps import metrics, wire
from gradps.auth.access import acting_worker, issue_worker_token
from gradps.auth.client_tokens import set_process_token
from gradps.auth.limits import max_calls_option
from gradps.auth.options import allow_import_option, secret_options, server_secret, service_tls, tls_options
from gradps.auth.tokens import ADMIN
from gradps.channel import (
    add_health,
    bind,
    bind_option,
    make_server,
    metrics_options,
    open_channel,
    port_file_option,
    port_option,
    serve_metrics,
    serve_until_signal,
    time_left,
    wait_for_call,
    write_port_file,
)
from gradps.errors import (
    DataLost,
    Ended,
    GradpsError,
    Invalid,
    NotFound,
    NotNow,
    PermissionDenied,
    TooLarge,
    Unavailable,
)
from gradps.import_paths import ImportRefused, check_import_allowed
from gradps.logs import configure_logging, log_options
from gradps.placement import place
from gradps.run_spec import MEMBERSHIP_CHANGES_PER_WORKER, validate, with_defaults
from gradps.schemes import get_scheme
from gradps.serving import Park, ParkCondition, parked
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import coordinator_pb2_grpc, run_pb2, shard_pb2, shard_pb2_grpc
from ps_server.coordinator_limits import (
    MAX_ACTIVE_RUNS,
    MAX_LIVE_WORKERS,
    MAX_SHARDS,
    check_join,
    check_metrics,
    check_shard,
    check_spec,
    check_stop,
    shown,
)
from ps_server.recovery import Restart, go_back, recover
from ps_server.run_store import RunStore, StoreError

_LOGGER = logging.getLogger("gradps.coordinator")
_ENDED = (cpb.RUN_STATE_COMPLETED, cpb.RUN_STATE_FAILED, cpb.RUN_STATE_STOPPED)
# Ended runs the coordinator keeps (status, metrics) unless told otherwise (--keep-runs); older
# ones are deleted, as `gradps delete` does.
DEFAULT_KEEP_RUNS = 100
# Shards keep the parameters of this many ended runs, so `gradps export` works after a run.
_KEEP_ENDED_RUNS = 8
# Workers and shards declared dead are still shown (GetCluster) for this many heartbeat
# timeouts, and at most this many workers: then they are forgotten.
_FORGET_AFTER_TIMEOUTS = 12
_KEEP_DEAD_WORKERS = 256
# TakeCheckpoint: how long one shard's checkpoint may take.
_CHECKPOINT_WAIT_S = 600.0
# ExportRun: how long a shard may take to have every part initialised.
_EXPORT_WAIT_MS = 10_000
# ... and the worker id its pulls carry: no worker's (DC-ASGD remembers what each worker pulled).
_EXPORTER_ID = 2**32 - 1
# GetAssignment: the wait when wait_ms is 0, and the longest; a worker polls again after an
# empty answer, so a longer wait would only pin a server thread.
_DEFAULT_ASSIGNMENT_WAIT_S = 10.0
_MAX_ASSIGNMENT_WAIT_S = 60.0
# ... which wakes this often to notice a caller that went away (cancelled, or past its deadline).
_WAIT_SLICE_S = 0.5
# An open WatchRun stream is woken by each event (every event notifies); this only bounds how
# long an idle stream's handler is not run.
_WATCH_SLICE_S = 30.0
# Worker ids are reserved in the store this many at a time, so that a restarted coordinator never
# hands out an id that a worker of the previous one still heartbeats with (it is told to rejoin).
_WORKER_ID_BLOCK = 1024
_WORKER_IDS_RESERVED = "worker_ids_reserved"
# A restarted coordinator waits this many heartbeat timeouts for the workers of a run that was
# running (they train on against the shards, and heartbeat with their ids once it answers: gRPC's
# reconnect backoff may take a few seconds); one silent for longer is declared dead as usual.
_REJOIN_GRACE_TIMEOUTS = 5
# Why such a run fails when none of them came back.
RESTARTED_MESSAGE = (
    "coordinator restarted while the run was running, and none of its workers came back; "
    "resume it when checkpoints exist"
)
# How long a dead shard holding parts of a running run may stay silent before the run fails
# (--shard-return-timeout): far longer than a shard's restart and RestoreRun (a few seconds).
DEFAULT_SHARD_RETURN_TIMEOUT_S = 60.0


@dataclass
class WorkerRecord:
    worker_id: int
    name: str
    device: str
    last_seen: float
    alive: bool = True
    run_id: str = ""
    # Taken back with its run after a restart (until it leaves the run).
    restored: bool = False
    # It fetched its run's assignment (GetAssignment); until then its reports and failures are
    # of what it ran before (the same run, stopped and resumed since), not of this run.
    picked_up: bool = True


@dataclass
class ShardRecord:
    index: int
    address: str
    device: str
    last_seen: float
    alive: bool = True
    # The shard process's, from its heartbeats: a new one means it restarted.
    boot_id: str = ""


@dataclass
class RunRecord:
    status: cpb.RunStatus
    placement: shard_pb2.Placement | None = None
    live: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    epoch: int = 0
    latest: dict[int, cpb.Metrics] = field(default_factory=dict)
    events: list[cpb.WatchRunResponse] = field(default_factory=list)
    placement_lock: threading.Lock = field(default_factory=threading.Lock)
    opened_on_shards: bool = False
    # What a pending run waits for, in one word: a watcher hears when it changes, not when the
    # counts in `status.pending_reason` do.
    waiting_for: str = ""
    # Taken back from the store at start-up: `events` are read from it when first watched.
    history_stored: bool = False
    # Was running when the coordinator restarted, and no worker has reported since.
    awaiting_workers: bool = False
    # Resumed (ResumeRun): its shards go back to a common checkpoint when its new workers ask for
    # the placement; the step they start from then.
    resuming: bool = False
    start_step: int = 0
    # Workers that took a lost worker's rank while the run was running.
    joined: set[int] = field(default_factory=set)
    # One joined a run whose replica is handed in (pseudosync): its shards go back to their newest
    # common checkpoint when that worker asks for the placement, so that every worker enters there.
    gathering: bool = False
    # One recovery at a time.
    recovery_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def ended(self) -> bool:
        return self.status.state in _ENDED

    @property
    def run_id(self) -> str:
        return self.status.run_id


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """All state sits behind one condition variable; RPCs to shards are made outside it."""

    # Import paths ("package.module:function") that runs may name as model or dataset
    # (--allow-import); others are refused at submit, before any worker sees them.
    allow_import: tuple[str, ...] = ()

    def __init__(
        self,
        heartbeat_timeout_s: float = 5.0,
        keep_runs: int = DEFAULT_KEEP_RUNS,
        store: RunStore | None = None,
        shard_return_timeout_s: float = DEFAULT_SHARD_RETURN_TIMEOUT_S,
    ) -> None:
        """`heartbeat_timeout_s`: silence after which a worker or a shard is declared dead;
        `keep_runs`: ended runs kept (the oldest beyond are deleted); `store`: where runs are kept
        (their runs are taken back now; StoreError when they cannot be read), None: in memory;
        `shard_return_timeout_s`: silence of a dead shard after which the running runs it holds
        parts of fail (0: never)."""
        if keep_runs < 1:
            raise ValueError(f"keep_runs must be at least 1, got {keep_runs}")
        if not (math.isfinite(shard_return_timeout_s) and shard_return_timeout_s >= 0):
            raise ValueError(f"shard_return_timeout_s must be 0 or more seconds, got {shard_return_timeout_s}")
        self._store = store or RunStore.open(None)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.shard_return_timeout_s = shard_return_timeout_s
        self.keep_runs = keep_runs
        self._cond = ParkCondition()
        # By address, in order of index (a shard that comes back keeps its place).
        self._shards: dict[str, ShardRecord] = {}
        self._next_shard_index = 0
        self._shard_stubs: dict[str, shard_pb2_grpc.ShardServiceStub] = {}
        # Shards that running runs taken back at start-up give parts to, not heard since: when the
        # coordinator started (their silence counts from then; they have no ShardRecord yet).
        self._unheard_since: dict[str, float] = {}
        # Live workers; the idle ones among them; the latest declared dead (shown, then forgotten).
        self._workers: dict[int, WorkerRecord] = {}
        self._idle: set[int] = set()
        self._dead: OrderedDict[int, WorkerRecord] = OrderedDict()
        self._runs: dict[str, RunRecord] = {}
        # Pending runs, oldest first: the scheduler's queue.
        self._pending: dict[str, RunRecord] = {}
        self._next_worker_id = self._worker_ids_reserved = self._store.counter(_WORKER_IDS_RESERVED)
        with self._cond:
            self._restore()
        self._stopped = threading.Event()
        self._monitor = threading.Thread(target=self._watch_heartbeats, name="heartbeats", daemon=True)
        self._monitor.start()

    def close(self) -> None:
        self._stopped.set()
        with self._cond:
            self._store.close()

    def census(self) -> metrics.Census:
        """Live workers and shards, and the runs kept by state: the coordinator's gauges."""
        with self._cond:
            runs: dict[str, int] = {}
            for record in self._runs.values():
                state = _state_name(record)
                runs[state] = runs.get(state, 0) + 1
            live_shards = sum(s.alive for s in self._shards.values())
            return metrics.Census(live_workers=len(self._workers), live_shards=live_shards, runs=runs)

    @property
    def _forget_after_s(self) -> float:
        return self.heartbeat_timeout_s * _FORGET_AFTER_TIMEOUTS

    # ---- client -------------------------------------------------------------------------------

    def SubmitRun(self, request: cpb.SubmitRunRequest, context: grpc.ServicerContext) -> cpb.SubmitRunResponse:
        check_spec(request.spec)  # before with_defaults copies it
        spec = with_defaults(request.spec)
        try:
            validate(spec)
        except ValueError as e:
            raise Invalid(str(e)) from None
        _check_imports_allowed(spec, self.allow_import)
        with self._cond:
            if len(self._pending) + self._running() >= MAX_ACTIVE_RUNS:
                raise TooLarge(f"{MAX_ACTIVE_RUNS} runs are pending or running already; stop one first")
            run_id = self._new_run_id()
            status = cpb.RunStatus(run_id=run_id, spec=spec, state=cpb.RUN_STATE_PENDING, submitted_at=time.time())
            record = RunRecord(status=status)
            self._runs[run_id] = record
            self._pending[run_id] = record
            self._event(record)
            self._schedule()
        _LOGGER.info(
            "run %s submitted: %s/%s/%s", run_id, spec.scheme, spec.model, spec.dataset, extra={"run_id": run_id}
        )
        return cpb.SubmitRunResponse(run_id=run_id)

    def _new_run_id(self) -> str:
        """When the run was submitted, and a random suffix no run this coordinator knows has: runs
        submitted in the same second could draw the same one (then the second one took the first's
        record and its shards refused it)."""
        while True:
            run_id = f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"
            if run_id not in self._runs:
                return run_id

    def GetRun(self, request: cpb.GetRunRequest, context: grpc.ServicerContext) -> cpb.GetRunResponse:
        with self._cond:
            record = self._record(request.run_id)
            return cpb.GetRunResponse(run=self._snapshot(record), placement=record.placement)

    def ListRuns(self, request: cpb.ListRunsRequest, context: grpc.ServicerContext) -> cpb.ListRunsResponse:
        with self._cond:
            return cpb.ListRunsResponse(runs=[self._snapshot(r) for r in self._runs.values()])

    def StopRun(self, request: cpb.StopRunRequest, context: grpc.ServicerContext) -> cpb.StopRunResponse:
        check_stop(request)
        with self._cond:
            record = self._record(request.run_id)
            if record.ended:
                raise Ended(f"run {record.run_id} already ended: {_state_name(record)}")
            self._end(record, cpb.RUN_STATE_STOPPED, request.reason or "stopped by a client")
        return cpb.StopRunResponse()

    def ScaleRun(self, request: cpb.ScaleRunRequest, context: grpc.ServicerContext) -> cpb.ScaleRunResponse:
        with self._cond:
            record = self._record(request.run_id)
            spec = record.status.spec
            if record.status.state != cpb.RUN_STATE_RUNNING:
                raise NotNow(f"run {record.run_id} is {_state_name(record)}: only a running run scales")
            if spec.script:
                raise NotNow(f"run {record.run_id}'s workers are the script {spec.script}: launch it with more")
            ranks = len(record.status.workers)
            if not 1 <= request.workers <= ranks:
                raise Invalid(f"run {record.run_id} has {ranks} ranks: it scales to 1 to {ranks} workers")
            # The highest ranks leave first: rank 0 stays while it lives (it publishes wagma's
            # final model, and evaluates).
            training = [w for w in record.status.workers if w in record.live and w not in record.done]
            released = training[request.workers :]
            if released and record.epoch >= MEMBERSHIP_CHANGES_PER_WORKER * ranks:
                raise NotNow(f"run {record.run_id} changed its workers {record.epoch} times, its most")
            record.status.scaled_to = request.workers
            for worker_id in released:  # not dead: back to the idle pool, told by their next call
                record.live.discard(worker_id)
                self._release(worker_id, record.run_id)
            if released:
                self._tell_members(record)
            self._event(record)
            _LOGGER.warning(
                "run %s scaled to %d of %d workers%s",
                record.run_id,
                request.workers,
                ranks,
                f"; workers {released} leave it" if released else "",
                extra={"run_id": record.run_id},
            )
            self._maybe_complete(record)
            self._schedule()  # idle workers take the ranks now open
            return cpb.ScaleRunResponse(run=self._snapshot(record), released=released)

    def ResumeRun(self, request: cpb.ResumeRunRequest, context: grpc.ServicerContext) -> cpb.ResumeRunResponse:
        with self._cond:
            record = self._record(request.run_id)
            status = record.status
            if status.state not in (cpb.RUN_STATE_FAILED, cpb.RUN_STATE_STOPPED):
                raise NotNow(f"run {record.run_id} is {_state_name(record)}: only a failed or stopped run resumes")
            if status.spec.script:
                raise NotNow(f"run {record.run_id}'s workers were the script {status.spec.script}: launch it again")
            if record.placement is None or not record.opened_on_shards:
                raise NotNow(f"run {record.run_id} has no state on the shards to resume from: submit it again")
            status.state, status.message, status.pending_reason = cpb.RUN_STATE_PENDING, "", ""
            status.started_at = status.finished_at = 0.0
            del status.workers[:], status.dead_workers[:]
            record.latest.clear()
            record.done.clear()
            record.live.clear()
            record.epoch, record.resuming = 0, True
            # A watcher follows the run from here: the events before it ended are history.
            record.events, record.history_stored = [], False
            self._pending[record.run_id] = record
            self._event(record)
            _LOGGER.info("run %s resumed: waiting for workers", record.run_id, extra={"run_id": record.run_id})
            self._schedule()
        return cpb.ResumeRunResponse()

    def DeleteRun(self, request: cpb.DeleteRunRequest, context: grpc.ServicerContext) -> cpb.DeleteRunResponse:
        with self._cond:
            record = self._record(request.run_id)
            if not record.ended:
                raise NotNow(
                    f"run {record.run_id} is {_state_name(record)}: only ended runs are deleted; stop it first"
                )
            self._delete(record)
        _LOGGER.info("run %s deleted", request.run_id, extra={"run_id": request.run_id})
        return cpb.DeleteRunResponse()

    def WatchRun(
        self, request: cpb.WatchRunRequest, context: grpc.ServicerContext
    ) -> Iterator[cpb.WatchRunResponse | Park]:
        with self._cond:
            record = self._record(request.run_id)
            if record.history_stored:  # a restored run: its events from before the restart, and since
                record.events = self._store.history(record.run_id, record.status.spec)
                record.history_stored = False
        sent = 0

        def news() -> bool:
            return len(record.events) > sent or record.ended

        while context.is_active():
            # Holding no thread between events; streams of the run at the same event wait alike.
            yield from parked(self._cond, news, _WATCH_SLICE_S, key=(record.run_id, sent))
            with self._cond:
                new = record.events[sent:]
                finished = record.ended and sent + len(new) == len(record.events)
            yield from new
            sent += len(new)
            if finished:
                return

    def GetCluster(self, request: cpb.GetClusterRequest, context: grpc.ServicerContext) -> cpb.GetClusterResponse:
        with self._cond:
            workers = [*self._workers.values(), *self._dead.values()]
            return cpb.GetClusterResponse(
                shards=self._live_shards(),
                workers=[
                    cpb.WorkerInfo(worker_id=w.worker_id, name=w.name, device=w.device, alive=w.alive, run_id=w.run_id)
                    for w in workers
                ],
                shard_infos=[
                    cpb.ShardInfo(shard_index=s.index, address=s.address, device=s.device, alive=s.alive)
                    for s in self._shards.values()
                ],
            )

    def ExportRun(
        self, request: cpb.ExportRunRequest, context: grpc.ServicerContext
    ) -> Iterator[cpb.ExportRunResponse]:
        if request.HasField("checkpoint_step"):
            yield from self._export_checkpoint(request.run_id, request.checkpoint_step)
            return
        with self._cond:
            record = self._record(request.run_id)
            placement = record.placement
        if placement is None or not placement.tensors:
            raise NotNow(f"run {record.run_id} has no parameters yet")
        # Message by message, shard after shard (no lock held): one large part, or one batch of
        # small ones, in memory at a time.
        pull = shard_pb2.PullRequest(
            run_id=record.run_id,
            worker_id=_EXPORTER_ID,
            wait_ms=_EXPORT_WAIT_MS,
            restore_epoch=record.status.restore_epoch,
        )
        for index, address in enumerate(placement.shards):
            try:
                for response in self._stub(address).Pull(pull, timeout=_EXPORT_WAIT_MS / 1000 + 30):
                    for part in wire.parts_of(response):
                        out = cpb.ExportRunResponse()
                        out.part.CopyFrom(part)
                        yield out
            except grpc.RpcError as e:
                raise Unavailable(f"shard {index} at {address}: {e.code().name}: {e.details()}") from None

    def TakeCheckpoint(
        self, request: cpb.TakeCheckpointRequest, context: grpc.ServicerContext
    ) -> cpb.TakeCheckpointResponse:
        with self._cond:
            record = self._record(request.run_id)
            placement = record.placement
        if placement is None or not record.opened_on_shards:
            raise NotNow(f"run {record.run_id} is not on the shards yet (or they freed it): nothing to checkpoint")
        answer = cpb.TakeCheckpointResponse()
        common_cut = get_scheme(record.status.spec.scheme).common_cut
        step = 0  # the cut the first shard wrote, which the others write too
        for address in _holders(placement):
            try:
                written = self._stub(address).CheckpointRun(
                    shard_pb2.CheckpointRunRequest(run_id=record.run_id, step=step), timeout=_CHECKPOINT_WAIT_S
                )
                if common_cut:
                    step = written.step
            except grpc.RpcError as e:
                error = NotNow if e.code() == grpc.StatusCode.FAILED_PRECONDITION else Unavailable
                raise error(f"shard {address}: {e.code().name}: {e.details()}") from None
            answer.checkpoints.add(
                shard=address,
                sequence=written.sequence,
                step=written.step,
                bytes=written.bytes,
                write_seconds=written.write_seconds,
            )
        return answer

    def ListRunCheckpoints(
        self, request: cpb.ListRunCheckpointsRequest, context: grpc.ServicerContext
    ) -> cpb.ListRunCheckpointsResponse:
        run_id, holders = self._checkpointed(request.run_id)
        return _common_checkpoints({address: self._shard_checkpoints(address, run_id) for address in holders})

    def _export_checkpoint(self, run_id: str, step: int) -> Iterator[cpb.ExportRunResponse]:
        """ExportRun of the run's checkpoint at `step`: every shard is asked whether it has one
        there before any part is sent."""
        run_id, holders = self._checkpointed(run_id)
        with self._cond:
            scheme = self._record(run_id).status.spec.scheme
        if get_scheme(scheme).models_on_workers:
            raise NotNow(
                f"a {scheme} run keeps its model on its workers: its shards' checkpoints do not hold it "
                "(export the run once it completed)"
            )
        for address in holders:
            if step not in (steps := self._shard_checkpoints(address, run_id)):
                has = ", ".join(str(s) for s in sorted(steps)) or "none"
                raise NotFound(f"shard {address} has no checkpoint of run {run_id} at step {step} (its steps: {has})")
        read = shard_pb2.ReadCheckpointRequest(run_id=run_id, step=step)
        for address in holders:  # shard after shard, message by message, as a live export
            try:
                for response in self._stub(address).ReadCheckpoint(read, timeout=_CHECKPOINT_WAIT_S):
                    for part in wire.parts_of(response):
                        yield cpb.ExportRunResponse(part=part)
            except grpc.RpcError as e:
                raise _shard_refusal(address, e) from None

    def _checkpointed(self, run_id: str) -> tuple[str, tuple[str, ...]]:
        """A run whose shards may hold checkpoints of it: its id and the shards holding its parts."""
        with self._cond:
            record = self._record(run_id)
            placement, opened = record.placement, record.opened_on_shards
        if placement is None or not placement.parts:
            raise NotNow(f"run {record.run_id} was never placed on shards: it has no checkpoints")
        if not opened:
            raise NotNow(f"the shards of run {record.run_id} freed it: its checkpoints are gone")
        return record.run_id, _holders(placement)

    def _shard_checkpoints(self, address: str, run_id: str) -> dict[int, shard_pb2.CheckpointInfo]:
        """A shard's complete checkpoints of the run by step (its newest at each step)."""
        try:
            listed = self._stub(address).ListCheckpoints(shard_pb2.ListCheckpointsRequest(run_id=run_id), timeout=30)
        except grpc.RpcError as e:
            raise _shard_refusal(address, e) from None
        return {c.step: c for c in sorted(listed.checkpoints, key=lambda c: c.sequence)}

    # ---- shards and workers -------------------------------------------------------------------

    def RegisterShard(
        self, request: cpb.RegisterShardRequest, context: grpc.ServicerContext
    ) -> cpb.RegisterShardResponse:
        check_shard(request.address, request.device)
        with self._cond:
            shard, _ = self._shard_heard(request.address, request.device, request.boot_id)
        return cpb.RegisterShardResponse(shard_index=shard.index, heartbeat_interval_ms=self._shard_interval_ms())

    def ShardHeartbeat(
        self, request: cpb.ShardHeartbeatRequest, context: grpc.ServicerContext
    ) -> cpb.ShardHeartbeatResponse:
        check_shard(request.address, request.device)
        with self._cond:
            shard, registered = self._shard_heard(request.address, request.device, request.boot_id)
        return cpb.ShardHeartbeatResponse(
            shard_index=shard.index, registered=registered, heartbeat_interval_ms=self._shard_interval_ms()
        )

    def JoinWorker(self, request: cpb.JoinWorkerRequest, context: grpc.ServicerContext) -> cpb.JoinWorkerResponse:
        check_join(request)
        with self._cond:
            if len(self._workers) >= MAX_LIVE_WORKERS:
                raise TooLarge(f"the coordinator holds {MAX_LIVE_WORKERS} live workers, its most; try again later")
            worker_id = self._new_worker_id()
            self._workers[worker_id] = WorkerRecord(worker_id, request.name, request.device, time.monotonic())
            self._idle.add(worker_id)
            self._schedule()
        _LOGGER.info(
            "worker %d joined (%s, %s)", worker_id, request.name, request.device, extra={"worker_id": worker_id}
        )
        issue_worker_token(context, worker_id)  # its own token, where it joined with the plain one
        interval_ms = max(50, int(self.heartbeat_timeout_s * 1000 / 5))
        return cpb.JoinWorkerResponse(worker_id=worker_id, heartbeat_interval_ms=interval_ms)

    def LeaveWorker(self, request: cpb.LeaveWorkerRequest, context: grpc.ServicerContext) -> cpb.LeaveWorkerResponse:
        with self._cond:
            worker = self._workers.pop(request.worker_id, None)
            if worker is None:
                if request.worker_id in self._dead or request.worker_id < self._next_worker_id:
                    return cpb.LeaveWorkerResponse()  # left, died or forgotten already
                raise NotFound(f"unknown worker {request.worker_id}; this coordinator never gave that id")
            # As a worker declared dead (_expire_workers), without waiting for the timeout.
            self._idle.discard(worker.worker_id)
            worker.alive = False
            self._dead[worker.worker_id] = worker
            record = self._runs.get(worker.run_id)
            worker.run_id = ""
            if record is not None and record.status.state == cpb.RUN_STATE_RUNNING:
                self._drop_member(record, worker.worker_id)
            self._schedule()
            self._cond.notify_all()  # its own long poll ends (no assignment)
        where = f"run {record.run_id}" if record else "idle"
        _LOGGER.info("worker %d left (%s)", worker.worker_id, where, extra={"worker_id": worker.worker_id})
        return cpb.LeaveWorkerResponse()

    def Heartbeat(self, request: cpb.HeartbeatRequest, context: grpc.ServicerContext) -> cpb.HeartbeatResponse:
        with self._cond:
            worker = self._workers.get(request.worker_id)
            if worker is None:  # never joined here, or declared dead
                return cpb.HeartbeatResponse(rejoin=True, stop=bool(request.run_id))
            worker.last_seen = time.monotonic()
            record = self._runs.get(request.run_id)
            # A run it is not a live worker of is one to abandon (it rejoined under a new id, or the
            # run went on without it), as ReportMetrics says: so told, it learns nothing of another.
            # So is its earlier part of a run stopped and resumed before it heard of the stop.
            gone = record is None or record.ended or request.worker_id not in record.live
            gone |= worker.run_id == request.run_id and not worker.picked_up
            return cpb.HeartbeatResponse(stop=bool(request.run_id) and gone)

    def GetAssignment(
        self, request: cpb.GetAssignmentRequest, context: grpc.ServicerContext
    ) -> Iterator[cpb.GetAssignmentResponse | Park]:
        # A generator: the long poll parks (gradps.serving), holding no thread, and yields its
        # answer, outside the lock (the generator may go on on another thread).
        wait_s = min(request.wait_ms / 1000, _MAX_ASSIGNMENT_WAIT_S) if request.wait_ms else _DEFAULT_ASSIGNMENT_WAIT_S
        end = time.monotonic() + wait_s

        def assigned() -> bool:
            w = self._workers.get(request.worker_id)
            return w is None or bool(w.run_id)

        with self._cond:
            dead = request.worker_id in self._dead  # its heartbeat tells it to join again
            if not dead:
                if request.worker_id not in self._workers:
                    raise NotFound(f"unknown worker {request.worker_id}; join first")
                if self._workers[request.worker_id].restored:  # it gave up its run while we were down
                    self._leave_restored_run(self._workers[request.worker_id])
        if dead:
            yield cpb.GetAssignmentResponse()
            return
        yield from parked(self._cond, assigned, wait_s)
        with self._cond:
            wait_for_call(self._cond, assigned, time_left(end), context, _WAIT_SLICE_S)
            answer = self._assignment(request.worker_id, context)
        yield answer

    def _assignment(self, worker_id: int, context: grpc.ServicerContext) -> cpb.GetAssignmentResponse:
        """A worker's assignment, marked picked up; empty when it has none (lock held)."""
        worker = self._workers.get(worker_id)
        if worker is None or not worker.run_id or not context.is_active():
            return cpb.GetAssignmentResponse()
        status = self._runs[worker.run_id].status
        worker.picked_up = True
        return cpb.GetAssignmentResponse(
            run_id=status.run_id,
            spec=status.spec,
            rank=list(status.workers).index(worker.worker_id),
            workers=status.workers,
            # Known from the spec, or once the first worker resolved epochs (GetPlacement).
            total_steps=status.total_steps or status.spec.steps,
        )

    def GetPlacement(self, request: cpb.GetPlacementRequest, context: grpc.ServicerContext) -> cpb.GetPlacementResponse:
        with self._cond:
            record = self._record(request.run_id)
            # Only the run's workers (or an admin) define and read its placement.
            if (worker := acting_worker()) is not None and worker not in record.status.workers:
                raise PermissionDenied(f"worker {worker} is not a worker of run {record.run_id}")
            if record.status.state != cpb.RUN_STATE_RUNNING:
                # Shards opened for a pending run know none of its workers (and refuse their
                # pushes); an ended run has none left to serve.
                raise NotNow(
                    f"run {record.run_id} is {cpb.RunState.Name(record.status.state)}; "
                    "its placement is made once it runs, by its workers"
                )
            shards = self._live_shards()
        with record.placement_lock:
            if record.placement is None:
                if not shards:
                    raise Unavailable("no live shard to place the run on; waiting for a shard to heartbeat")
                try:
                    placement = place(list(request.tensors), shards, record.status.spec.part_size)
                except ValueError as e:
                    raise Invalid(str(e)) from None
                self._open_on_shards(record, placement, request.total_steps)
                with self._cond:
                    record.placement = placement
                    record.opened_on_shards = True
                    record.status.total_steps = request.total_steps
                    self._store.save_placement(record.run_id, placement, opened_on_shards=True)
                    if record.run_id not in self._runs:  # deleted while the shards opened it
                        self._delete(record)
                    elif record.ended:  # stopped meanwhile: free what waits on the shards
                        self._to_shards(record, "EndRun", shard_pb2.EndRunRequest(run_id=record.run_id))
                    self._close_old_runs()
            elif list(record.placement.tensors) != list(request.tensors):
                raise Invalid("tensors differ from those the run's first worker registered (same model and seed?)")
            elif record.resuming or record.gathering:
                self._go_back_on_shards(record)
        with self._cond:
            return cpb.GetPlacementResponse(
                placement=record.placement,
                start_step=self._start_step(record, worker if worker is not None else request.worker_id),
                restore_epoch=record.status.restore_epoch,
            )

    def _start_step(self, record: RunRecord, worker_id: int) -> int:
        """Where a worker of the run starts: a resumed run's step, or the one its workers went
        back to for a new one to enter with the same replica; for a worker that joined a run of
        another scheme, the furthest step its live workers reported."""
        if worker_id in record.joined and not get_scheme(record.status.spec.scheme).hands_in_replica:
            return max((m.step for w, m in record.latest.items() if w in record.live), default=record.start_step)
        return record.start_step

    def _go_back_on_shards(self, record: RunRecord) -> None:
        """A resumed run's first worker asks for its placement, or a worker that joined a run
        whose replica is handed in: the run's shards go back to their newest common checkpoint,
        from where its workers go on (placement lock held, not the coordinator's)."""
        placement = record.placement
        assert placement is not None
        with self._cond:
            resumed, workers = record.resuming, tuple(record.status.workers)
            request = shard_pb2.RestoreRunRequest(
                run_id=record.run_id,
                epoch=record.status.restore_epoch,
                workers=workers,
                live_workers=workers if resumed else sorted(record.live),
                membership_epoch=record.epoch,
            )
            record.gathering = False  # a worker that joins from now on gathers them again
        outcome = go_back(request, _holders(placement), "to resume from" if resumed else "to take a new worker in at")
        what = "resume" if resumed else "take its new worker in"
        with self._cond:
            if outcome.error:
                self._end(record, cpb.RUN_STATE_FAILED, f"cannot {what}: {outcome.error}")
                raise NotNow(f"run {record.run_id} cannot {what}: {outcome.error}")
            assert outcome.step is not None
            record.resuming, record.status.restore_epoch, record.start_step = False, outcome.restore_epoch, outcome.step
            if not resumed:
                record.status.rolled_back_steps += max(0, outcome.reached - outcome.step)
            if record.epoch != request.membership_epoch:  # changed meanwhile: the shards hear it after
                self._tell_members(record, ranks_changed=True)
            self._event(record)
        _LOGGER.warning(
            "run %s %s at step %d on workers %s",
            record.run_id,
            "resumed" if resumed else "went back to take its new worker in",
            outcome.step,
            list(workers),
            extra={"run_id": record.run_id},
        )

    def ReportMetrics(
        self, request: cpb.ReportMetricsRequest, context: grpc.ServicerContext
    ) -> cpb.ReportMetricsResponse:
        m = request.metrics
        check_metrics(m)
        with self._cond:
            record = self._record(request.run_id)
            if record.ended:
                return cpb.ReportMetricsResponse(stop=True)
            if m.worker_id not in record.live:
                # Declared dead (missed heartbeats) but still running: the run went on without it.
                return cpb.ReportMetricsResponse(stop=True)
            worker = self._workers.get(m.worker_id)
            if worker is not None and not worker.picked_up:  # of its earlier part in the run
                return cpb.ReportMetricsResponse(stop=True)
            _check_steps(record, m)  # before anything changes
            record.latest[m.worker_id] = m
            if record.awaiting_workers:
                record.awaiting_workers = False
                _LOGGER.info("run %s goes on after the restart: worker %d reported", record.run_id, m.worker_id)
            if m.total_steps:
                record.status.total_steps = m.total_steps
            if m.error:
                self._end(record, cpb.RUN_STATE_FAILED, f"worker {m.worker_id}: {m.error}", metrics=m)
                return cpb.ReportMetricsResponse(stop=True)
            if m.done:
                record.done.add(m.worker_id)
                self._release(m.worker_id, record.run_id)
            self._event(record, m)
            self._maybe_complete(record)
            self._schedule()
        return cpb.ReportMetricsResponse()

    # ---- internals (call with self._cond held unless noted) -----------------------------------

    def _record(self, run_id: str) -> RunRecord:
        record = self._runs.get(run_id)
        if record is None:
            raise NotFound(f"unknown run {shown(run_id)}")
        return record

    def _snapshot(self, record: RunRecord) -> cpb.RunStatus:
        status = cpb.RunStatus()
        status.CopyFrom(record.status)
        status.latest.extend(record.latest[w] for w in sorted(record.latest))
        return status

    def _event(self, record: RunRecord, metrics: cpb.Metrics | None = None) -> None:
        """Every change a watcher hears of, and the one place the run's status is saved."""
        event = cpb.WatchRunResponse(run=self._snapshot(record), metrics=metrics)
        record.events.append(event)
        self._store.save_event(event, record.epoch)
        self._cond.notify_all()

    def _new_worker_id(self) -> int:
        if self._next_worker_id >= self._worker_ids_reserved:
            self._worker_ids_reserved = self._next_worker_id + _WORKER_ID_BLOCK
            self._store.set_counter(_WORKER_IDS_RESERVED, self._worker_ids_reserved)
        self._next_worker_id += 1
        return self._next_worker_id - 1

    def _restore(self) -> None:
        """Take back the runs the store holds: ended and pending ones as they were, running ones with
        their workers (`_resume`)."""
        stored_runs = self._store.runs()
        restored = [
            RunRecord(
                status=stored.status,
                placement=stored.placement,
                epoch=stored.epoch,
                latest=stored.latest,
                opened_on_shards=stored.opened_on_shards,
                history_stored=True,
            )
            for stored in stored_runs
        ]
        for record in restored:
            self._runs[record.run_id] = record
            if record.status.state == cpb.RUN_STATE_PENDING:
                self._pending[record.run_id] = record
        now = time.monotonic()
        for record, stored in zip(restored, stored_runs, strict=True):
            if record.status.state == cpb.RUN_STATE_RUNNING:
                self._resume(record, stored.workers)
                for address in _holders(record.placement) if record.placement else ():
                    self._unheard_since.setdefault(address, now)
        self._retain()
        self._schedule()
        if restored:
            _LOGGER.info("%d runs taken back from %s", len(restored), self._store.where)

    def _resume(self, record: RunRecord, names: dict[int, tuple[str, str]]) -> None:
        """A run that was running goes on: its workers that had not finished (they train on against
        the shards) are live members again, with their ids, and have `_REJOIN_GRACE_TIMEOUTS`
        heartbeat timeouts to heartbeat; the monitor drops one that does not, as a dead worker, and a
        run left without any that reported since fails with RESTARTED_MESSAGE. `names`: the name
        and device of each worker, by id."""
        record.live = set(record.status.workers) - set(record.status.dead_workers)
        record.done = {w for w, m in record.latest.items() if m.done and w in record.live}
        record.awaiting_workers = True
        # A last_seen in the future: the monitor's `now - last_seen > timeout` waits out the grace.
        until = time.monotonic() + (_REJOIN_GRACE_TIMEOUTS - 1) * self.heartbeat_timeout_s
        for worker_id in sorted(record.live - record.done):
            name, device = names.get(worker_id, ("", ""))
            self._workers[worker_id] = WorkerRecord(worker_id, name, device, until, run_id=record.run_id, restored=True)
        self._maybe_complete(record)  # every live worker had reported done
        _LOGGER.info("run %s was running: waiting for workers %s", record.run_id, sorted(record.live - record.done))

    def _leave_restored_run(self, worker: WorkerRecord) -> None:
        """A worker of a run taken back at start-up asks for work: it abandoned that run (a call of
        it failed while the coordinator was down), which goes on without it."""
        record = self._runs.get(worker.run_id)
        _LOGGER.warning("worker %d left run %s during the restart", worker.worker_id, worker.run_id)
        self._release(worker.worker_id, worker.run_id)
        if record is not None and record.status.state == cpb.RUN_STATE_RUNNING:
            self._drop_member(record, worker.worker_id)

    def _running(self) -> int:
        return sum(r.status.state == cpb.RUN_STATE_RUNNING for r in self._runs.values())

    def _live_shards(self) -> list[str]:
        return [s.address for s in self._shards.values() if s.alive]

    def _shard_interval_ms(self) -> int:
        # Ten heartbeats per timeout: a shard busy applying updates may miss a few.
        return max(50, int(self.heartbeat_timeout_s * 1000 / 10))

    def _shard_heard(self, address: str, device: str, boot_id: str) -> tuple[ShardRecord, bool]:
        """The shard at `address` is alive; registers it when unknown (True) or brings it back.
        A process new to this coordinator (`boot_id`) may have restarted: its runs are checked."""
        now = time.monotonic()
        shard = self._shards.get(address)
        self._unheard_since.pop(address, None)
        if shard is None:
            if len(self._shards) >= MAX_SHARDS:
                raise TooLarge(f"the coordinator knows {MAX_SHARDS} shards, its most")
            shard = ShardRecord(self._next_shard_index, address, device, now)
            self._next_shard_index += 1
            self._shards[address] = shard
            self._check_restart(shard, boot_id)
            _LOGGER.info("shard %d registered at %s", shard.index, address)
            self._schedule()
            return shard, True
        shard.last_seen, shard.device = now, device
        self._check_restart(shard, boot_id)
        if not shard.alive:
            shard.alive = True
            _LOGGER.info("shard %d at %s is back", shard.index, address)
            self._schedule()
        return shard, False

    def _check_restart(self, shard: ShardRecord, boot_id: str) -> None:
        """A shard process this coordinator has not heard before: a restarted one holds its runs
        until told where to go on from (ps_server/recovery.py), each run in its own thread."""
        if not boot_id or boot_id == shard.boot_id:
            return
        shard.boot_id = boot_id
        for record in self._runs.values():
            placed = record.placement is not None and shard.address in record.placement.shards
            if placed and record.opened_on_shards and record.status.state == cpb.RUN_STATE_RUNNING:
                threading.Thread(
                    target=self._recover, args=(record, shard.address), name=f"recover-{record.run_id}", daemon=True
                ).start()

    def _recover(self, record: RunRecord, address: str) -> None:
        """Bring the run on a restarted shard to a consistent cut; fail it when it cannot go on."""
        with record.recovery_lock:
            with self._cond:
                if record.status.state != cpb.RUN_STATE_RUNNING or record.placement is None:
                    return
                placement = record.placement
                restart = Restart(
                    run_id=record.run_id,
                    shards=_holders(placement),
                    restarted=address,
                    common_cut=get_scheme(record.status.spec.scheme).common_cut,
                    restore_epoch=record.status.restore_epoch,
                    live_workers=tuple(sorted(record.live)),
                    membership_epoch=record.epoch,
                    workers=tuple(record.status.workers),
                )
            outcome = recover(restart)
            with self._cond:
                if record.status.state != cpb.RUN_STATE_RUNNING:
                    return
                if record.epoch != restart.membership_epoch:  # changed meanwhile: the shards hear it after
                    self._tell_members(record, ranks_changed=True)
                if outcome.error:
                    _LOGGER.error("run %s: %s", record.run_id, outcome.error, extra={"run_id": record.run_id})
                    self._end(record, cpb.RUN_STATE_FAILED, outcome.error)
                elif outcome.step is not None:
                    record.status.restore_epoch = outcome.restore_epoch
                    record.status.rolled_back_steps += max(0, outcome.reached - outcome.step)
                    record.status.restores += 1
                    self._event(record)
                    _LOGGER.warning(
                        "run %s: shard %d at %s restarted; %s",
                        record.run_id,
                        list(placement.shards).index(address),
                        address,
                        f"every shard went back to step {outcome.step} from step {outcome.reached}"
                        if restart.common_cut
                        else f"it goes on from its checkpoint at step {outcome.step}",
                        extra={"run_id": record.run_id},
                    )

    def _schedule(self) -> None:
        """Start every pending run that can start, oldest first (gang scheduling).

        A run short of idle workers while the cluster has enough live ones (busy in other runs)
        holds the idle ones for itself, so a stream of small runs cannot starve it; a run that
        needs more workers than are live holds none, so it blocks nobody while it waits.
        """
        free, live = len(self._idle), len(self._workers)
        no_shards = not any(s.alive for s in self._shards.values())
        holder = ""  # the run that holds the idle workers, once one does
        for record in list(self._pending.values()):
            need = record.status.spec.workers
            if no_shards:
                self._wait(record, "shards", "no live shard: waiting for a shard to register")
            elif need > live:
                self._wait(record, "workers", f"needs {_count(need, 'worker')}; {live} live: waiting for more to join")
            elif holder:
                self._wait(record, "queue", f"queued behind run {holder}, which waits for busy workers")
            elif need <= free:
                self._start(record, need)
                free -= need
            else:
                holder = record.run_id
                busy = live - len(self._idle)
                self._wait(record, "busy", f"needs {_count(need, 'worker')}; {free} idle, {busy} busy in other runs")
        if not holder:
            self._refill()

    def _refill(self) -> None:
        """Give idle workers the ranks that running runs lost or opened (up to the ranks a run is
        scaled to): a new worker takes an empty rank and enters with the current model (wagma's:
        the consensus of the others' models; pseudosync's: every worker goes back to the newest
        checkpoint, whose replica all take up)."""
        for record in list(self._runs.values()):
            spec, ranks = record.status.spec, len(record.status.workers)
            lost = [r for r, w in enumerate(record.status.workers) if w not in record.live and w not in record.done]
            changes_left = MEMBERSHIP_CHANGES_PER_WORKER * ranks - record.epoch
            wanted = (record.status.scaled_to or ranks) - len(record.live)
            joinable = not spec.script and record.placement is not None
            if get_scheme(spec.scheme).hands_in_replica:  # a checkpoint to gather at, likely
                reached = max((m.step for m in record.latest.values()), default=0)
                joinable &= 0 < spec.checkpoint_every_steps <= reached
            if record.status.state != cpb.RUN_STATE_RUNNING or not joinable or record.done:
                continue
            for rank in lost[: max(0, min(len(self._idle), changes_left - ranks, wanted))]:
                self._join(record, rank, min(self._idle))

    def _join(self, record: RunRecord, rank: int, worker_id: int) -> None:
        """`worker_id` (idle) takes rank `rank` of the running run: the shards hear the new members."""
        self._idle.discard(worker_id)
        worker = self._workers[worker_id]
        worker.run_id, worker.picked_up = record.run_id, False
        lost = record.status.workers[rank]
        record.status.workers[rank] = worker_id
        record.latest.pop(lost, None)  # its rank's figures are the new worker's from now on
        record.live.add(worker_id)
        record.joined.add(worker_id)
        record.status.joins += 1
        record.gathering |= get_scheme(record.status.spec.scheme).hands_in_replica
        self._store.save_workers(record.run_id, [(worker_id, worker.name, worker.device)])
        self._tell_members(record, ranks_changed=True)
        self._event(record)
        _LOGGER.warning(
            "run %s: worker %d joins in rank %d (worker %d's)",
            record.run_id,
            worker_id,
            rank,
            lost,
            extra={"run_id": record.run_id},
        )

    def _wait(self, record: RunRecord, waiting_for: str, reason: str) -> None:
        record.status.pending_reason = reason
        if waiting_for != record.waiting_for:
            record.waiting_for = waiting_for
            self._event(record)

    def _start(self, record: RunRecord, need: int) -> None:
        chosen = heapq.nsmallest(need, self._idle)
        for worker_id in chosen:
            self._workers[worker_id].run_id = record.run_id
            self._workers[worker_id].picked_up = False
        self._idle.difference_update(chosen)
        del self._pending[record.run_id]
        record.status.workers.extend(chosen)
        record.live = set(chosen)
        record.status.state = cpb.RUN_STATE_RUNNING
        record.status.started_at = time.time()
        record.status.pending_reason = ""
        self._store.save_workers(record.run_id, [(w, self._workers[w].name, self._workers[w].device) for w in chosen])
        self._event(record)
        _LOGGER.info("run %s started on workers %s", record.run_id, chosen, extra={"run_id": record.run_id})

    def _release(self, worker_id: int, run_id: str) -> None:
        """The worker is done with `run_id`: back to the idle pool (when it is still live)."""
        worker = self._workers.get(worker_id)
        if worker is not None and worker.run_id == run_id:
            worker.run_id = ""
            worker.restored = False
            self._idle.add(worker_id)

    def _maybe_complete(self, record: RunRecord) -> None:
        if record.status.state != cpb.RUN_STATE_RUNNING:
            return
        if record.live and record.live <= record.done:
            self._end(record, cpb.RUN_STATE_COMPLETED, "")
        elif not record.live:
            if record.done:
                self._end(record, cpb.RUN_STATE_COMPLETED, "finished by the surviving workers")
            else:
                message = RESTARTED_MESSAGE if record.awaiting_workers else "every worker died"
                self._end(record, cpb.RUN_STATE_FAILED, message)

    def _end(self, record: RunRecord, state: cpb.RunState, message: str, metrics: cpb.Metrics | None = None) -> None:
        record.status.state = state
        record.status.message = message
        record.status.finished_at = time.time()
        record.status.pending_reason = ""
        self._pending.pop(record.run_id, None)
        for worker_id in record.status.workers:
            self._release(worker_id, record.run_id)
        if record.opened_on_shards:  # free workers blocked on it (a pull for a step no one will push)
            self._to_shards(record, "EndRun", shard_pb2.EndRunRequest(run_id=record.run_id))
        self._event(record, metrics)
        self._retain()
        self._schedule()
        _LOGGER.info(
            "run %s ended: %s %s", record.run_id, cpb.RunState.Name(state), message, extra={"run_id": record.run_id}
        )

    def _retain(self) -> None:
        """Delete the ended runs beyond the newest `keep_runs` (by when they ended)."""
        ended = [r for r in self._runs.values() if r.ended]
        if len(ended) <= self.keep_runs:
            return
        ended.sort(key=lambda r: r.status.finished_at)
        for record in ended[: len(ended) - self.keep_runs]:
            self._delete(record)
            _LOGGER.info("run %s deleted: more than %d ended runs kept", record.run_id, self.keep_runs)

    def _delete(self, record: RunRecord) -> None:
        self._runs.pop(record.run_id, None)
        self._store.delete_run(record.run_id)
        if record.opened_on_shards:  # the shards free its parameters
            record.opened_on_shards = False
            self._to_shards(record, "CloseRun", shard_pb2.CloseRunRequest(run_id=record.run_id))
        self._cond.notify_all()

    def _stub(self, address: str) -> shard_pb2_grpc.ShardServiceStub:
        stub = self._shard_stubs.get(address)
        if stub is None:
            stub = shard_pb2_grpc.ShardServiceStub(open_channel(address))
            self._shard_stubs[address] = stub
        return stub

    def _open_on_shards(self, record: RunRecord, placement: shard_pb2.Placement, total_steps: int) -> None:
        """OpenRun on every shard (no lock held: shards may be slow to answer)."""
        status = record.status
        for index, address in enumerate(placement.shards):
            request = shard_pb2.OpenRunRequest(
                run_id=status.run_id,
                spec=status.spec,
                placement=placement,
                shard_index=index,
                workers=status.workers,
                total_steps=total_steps,
            )
            try:
                self._stub(address).OpenRun(request, timeout=30)
            except grpc.RpcError as e:
                raise Unavailable(f"shard {index} at {address}: {e.details()}") from None

    def _close_old_runs(self) -> None:
        ended = [r for r in self._runs.values() if r.ended and r.placement is not None and r.opened_on_shards]
        for record in ended[:-_KEEP_ENDED_RUNS] if len(ended) > _KEEP_ENDED_RUNS else []:
            record.opened_on_shards = False
            self._store.save_placement(record.run_id, record.placement, opened_on_shards=False)
            self._to_shards(record, "CloseRun", shard_pb2.CloseRunRequest(run_id=record.run_id))

    def _to_shards(self, record: RunRecord, method: str, request: Message) -> None:
        """Send a control RPC to every shard of a run in the background (never under the lock)."""
        addresses = list(record.placement.shards) if record.placement else []

        def send() -> None:
            for address in addresses:
                try:
                    getattr(self._stub(address), method)(request, timeout=10)
                except grpc.RpcError as e:
                    _LOGGER.warning("%s to shard %s failed: %s", method, address, e.details())

        threading.Thread(target=send, daemon=True).start()

    def _watch_heartbeats(self) -> None:
        """Declare silent workers and shards dead after the heartbeat timeout; forget them later."""
        tick_s = min(0.25, self.heartbeat_timeout_s / 4)
        last = time.monotonic()
        while not self._stopped.wait(tick_s):
            with self._cond:
                now = time.monotonic()
                # A coordinator that was not running (descheduled, swapped, paused) heard nobody:
                # that silence is its own, not the workers' and shards', so it is forgiven.
                stalled_s = now - last - tick_s
                last = now
                if stalled_s > tick_s:
                    self._forgive_silence(stalled_s)
                changed = self._expire_workers(now)
                changed |= self._expire_shards(now)
                self._fail_runs_without_shards(now)
                if changed:
                    self._schedule()
                self._cond.notify_all()

    def _forgive_silence(self, stalled_s: float) -> None:
        _LOGGER.warning("the coordinator itself stalled %.1f s: heartbeat silence of that long forgiven", stalled_s)
        now = time.monotonic()
        for worker in self._workers.values():
            worker.last_seen = min(worker.last_seen + stalled_s, now)
        for shard in self._shards.values():
            shard.last_seen = min(shard.last_seen + stalled_s, now)
        for address, since in self._unheard_since.items():
            self._unheard_since[address] = min(since + stalled_s, now)

    def _expire_workers(self, now: float) -> bool:
        """Move workers silent past the timeout to the dead (their run goes on without them), and
        forget the dead after a while or beyond the most kept; True when any died."""
        silent = [w for w in self._workers.values() if now - w.last_seen > self.heartbeat_timeout_s]
        for worker in silent:
            _LOGGER.warning(
                "worker %d missed heartbeats: declared dead",
                worker.worker_id,
                extra=_about(worker.run_id, worker.worker_id),
            )
            del self._workers[worker.worker_id]
            self._idle.discard(worker.worker_id)
            worker.alive = False
            self._dead[worker.worker_id] = worker
            record = self._runs.get(worker.run_id)
            worker.run_id = ""
            if record is not None and record.status.state == cpb.RUN_STATE_RUNNING:
                self._drop_member(record, worker.worker_id)
        while self._dead and (
            len(self._dead) > _KEEP_DEAD_WORKERS
            or now - next(iter(self._dead.values())).last_seen > self._forget_after_s
        ):
            self._dead.popitem(last=False)
        return bool(silent)

    def _drop_member(self, record: RunRecord, worker_id: int) -> None:
        record.live.discard(worker_id)
        record.status.dead_workers.append(worker_id)
        self._tell_members(record)
        self._event(record)
        self._maybe_complete(record)

    def _tell_members(self, record: RunRecord, ranks_changed: bool = False) -> None:
        """The run's membership changed: a new epoch, in which the shards hear its live workers
        (and its workers by rank, where one took another's rank)."""
        record.epoch += 1
        self._to_shards(
            record,
            "SetMembership",
            shard_pb2.SetMembershipRequest(
                run_id=record.run_id,
                epoch=record.epoch,
                live_workers=sorted(record.live),
                workers=record.status.workers if ranks_changed else [],
            ),
        )

    def _expire_shards(self, now: float) -> bool:
        """Leave silent shards out of new placements; forget them after a while, unless a running
        run holds parts on them (its wait for their return is timed from their last heartbeat).
        True when any died."""
        died = False
        held = self._held_by_running()
        for shard in list(self._shards.values()):
            silent_s = now - shard.last_seen
            if shard.alive and silent_s > self.heartbeat_timeout_s:
                shard.alive = False
                died = True
                _LOGGER.warning(
                    "shard %d at %s missed heartbeats: new runs are placed without it", shard.index, shard.address
                )
            elif not shard.alive and silent_s > self._forget_after_s and shard.address not in held:
                del self._shards[shard.address]
        return died

    def _held_by_running(self) -> set[str]:
        """The addresses of the shards that running runs give parts to."""
        return {
            address
            for record in self._runs.values()
            if record.status.state == cpb.RUN_STATE_RUNNING and record.placement is not None
            for address in _holders(record.placement)
        }

    def _fail_runs_without_shards(self, now: float) -> None:
        """Fail each running run that a dead shard holding its parts left for the shard return
        timeout: its parts are nowhere else (a shard restarted in time recovers the run instead:
        ps_server/recovery.py)."""
        held = self._held_by_running()
        for address in set(self._unheard_since) - held:  # their runs ended: nothing waits for them
            del self._unheard_since[address]
        if not self.shard_return_timeout_s:
            return
        for record in list(self._runs.values()):
            if record.status.state != cpb.RUN_STATE_RUNNING or record.placement is None:
                continue
            for address in _holders(record.placement):
                shard = self._shards.get(address)
                if shard is not None:
                    silent_s = 0.0 if shard.alive else now - shard.last_seen
                    since = ""
                else:  # named by a run taken back at start-up, and not heard since
                    silent_s = now - self._unheard_since.get(address, now)
                    since = " (since the coordinator restarted)"
                if silent_s > self.shard_return_timeout_s:
                    index = list(record.placement.shards).index(address)
                    message = (
                        f"shard {index} at {address} has not come back for {silent_s:.0f} s{since}: "
                        "the run cannot go on without its parts"
                    )
                    _LOGGER.error("run %s: %s", record.run_id, message, extra={"run_id": record.run_id})
                    self._end(record, cpb.RUN_STATE_FAILED, message)
                    break


def _holders(placement: shard_pb2.Placement) -> tuple[str, ...]:
    """The addresses of the shards the placement gives parts to (one without parts has no state)."""
    return tuple(sorted({placement.shards[p.shard] for p in placement.parts}))


def _shard_refusal(address: str, e: grpc.RpcError) -> GradpsError:
    """A shard's refusal of a call about checkpoints, as the coordinator's answer: its code where
    it says what is missing or damaged, else UNAVAILABLE."""
    codes: dict[grpc.StatusCode, type[GradpsError]] = {
        grpc.StatusCode.NOT_FOUND: NotFound,
        grpc.StatusCode.FAILED_PRECONDITION: NotNow,
        grpc.StatusCode.DATA_LOSS: DataLost,
    }
    return codes.get(e.code(), Unavailable)(f"shard {address}: {e.code().name}: {e.details()}")


def _common_checkpoints(listed: dict[str, dict[int, shard_pb2.CheckpointInfo]]) -> cpb.ListRunCheckpointsResponse:
    """The steps every shard of `listed` (address: checkpoints by step) has, with each shard's."""
    common = set.intersection(*(set(by_step) for by_step in listed.values())) if listed else set()
    answer = cpb.ListRunCheckpointsResponse()
    for step in sorted(common):
        at = answer.checkpoints.add(step=step)
        for address, by_step in listed.items():
            c = by_step[step]
            at.shards.add(shard=address, sequence=c.sequence, step=step, bytes=c.bytes)
            at.bytes += c.bytes
    for address, by_step in listed.items():
        answer.shards.add(shard=address, steps=sorted(by_step))
    return answer


def _check_steps(record: RunRecord, m: cpb.Metrics) -> None:
    """Invalid for a report that names other total steps than the run's (resolved from epochs by
    its first worker, else its spec's); NotNow for a done report before the last of them."""
    if m.error:  # a failure is heard whatever else the report says
        return
    known = record.status.total_steps or record.status.spec.steps
    if known and m.total_steps and m.total_steps != known:
        raise Invalid(f"worker {m.worker_id} reported total_steps {m.total_steps}; the run has {known}")
    steps = known or m.total_steps
    if m.done and m.step < steps:
        raise NotNow(
            f"worker {m.worker_id} reported done at step {m.step} of the run's {steps}: "
            "done comes with the report after the last step"
        )


def _about(run_id: str, worker_id: int) -> dict[str, object]:
    """A log line's fields (gradps.logs): the worker, and its run where it has one."""
    return {"worker_id": worker_id, "run_id": run_id or None}


def _state_name(record: RunRecord) -> str:
    return cpb.RunState.Name(record.status.state).removeprefix("RUN_STATE_").lower()


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def _check_imports_allowed(spec: run_pb2.RunSpec, allow_import: tuple[str, ...]) -> None:
    """Refuse a model or dataset import path the operator did not allow (the workers check again)."""
    for name in (spec.model, spec.dataset):
        if ":" in name:
            try:
                check_import_allowed(name, allow_import)
            except ImportRefused as e:
                raise PermissionDenied(str(e)) from None


def _finite_seconds(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """A number of seconds: click's FloatRange lets nan and inf through."""
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a number of seconds")
    return value


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@port_option(50051)
@bind_option
@secret_options
@tls_options
@max_calls_option
@allow_import_option
@click.option(
    "--heartbeat-timeout",
    envvar="GRADPS_HEARTBEAT_TIMEOUT",
    show_envvar=True,
    default=5.0,
    type=click.FloatRange(min=0.1),
    help="Seconds without a heartbeat before a worker is declared dead (and forgotten), or a shard is left "
    "out of new runs' placement.",
)
@click.option(
    "--shard-return-timeout",
    envvar="GRADPS_SHARD_RETURN_TIMEOUT",
    show_envvar=True,
    default=DEFAULT_SHARD_RETURN_TIMEOUT_S,
    type=click.FloatRange(min=0),
    callback=_finite_seconds,
    help="Seconds a dead shard holding parts of a running run may stay silent before the run fails (after a "
    "coordinator restart: counted from the restart). 0: wait forever.",
)
@click.option(
    "--keep-runs",
    envvar="GRADPS_KEEP_RUNS",
    show_envvar=True,
    default=DEFAULT_KEEP_RUNS,
    type=click.IntRange(min=1),
    help="Ended runs to keep (status and metrics); older ones are deleted.",
)
@click.option(
    "--state-dir",
    envvar="GRADPS_STATE_DIR",
    show_envvar=True,
    default=None,
    type=click.Path(path_type=Path),
    help="Keep runs, their metrics and placements here (SQLite), for a restarted coordinator to take back; "
    "created if missing. Unset: in memory, forgotten on exit.",
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
    allow_import: tuple[str, ...],
    heartbeat_timeout: float,
    shard_return_timeout: float,
    keep_runs: int,
    state_dir: Path | None,
    port_file: str | None,
    metrics_port: int,
    metrics_host: str,
    metrics_port_file: str | None,
    log_level: str,
    log_format: str,
) -> None:
    """gradps coordinator: runs, worker membership, placement table and metrics."""
    configure_logging("coordinator", log_level, log_format)
    cluster_secret = server_secret(secret, secret_file, bind_address, insecure)
    set_process_token(cluster_secret.token(ADMIN) if cluster_secret else None)  # its calls to the shards
    tls = service_tls(tls_cert, tls_key, tls_ca, tls_client_auth)
    try:  # before the port is bound: a coordinator that cannot keep its runs does not start
        store = RunStore.open(state_dir)
        servicer = CoordinatorServicer(heartbeat_timeout, keep_runs, store, shard_return_timeout)
    except StoreError as e:
        raise click.ClickException(f"--state-dir {state_dir}: {e}") from None
    metrics.watch_coordinator(servicer.census)
    serve_metrics(metrics_port, metrics_host, metrics_port_file)
    servicer.allow_import = allow_import
    server = make_server(max_workers=64, secret=cluster_secret, max_calls_per_caller=max_calls_per_caller)
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(servicer, server)
    add_health(server, ["gradps.v1.CoordinatorService"])
    try:
        bound = bind(server, port, bind_address, tls)
    except OSError as e:
        raise click.UsageError(f"--port {port}: {e}") from None
    server.start()
    write_port_file(port_file, bound)
    _LOGGER.info("coordinator serving on port %d", bound)
    serve_until_signal(server)
    servicer.close()


if __name__ == "__main__":
    main()
