"""Bad requests to the coordinator get a proper status and a one-line message, and change nothing.

Placement and assignment run on `shards_only` (conftest: a real coordinator and shards, the test
as worker). Run specs, shard registration and the long poll use a coordinator alone, served from
this process: no shard, so no run ever starts, and registering a made-up shard harms nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
import pytest
import torch

from gradps.channel import bind, make_server, open_channel
from gradps.parameter_client import tensor_specs
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import coordinator_pb2_grpc, run_pb2, tensor_pb2
from gradps.worker_session import WorkerSession
from ps_server import coordinator
from ps_server.coordinator import CoordinatorServicer

INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
NAN, INF = float("nan"), float("inf")
Opt = run_pb2.OptimizerSpec
Codec = tensor_pb2.CodecParams


def _tensor(name: str, shape: list[int], dtype: int = tensor_pb2.DTYPE_FLOAT32) -> tensor_pb2.TensorSpec:
    return tensor_pb2.TensorSpec(name=name, shape=shape, dtype=dtype)


def _rejected(call: Callable[[], object], code: grpc.StatusCode) -> str:
    """The details of the error `call` fails with, checked to be `code` and one line."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    details = err.value.details() or ""
    assert err.value.code() == code, (err.value.code(), details)
    assert details and "\n" not in details, details
    return details


@pytest.fixture(scope="module")
def coord(shards_only) -> Iterator[coordinator_pb2_grpc.CoordinatorServiceStub]:
    with open_channel(shards_only.address) as channel:
        yield coordinator_pb2_grpc.CoordinatorServiceStub(channel)


@pytest.fixture(scope="module")
def lone_address() -> Iterator[str]:
    """A coordinator alone on a small server (8 threads); a worker that joins is alive until 3 s
    without a heartbeat. Its address."""
    server = make_server(max_workers=8)
    servicer = CoordinatorServicer(heartbeat_timeout_s=3.0)
    coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(servicer, server)
    port = bind(server, 0)
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)
        servicer.close()


@pytest.fixture(scope="module")
def lone(lone_address: str) -> Iterator[coordinator_pb2_grpc.CoordinatorServiceStub]:
    """A stub of the lone coordinator (lone_address)."""
    with open_channel(lone_address) as channel:
        yield coordinator_pb2_grpc.CoordinatorServiceStub(channel)


@contextmanager
def _running_run(address: str, coord, **spec) -> Iterator[tuple[str, cpb.GetAssignmentResponse]]:
    """A RUNNING one-worker asgd run whose worker is this test (a heartbeating WorkerSession):
    (run id, the worker's assignment). At the end the session closes without a word: the
    coordinator declares the worker dead and fails the run, so the worker never idles into the
    next test's run."""
    request = cpb.SubmitRunRequest(spec=run_pb2.RunSpec(**{"scheme": "asgd", "workers": 1, "steps": 5, **spec}))
    run_id = coord.SubmitRun(request, timeout=10).run_id
    session = WorkerSession(address, name="validation")
    try:
        poll = cpb.GetAssignmentRequest(worker_id=session.worker_id, wait_ms=10_000)
        assignment = coord.GetAssignment(poll, timeout=20)
        assert assignment.run_id == run_id
        yield run_id, assignment
    finally:
        session.close()


def _placement(run_id: str, tensors: list[tensor_pb2.TensorSpec]) -> cpb.GetPlacementRequest:
    return cpb.GetPlacementRequest(run_id=run_id, tensors=tensors, total_steps=5)


# ---- GetPlacement -----------------------------------------------------------------------------

HUGE_SHAPES = [
    ([2**40, 2**40], "2^40 elements"),  # 2^80: once ~2^60 parts built under the placement lock
    ([0, 2**41], "2^40 elements"),  # empty, but no tensor has such a dimension
    ([2**20 + 1, 2**20], "2^40 elements"),
    ([2**39], "262144 parts"),  # 2^19 parts of 4 MiB
]


