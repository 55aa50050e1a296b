"""A worker's membership in the cluster: join, heartbeat, wait for a run, report metrics."""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass

import grpc

from gradps.auth.client_tokens import client_token, forget, remember
from gradps.auth.tokens import WORKER_TOKEN_KEY
from gradps.channel import open_channel
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import coordinator_pb2_grpc, run_pb2, shard_pb2, tensor_pb2

_LOGGER = logging.getLogger("gradps.worker")
# close(): how long LeaveWorker may take (on a busy host the answer can take seconds); a coordinator
# that is gone refuses at once, and its heartbeat timeout covers one that hangs.
_LEAVE_TIMEOUT_S = 10.0
# How often a long-polled assignment looks whether the service is stopping.
_STOP_LOOK_S = 0.05


class RunAbandoned(Exception):
    """The run was stopped, failed elsewhere, or the coordinator declared this worker dead."""


@dataclass(frozen=True)
class Assignment:
    """A run this worker takes part in."""

    run_id: str
    spec: run_pb2.RunSpec
    # This worker's rank, and the number of workers.
    rank: int
    world: int
    # Worker ids by rank.
    workers: tuple[int, ...]


class WorkerSession:
    """Joins the coordinator and keeps heartbeating from a background thread."""

    def __init__(
        self,
        coordinator: str,
        name: str | None = None,
        device: str = "cpu",
        join_timeout_s: float = 60.0,
        stop: threading.Event | None = None,
        token: str | None = None,
    ):
        """Join now, retrying for up to `join_timeout_s` while the coordinator starts; setting
        `stop` (the service's SIGTERM) gives up at once, and later ends the current run for this
        worker (`stopping`). ConnectionError if it never answers.

        `token`: the one JoinWorker takes (default: `gradps.auth.client_tokens.client_token`'s). When the
        coordinator answers with this worker's own token, every later call to it and to the
        run's shards carries that one (gradps/auth/access.py)."""
        self.coordinator = coordinator
        self._shutdown = stop or threading.Event()
        self.name = name or socket.gethostname()
        self.device = device
        join_token = token or client_token(coordinator)
        # Joins go with the token given; the rest with the worker's own once it has one.
        self._join_channel = open_channel(coordinator, join_token)
        self._join_stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._join_channel)
        self._own_token: str | None = None
        self._token = join_token
        self._channel = open_channel(coordinator, lambda: self._own_token or self._token)
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)
        self._remembered: set[str] = set()
        self._run_id = ""
        # Counts the assignments taken: a run stopped and resumed at once is a new part of it.
        self._part = 0
        self._part_lock = threading.Lock()
        self._stop_run = threading.Event()
        self._closed = threading.Event()
        self.worker_id, interval_ms = self._join(join_timeout_s)
        self._heartbeat = threading.Thread(target=self._beat, args=(interval_ms / 1000,), name="heartbeat", daemon=True)
        self._heartbeat.start()

    def _join(self, timeout_s: float) -> tuple[int, int]:
        deadline = time.monotonic() + timeout_s
        warned = False
        while True:
            try:
                r, call = self._join_stub.JoinWorker.with_call(
                    cpb.JoinWorkerRequest(name=self.name, device=self.device), timeout=5
                )
                own = dict(call.trailing_metadata() or ()).get(WORKER_TOKEN_KEY)
                self._own_token = str(own) if own else None
                _LOGGER.info("joined %s as worker %d", self.coordinator, r.worker_id)
                return r.worker_id, r.heartbeat_interval_ms
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    # No retry mends a token: say so now.
                    raise ConnectionError(f"coordinator {self.coordinator} refused to join: {e.details()}") from None
                if time.monotonic() > deadline:
                    raise ConnectionError(f"cannot reach coordinator at {self.coordinator}: {e.details()}") from None
                if not warned:  # say why nothing happens yet
                    _LOGGER.warning("coordinator %s: %s; retrying %.0f s", self.coordinator, e.code().name, timeout_s)
                    warned = True
            if self._shutdown.wait(0.5):
                raise ConnectionError(f"stopped before joining the coordinator at {self.coordinator}")

    def _beat(self, interval_s: float) -> None:
        while not self._closed.wait(interval_s):
            if self._heard(timeout_s=max(1.0, interval_s * 2)) and not self._closed.is_set():
                try:
                    self.worker_id, _ = self._join(5.0)
                except ConnectionError:
                    pass
                except ValueError:  # the session closed its channels meanwhile: nothing to join for
                    return

    def _heard(self, timeout_s: float, wait_for_ready: bool = False) -> bool:
        """One heartbeat, which may say that the current run is over for this worker (stopped, or
        handed to a new part of it); True when the coordinator asks it to join again."""
        with self._part_lock:  # the run and its part as one: an assignment may be taken meanwhile
            request = cpb.HeartbeatRequest(worker_id=self.worker_id, run_id=self._run_id)
            part = self._part
        try:
            r = self._stub.Heartbeat(request, timeout=timeout_s, wait_for_ready=wait_for_ready)
        except grpc.RpcError:
            return False  # the coordinator is briefly unreachable; the timeout decides
        # A stop of the part before an assignment taken meanwhile is not this part's.
        with self._part_lock:
            if (r.stop and part == self._part) or r.rejoin:
                self._stop_run.set()
        return r.rejoin

    def still_in_run(self) -> bool:
        """Ask the coordinator now, not at the next heartbeat, whether the current run is still this
        worker's: before it follows the run back to a checkpoint, which a stopped run resumed at
        once does too, with this worker's next part in it (True when the coordinator does not
        answer within 5 s). The heartbeat thread does any joining again."""
        self._heard(timeout_s=5.0, wait_for_ready=True)
        return not self.stopping

    def close(self) -> None:
        """Leave the cluster (best effort: a coordinator that does not answer at once declares this
        worker dead after its heartbeat timeout instead) and close the channels."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._stub.LeaveWorker(cpb.LeaveWorkerRequest(worker_id=self.worker_id), timeout=_LEAVE_TIMEOUT_S)
        except grpc.RpcError as e:
            _LOGGER.debug("leaving coordinator %s: %s", self.coordinator, e.code().name)
        self._channel.close()
        self._join_channel.close()
        for address in self._remembered:
            forget(address)

    @property
    def stopping(self) -> bool:
        """True once the current run was stopped, or the service is shutting down: the training
        loop should give up (and not wait for a shard that does not answer)."""
        return self._stop_run.is_set() or self._shutdown.is_set()

    def wait_for_assignment(self, wait_s: float = 10.0) -> Assignment | None:
        """Long-poll the coordinator; None when nothing was assigned within `wait_s`, or once the
        service is stopping (the poll is cancelled then: a stop does not wait it out)."""
        call = self._stub.GetAssignment.future(
            cpb.GetAssignmentRequest(worker_id=self.worker_id, wait_ms=int(wait_s * 1000)), timeout=wait_s + 10
        )
        while not call.done():
            if self._shutdown.wait(_STOP_LOOK_S) and not call.done():
                call.cancel()
                return None
        r = call.result()
        if not r.run_id:
            return None
        with self._part_lock:
            self._run_id = r.run_id
            self._part += 1
            self._stop_run.clear()
        return Assignment(r.run_id, r.spec, r.rank, len(r.workers), tuple(r.workers))

    def placement(self, run_id: str, tensors: list[tensor_pb2.TensorSpec], total_steps: int) -> shard_pb2.Placement:
        """The run's placement table (the first worker's call creates it)."""
        return self.placed(run_id, tensors, total_steps).placement

    def placed(self, run_id: str, tensors: list[tensor_pb2.TensorSpec], total_steps: int) -> cpb.GetPlacementResponse:
        """The run's placement table, and where this worker starts (a resumed run's step and the
        run's restore epoch)."""
        r = self._stub.GetPlacement(
            cpb.GetPlacementRequest(run_id=run_id, tensors=tensors, total_steps=total_steps, worker_id=self.worker_id),
            timeout=60,
        )
        if self._own_token:  # the shards admit this worker's calls with its own token only
            for address in r.placement.shards:
                remember(address, self._own_token)
                self._remembered.add(address)
        return r

    def report(self, run_id: str, metrics: cpb.Metrics) -> None:
        """Send metrics; raise RunAbandoned when the coordinator says the run is over for us. A
        report made while the coordinator restarts waits for it (30 s at most): only one in flight
        when it dies is lost."""
        metrics.worker_id = self.worker_id
        request = cpb.ReportMetricsRequest(run_id=run_id, metrics=metrics)
        r = self._stub.ReportMetrics(request, timeout=30, wait_for_ready=True)
        if metrics.done or metrics.error:
            self._run_id = ""
        if r.stop and not metrics.done and not metrics.error:
            raise RunAbandoned(f"run {run_id} was stopped")
