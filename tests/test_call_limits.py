"""Calls in flight per caller (gradps/auth/limits.py), against real services: a caller holding
its limit of waiting calls (long-polled assignments, pulls waiting for a step) is refused
RESOURCE_EXHAUSTED in one line for any more, while another caller is served; once its calls end
it is served again. A worker counts as one caller over all its connections; without tokens, a
connection is a caller; JoinWorker is not counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from client.local_cluster import LocalCluster
from client.sdk import Client, run_spec
from gradps.auth import tokens
from gradps.auth.limits import MAX_CALLS_ENV
from gradps.channel import bind, make_server
from gradps.parameter_client import tensor_specs
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import coordinator_pb2_grpc, shard_pb2, shard_pb2_grpc
from ps_server.coordinator import CoordinatorServicer
from tests.services import Services, until

LIMIT = 4
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
_WAIT_MS = 60_000  # the longest an assignment poll waits


def _connection(address: str) -> grpc.Channel:
    """A channel on a TCP connection of its own (channels alike share one by default)."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def _as(token: str | None) -> list[tuple[str, str]] | None:
    return [("authorization", f"Bearer {token}")] if token else None


def _until_refused(probe: Callable[[], object], held: list, reopen: Callable[[], object]) -> str:
    """Probe (a quick call of the caller holding `held`) until it is refused RESOURCE_EXHAUSTED;
    its message. A held call refused because a probe briefly took its place is opened again."""
    deadline = time.monotonic() + 30
    while True:
        for i, call in enumerate(held):
            if call.done():
                assert call.code() == EXHAUSTED, (call.code(), call.details())
                held[i] = reopen()
        time.sleep(0.2)
        try:
            probe()
        except grpc.RpcError as e:
            if e.code() != EXHAUSTED:
                raise
            assert e.details() and "\n" not in e.details()
            return e.details()
        assert time.monotonic() < deadline, "the caller was never refused"


def _served(probe: Callable[[], object]) -> bool:
    try:
        probe()
    except grpc.RpcError as e:
        if e.code() != EXHAUSTED:
            raise
        return False
    return True


def _one_more_is_refused(open_call: Callable[[], object]) -> None:
    extra = open_call()
    with pytest.raises(grpc.RpcError) as caught:
        extra.result(timeout=20)
    assert caught.value.code() == EXHAUSTED, caught.value.details()


# ---- with tokens: a worker is one caller ----------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv(MAX_CALLS_ENV, str(LIMIT))  # read by the services as they start
        with LocalCluster(shards=1, workers=0, heartbeat_timeout_s=120.0) as c:
            yield c