def test_get_placement_refuses_a_shape_beyond_the_limits_at_once(shards_only, coord):
    with _running_run(shards_only.address, coord) as (run_id, _):
        for shape, why in HUGE_SHAPES:
            began = time.monotonic()
            details = _rejected(
                lambda s=shape: coord.GetPlacement(_placement(run_id, [_tensor("w", s)]), timeout=5), INVALID
            )
            assert why in details and time.monotonic() - began < 2, (shape, details)
        assert not coord.GetRun(cpb.GetRunRequest(run_id=run_id)).HasField("placement")
        # Nothing wedged: the run's real tensors are placed.
        placement = coord.GetPlacement(_placement(run_id, [_tensor("w", [64, 32])]), timeout=10).placement
        assert [(p.name, p.count) for p in placement.parts] == [("w", 64 * 32)]


def test_get_placement_needs_a_running_run(coord):
    tensors = [_tensor("w", [4])]
    # More workers than ever idle here: the run stays pending.
    spec = run_pb2.RunSpec(scheme="asgd", workers=64, steps=5)
    run_id = coord.SubmitRun(cpb.SubmitRunRequest(spec=spec), timeout=10).run_id
    try:
        details = _rejected(lambda: coord.GetPlacement(_placement(run_id, tensors), timeout=10), PRECONDITION)
        assert "RUN_STATE_PENDING" in details
        run = coord.GetRun(cpb.GetRunRequest(run_id=run_id))
        assert run.run.state == cpb.RUN_STATE_PENDING and not run.HasField("placement")
    finally:
        coord.StopRun(cpb.StopRunRequest(run_id=run_id), timeout=10)
    details = _rejected(lambda: coord.GetPlacement(_placement(run_id, tensors), timeout=10), PRECONDITION)
    assert "RUN_STATE_STOPPED" in details
    assert not coord.GetRun(cpb.GetRunRequest(run_id=run_id)).HasField("placement")


BAD_TENSOR_LISTS = [
    ([], "no tensors"),
    ([_tensor("w", [4]), _tensor("b", [4]), _tensor("w", [4])], "'w' appears twice"),
    ([_tensor("", [4])], "empty name"),
    ([_tensor("w", [4], tensor_pb2.DTYPE_FLOAT16)], "DTYPE_FLOAT16"),
    ([_tensor("w", [4], tensor_pb2.DTYPE_UNSPECIFIED)], "DTYPE_UNSPECIFIED"),
]


def test_get_placement_refuses_tensors_a_shard_cannot_hold(shards_only, coord):
    with _running_run(shards_only.address, coord) as (run_id, _):
        for tensors, why in BAD_TENSOR_LISTS:
            details = _rejected(lambda t=tensors: coord.GetPlacement(_placement(run_id, t), timeout=10), INVALID)
            assert why in details, details
        assert not coord.GetRun(cpb.GetRunRequest(run_id=run_id)).HasField("placement")
        # What a worker sends is placed (and fixed for the run).
        model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
        specs = tensor_specs(dict(model.named_parameters()))
        placement = coord.GetPlacement(_placement(run_id, specs), timeout=10).placement
        assert list(placement.tensors) == specs


def test_assignment_carries_the_run_s_steps(shards_only, coord):
    with _running_run(shards_only.address, coord, steps=7) as (_, assignment):
        assert assignment.total_steps == 7


# ---- SubmitRun (a coordinator alone) ----------------------------------------------------------

BAD_SPECS = {
    "adam beta1=2": dict(optimizer=Opt(name="adam", lr=0.1, beta1=2.0)),
    "adam beta2=1": dict(optimizer=Opt(name="adam", lr=0.1, beta2=1.0)),
    "adam eps=-1": dict(optimizer=Opt(name="adam", lr=0.1, eps=-1)),
    "sgd momentum=nan": dict(optimizer=Opt(name="sgd", lr=0.1, momentum=NAN)),
    "sgd momentum=inf": dict(optimizer=Opt(name="sgd", lr=0.1, momentum=INF)),
    "sgd weight_decay=nan": dict(optimizer=Opt(name="sgd", lr=0.1, weight_decay=NAN)),
    "constant schedule gamma=nan": dict(optimizer=Opt(name="sgd", lr=0.1, gamma=NAN)),
    "codec 99": dict(codec=Codec(codec=99)),
    "int8 with a ratio": dict(codec=Codec(codec=tensor_pb2.CODEC_INT8, ratio=0.5)),
    "fp16 with stochastic rounding": dict(codec=Codec(codec=tensor_pb2.CODEC_FP16, stochastic_rounding=True)),
    "pull fp16 with a ratio": dict(pull_codec=Codec(codec=tensor_pb2.CODEC_FP16, ratio=0.5)),
    "pseudosync alpha=5": dict(scheme="pseudosync", scheme_params=run_pb2.SchemeParams(alpha=5)),
    "pseudosync alpha=nan": dict(scheme="pseudosync", scheme_params=run_pb2.SchemeParams(alpha=NAN)),
    "pseudosync alpha_min=2": dict(scheme="pseudosync", scheme_params=run_pb2.SchemeParams(alpha_min=2)),
    "asgd dc_lambda=nan": dict(scheme="asgd", scheme_params=run_pb2.SchemeParams(dc_lambda=NAN)),
    "asgd dc_lambda=-1": dict(scheme="asgd", scheme_params=run_pb2.SchemeParams(dc_lambda=-1)),
    "straggler_factor=nan": dict(straggler_factor=NAN),
    "straggler_factor=inf": dict(straggler_factor=INF),
    "workers=10**9": dict(workers=10**9),
    "steps=2**60": dict(steps=2**60),
    "epochs=1e300": dict(steps=0, epochs=1e300),
}


@pytest.mark.parametrize("fields", BAD_SPECS.values(), ids=BAD_SPECS.keys())
def test_submit_run_refuses_a_spec_that_would_fail_later(lone, fields):
    spec = run_pb2.RunSpec(**{"workers": 1, "steps": 5, **fields})
    before = lone.ListRuns(cpb.ListRunsRequest(), timeout=10).runs

    def submit() -> None:
        run_id = lone.SubmitRun(cpb.SubmitRunRequest(spec=spec), timeout=10).run_id
        lone.StopRun(cpb.StopRunRequest(run_id=run_id), timeout=10)  # accepted: leave nothing pending

    _rejected(submit, INVALID)
    assert lone.ListRuns(cpb.ListRunsRequest(), timeout=10).runs == before


def test_runs_submitted_in_one_second_never_share_an_id(lone, monkeypatch):
    # The random suffix drawn twice in a row, as two runs submitted in one second may draw it.
    draws = iter(["beef", "beef", "beef", "cafe"])
    monkeypatch.setattr(coordinator.secrets, "token_hex", lambda n: next(draws))
    spec = run_pb2.RunSpec(scheme="asgd", workers=1, steps=5)
    ids = [lone.SubmitRun(cpb.SubmitRunRequest(spec=spec), timeout=10).run_id for _ in range(2)]
    try:
        assert ids[0].endswith("-beef") and ids[1] != ids[0], ids
        listed = {r.run_id for r in lone.ListRuns(cpb.ListRunsRequest(), timeout=10).runs}
        assert set(ids) <= listed
    finally:
        for run_id in ids:
            lone.StopRun(cpb.StopRunRequest(run_id=run_id), timeout=10)