def _join(cluster: LocalCluster, name: str) -> tuple[int, str]:
    with grpc.insecure_channel(cluster.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        joined, call = stub.JoinWorker.with_call(
            cpb.JoinWorkerRequest(name=name), metadata=_as(cluster.role_token(tokens.WORKER)), timeout=10
        )
    return joined.worker_id, dict(call.trailing_metadata())[tokens.WORKER_TOKEN_KEY]


def test_a_worker_past_its_limit_of_long_polls_is_refused_and_others_are_served(cluster):
    idle, idle_token = _join(cluster, "poller")
    other, other_token = _join(cluster, "other")
    channels = [_connection(cluster.address) for _ in range(3)]
    stubs = [coordinator_pb2_grpc.CoordinatorServiceStub(c) for c in channels]
    try:
        count = iter(range(1_000_000))

        def poll() -> grpc.Future:  # waits: no run is pending; every connection of the worker counts
            stub = stubs[next(count) % 2]
            request = cpb.GetAssignmentRequest(worker_id=idle, wait_ms=_WAIT_MS)
            return stub.GetAssignment.future(request, metadata=_as(idle_token), timeout=90)

        def beat(stub: coordinator_pb2_grpc.CoordinatorServiceStub, worker: int, token: str) -> Callable[[], object]:
            return lambda: stub.Heartbeat(cpb.HeartbeatRequest(worker_id=worker), metadata=_as(token), timeout=10)

        held = [poll() for _ in range(LIMIT)]
        details = _until_refused(beat(stubs[2], idle, idle_token), held, poll)  # a third connection, same worker
        assert details.startswith(f"worker {idle} has {LIMIT} calls in flight"), details
        _one_more_is_refused(poll)
        assert _served(beat(stubs[2], other, other_token))
        assert not any(call.done() for call in held)  # the held calls still wait
        for call in held:
            call.cancel()
        until(lambda: _served(beat(stubs[2], idle, idle_token)), 30, "the worker was never served again")
        once = cpb.GetAssignmentRequest(worker_id=idle, wait_ms=1)
        assert not stubs[0].GetAssignment(once, metadata=_as(idle_token), timeout=10).run_id
    finally:
        for worker, token in ((idle, idle_token), (other, other_token)):  # no later run is given them
            stubs[2].LeaveWorker(cpb.LeaveWorkerRequest(worker_id=worker), metadata=_as(token), timeout=10)
        for c in channels:
            c.close()


def test_a_worker_past_its_limit_of_waiting_pulls_is_refused_until_they_end(cluster):
    first, first_token = _join(cluster, "puller")
    second, second_token = _join(cluster, "peer")
    with Client(cluster.address) as client:
        run_id = client.submit(run_spec("sync", workers=2, steps=100, eval_every=0))
        (shard,) = client.cluster().shards
    try:
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            for worker, token in ((first, first_token), (second, second_token)):
                poll = cpb.GetAssignmentRequest(worker_id=worker, wait_ms=10_000)
                assert stub.GetAssignment(poll, metadata=_as(token), timeout=20).run_id == run_id
            asked = cpb.GetPlacementRequest(
                run_id=run_id, tensors=tensor_specs({"w": torch.zeros(64)}), total_steps=100
            )
            stub.GetPlacement(asked, metadata=_as(first_token), timeout=60)  # opens the run on the shard
        with _connection(shard) as channel:
            shard_stub = shard_pb2_grpc.ShardServiceStub(channel)

            def pull() -> object:  # waits: nothing was pushed (and nothing registered)
                request = shard_pb2.PullRequest(run_id=run_id, worker_id=first, min_version=1, wait_ms=_WAIT_MS)
                return shard_stub.Pull(request, metadata=_as(first_token), timeout=90)

            def stats(token: str) -> Callable[[], object]:
                request = shard_pb2.GetStatsRequest(run_id=run_id)
                return lambda: shard_stub.GetStats(request, metadata=_as(token), timeout=10)

            held = [pull() for _ in range(LIMIT)]
            details = _until_refused(stats(first_token), held, pull)
            assert details.startswith(f"worker {first} has {LIMIT} calls in flight"), details
            _one_more_is_refused(pull)
            assert _served(stats(second_token))
            quick = shard_pb2.PullRequest(run_id=run_id, worker_id=second, wait_ms=50)
            with pytest.raises(grpc.RpcError) as waited:  # served: its own wait ran out
                list(shard_stub.Pull(quick, metadata=_as(second_token), timeout=10))
            assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            for call in held:
                call.cancel()
            until(lambda: _served(stats(first_token)), 30, "the worker was never served again")
    finally:
        with Client(cluster.address) as client:
            client.stop(run_id)


# ---- without tokens: a connection is one caller ------------------------------------------------


@pytest.fixture(scope="module")
def open_coordinator(tmp_path_factory) -> Iterator[Services]:
    procs = Services(
        Path(tmp_path_factory.mktemp("limits")), f"--max-calls-per-caller={LIMIT}", "--heartbeat-timeout=60"
    )
    try:
        procs.start_coordinator()
        yield procs
    finally:
        procs.stop()


def test_without_tokens_a_connection_is_one_caller_and_joins_are_not_counted(open_coordinator):
    address = open_coordinator.address
    busy, calm = _connection(address), _connection(address)
    try:
        stub, calm_stub = (coordinator_pb2_grpc.CoordinatorServiceStub(c) for c in (busy, calm))
        worker = stub.JoinWorker(cpb.JoinWorkerRequest(name="open"), timeout=10).worker_id

        def poll() -> grpc.Future:
            request = cpb.GetAssignmentRequest(worker_id=worker, wait_ms=_WAIT_MS)
            return stub.GetAssignment.future(request, timeout=90)

        def beat(on: coordinator_pb2_grpc.CoordinatorServiceStub) -> Callable[[], object]:
            return lambda: on.Heartbeat(cpb.HeartbeatRequest(worker_id=worker), timeout=10)

        held = [poll() for _ in range(LIMIT)]
        details = _until_refused(beat(stub), held, poll)
        assert details.startswith("connection ipv") and f"has {LIMIT} calls in flight" in details, details
        _one_more_is_refused(poll)
        assert _served(beat(calm_stub))  # the same worker id on another connection: another caller
        # JoinWorker is quick and bounded by the coordinator's worker limit: never counted.
        joins = [stub.JoinWorker.future(cpb.JoinWorkerRequest(name=f"burst-{i}"), timeout=30) for i in range(4 * LIMIT)]
        assert len({join.result().worker_id for join in joins}) == 4 * LIMIT
        for call in held:
            call.cancel()
        until(lambda: _served(beat(stub)), 30, "the connection was never served again")
    finally:
        busy.close()
        calm.close()


# ---- the limit never reaches the server's threads -----------------------------------------------


def test_one_caller_holds_at_most_half_the_threads_whatever_its_limit():
    """A server of 8 threads asked for 64 calls per caller: one connection's long polls are refused
    past 4, and a caller on another connection is still served (threads are left for it)."""
    server = make_server(max_workers=8, max_calls_per_caller=64)
    servicer = CoordinatorServicer(heartbeat_timeout_s=120.0)
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(servicer, server)
    address = f"127.0.0.1:{bind(server, 0)}"
    server.start()
    hog, other = _connection(address), _connection(address)
    try:
        stub, other_stub = (
            coordinator_pb2_grpc.CoordinatorServiceStub(hog),
            coordinator_pb2_grpc.CoordinatorServiceStub(other),
        )
        worker = stub.JoinWorker(cpb.JoinWorkerRequest(name="hog"), timeout=10).worker_id
        poll = cpb.GetAssignmentRequest(worker_id=worker, wait_ms=_WAIT_MS)
        held = [stub.GetAssignment.future(poll, timeout=90) for _ in range(4)]
        details = _until_refused(
            lambda: stub.ListRuns(cpb.ListRunsRequest(), timeout=10),
            held,
            lambda: stub.GetAssignment.future(poll, timeout=90),
        )
        assert "has 4 calls in flight" in details, details
        assert _served(lambda: other_stub.ListRuns(cpb.ListRunsRequest(), timeout=10))
        for call in held:
            call.cancel()
    finally:
        hog.close()
        other.close()
        server.stop(grace=None)
        servicer.close()