def test_stop_run_keeps_a_one_line_reason_and_refuses_another_leaving_the_run_as_it_was(lone):
    spec = run_pb2.RunSpec(scheme="asgd", workers=1, steps=5)
    run_ids = [lone.SubmitRun(cpb.SubmitRunRequest(spec=spec), timeout=10).run_id for _ in range(2)]
    try:
        refused = {
            "a" * 1025: "1025 characters, more than 1024",
            "reached the target\nand more": "must be one line",
            "carriage\rreturn": "must be one line",
        }
        for reason, said in refused.items():
            details = _rejected(lambda r=reason: lone.StopRun(cpb.StopRunRequest(run_id=run_ids[0], reason=r)), INVALID)
            assert said in details, details
            run = lone.GetRun(cpb.GetRunRequest(run_id=run_ids[0]), timeout=10).run
            assert run.state == cpb.RUN_STATE_PENDING and not run.message, run
        lone.StopRun(cpb.StopRunRequest(run_id=run_ids[0], reason="stopped: " + "b" * 1015), timeout=10)
        lone.StopRun(cpb.StopRunRequest(run_id=run_ids[1]), timeout=10)
        runs = [lone.GetRun(cpb.GetRunRequest(run_id=run_id), timeout=10).run for run_id in run_ids]
        assert [r.state for r in runs] == [cpb.RUN_STATE_STOPPED] * 2
        assert [r.message for r in runs] == ["stopped: " + "b" * 1015, "stopped by a client"]
    finally:
        for run_id in run_ids:
            try:
                lone.StopRun(cpb.StopRunRequest(run_id=run_id), timeout=10)
            except grpc.RpcError:
                pass  # stopped above


# ---- RegisterShard (a coordinator alone) ------------------------------------------------------

BAD_ADDRESSES = [":", "host:", ":50052", "host:0", "host:65536", "host:port", "::1:50052", "[::1:50052", "a b:1"]


def test_register_shard_takes_host_port_only(lone):
    before = lone.GetCluster(cpb.GetClusterRequest(), timeout=10).shards
    for address in BAD_ADDRESSES:
        details = _rejected(
            lambda a=address: lone.RegisterShard(cpb.RegisterShardRequest(address=a), timeout=10), INVALID
        )
        assert repr(address) in details, details
    assert lone.GetCluster(cpb.GetClusterRequest(), timeout=10).shards == before
    good = ["127.0.0.1:50052", "[::1]:50052", "shard-1.gradps:65535"]
    for address in good:
        lone.RegisterShard(cpb.RegisterShardRequest(address=address), timeout=10)
    assert lone.GetCluster(cpb.GetClusterRequest(), timeout=10).shards == [*before, *good]


# ---- GetAssignment's long poll (a coordinator alone) ------------------------------------------


def test_get_assignment_long_poll_ends_with_its_caller_and_is_capped(lone, lone_address, monkeypatch):
    worker_id = lone.JoinWorker(cpb.JoinWorkerRequest(name="poller"), timeout=10).worker_id
    poll = cpb.GetAssignmentRequest(worker_id=worker_id, wait_ms=2**32 - 1)
    # Four connections, four callers: one may hold half the server's threads.
    channels = [grpc.insecure_channel(lone_address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(4)]
    stubs = [coordinator_pb2_grpc.CoordinatorServiceStub(c) for c in channels]

    def gone(i: int) -> grpc.StatusCode:
        try:
            stubs[i % 4].GetAssignment(poll, timeout=0.5)
        except grpc.RpcError as e:
            return e.code()
        return grpc.StatusCode.OK

    try:
        # As many callers that give up as the server has threads (each is answered empty or runs
        # out of time, whichever notices its deadline first): every thread comes back.
        with ThreadPoolExecutor(8) as pool:
            assert set(pool.map(gone, range(8))) <= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.OK}
        for channel in channels:
            channel.close()
        time.sleep(0.5)
        workers = lone.GetCluster(cpb.GetClusterRequest(), timeout=1).workers
        assert [(w.worker_id, w.alive) for w in workers] == [(worker_id, True)]  # no poll ended by its death
        # A caller that waits on is answered (empty) at the cap, not after wait_ms.
        monkeypatch.setattr(coordinator, "_MAX_ASSIGNMENT_WAIT_S", 0.5)
        lone.Heartbeat(cpb.HeartbeatRequest(worker_id=worker_id), timeout=1)
        began = time.monotonic()
        assert not lone.GetAssignment(poll, timeout=10).run_id
        assert time.monotonic() - began < 3
    finally:
        # Until the worker, heartbeats gone, is declared dead: that also ends any poll still
        # waiting (were they not ended with their callers), so none outlives the test.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not any(w.alive for w in lone.GetCluster(cpb.GetClusterRequest(), timeout=30).workers):
                break
            time.sleep(0.2)
