"""Bearer tokens and roles (gradps/auth/) against a real local cluster, and the import allow-list.

Every RPC of every service, listed from the proto descriptors, is refused without a token, and every
admin RPC with a worker's; a worker's own token acts only as its own worker id, and only on the runs
that worker is in (every worker RPC, each request naming another worker or run); a token of the right
shape that the cluster's secret did not mint is refused; a run naming an import path the operator
did not allow is refused at submit; a normal run with tokens completes, and no log holds a secret.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch import nn

from client.cli import cli
from client.local_cluster import LocalCluster
from client.report import follow
from client.sdk import Client, GradpsError, run_spec
from gradps.auth import access, tokens
from gradps.datasets import Dataset, load_dataset
from gradps.import_paths import ImportRefused, import_allowed
from gradps.parameter_client import tensor_specs
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import coordinator_pb2_grpc, run_pb2, shard_pb2, tensor_pb2

_PB2 = (cpb, shard_pb2, run_pb2, tensor_pb2)
_TIMEOUT_S = 20


def tiny_model(dataset: Dataset) -> nn.Module:
    """A user model by import path, which the cluster below allows (--allow-import tests.test_auth)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(dataset.input_shape), dataset.num_classes))


def _every_rpc() -> list[tuple[Any, Any]]:
    """(service, method) descriptors of every RPC of every gradps.v1 service."""
    return [
        (service, method)
        for module in _PB2
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    ]


ADMIN_RPCS = {
    "CoordinatorService": {
        "SubmitRun",
        "GetRun",
        "ListRuns",
        "StopRun",
        "ResumeRun",
        "DeleteRun",
        "WatchRun",
        "GetCluster",
        "ExportRun",
        "TakeCheckpoint",
        "ListRunCheckpoints",
        "ScaleRun",
    },
    "ShardService": {
        "OpenRun",
        "CloseRun",
        "EndRun",
        "SetMembership",
        "CheckpointRun",
        "ListCheckpoints",
        "ReadCheckpoint",
        "RestoreRun",
    },
}


def _call(channel: grpc.Channel, service: Any, method: Any, request: Message | None = None, token: str | None = None):
    """Make one call of any kind; returns the response (a list for a server stream)."""
    path = f"/{service.full_name}/{method.name}"
    request = request if request is not None else GetMessageClass(method.input_type)()
    metadata = [("authorization", f"Bearer {token}")] if token is not None else None
    serialize: Callable[[Message], bytes] = lambda m: m.SerializeToString()  # noqa: E731
    kinds = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }
    rpc = kinds[method.client_streaming, method.server_streaming](path, serialize, bytes)
    answer = rpc(iter([request]) if method.client_streaming else request, metadata=metadata, timeout=_TIMEOUT_S)
    return list(answer) if method.server_streaming else answer


def _refused(code: grpc.StatusCode, call: Callable[..., object], *args: Any, **kwargs: Any) -> str:
    """`call(*args, **kwargs)` fails with `code` and a one-line message, which is returned."""
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, **kwargs)
    error = caught.value
    assert error.code() == code, (error.code(), error.details())
    assert error.details() and "\n" not in error.details()
    return error.details()


@pytest.fixture(scope="module")
def secured():
    with LocalCluster(shards=1, workers=1, heartbeat_timeout_s=2.0, allow_import=["tests.test_auth"]) as c:
        yield c


@pytest.fixture(scope="module")
def addresses(secured):
    with Client(secured.address) as client:
        (shard,) = client.cluster().shards
    return {"CoordinatorService": secured.address, "ShardService": shard}


def _state(cluster: LocalCluster) -> tuple:
    """What a refused call must leave as it was: runs, workers, shards."""
    with Client(cluster.address) as client:
        info = client.cluster()
        runs = client.runs()
    return (
        sorted((r.run_id, r.state) for r in runs),
        sorted((w.worker_id, w.name) for w in info.workers),
        sorted(info.shards),
    )


def test_every_rpc_is_placed_in_a_role():
    listed = {f"/{s.full_name}/{m.name}" for s, m in _every_rpc()}
    assert listed == set(access.RULES), "every RPC has exactly one rule"
    for service, names in ADMIN_RPCS.items():
        for name in names:
            rule = access.RULES[f"/gradps.v1.{service}/{name}"]
            assert rule.roles == {tokens.ADMIN}, name


def test_tokens_are_derived_from_the_secret_and_checked_in_full():
    secret = tokens.ClusterSecret("s" * 32)
    token = secret.token(tokens.ADMIN)
    assert secret.check(token) == tokens.Caller(tokens.ADMIN)
    assert secret.check(secret.token(tokens.WORKER, 7)) == tokens.Caller(tokens.WORKER, 7)
    last = token[-1]
    forged = token[:-1] + ("A" if last != "A" else "B")
    assert len(forged) == len(token) and secret.check(forged) is None
    assert tokens.ClusterSecret("t" * 32).check(token) is None
    # The subject is covered by the MAC: renaming the role of a valid token breaks it.
    assert secret.check(token.replace(".admin.", ".shard.")) is None
    for junk in ("", "gradps1", "gradps1.admin", "gradps1.worker-x.abc", "Bearer x", "é" * 50):
        assert secret.check(junk) is None
    with pytest.raises(ValueError, match="at least 16"):
        tokens.ClusterSecret("short")


def test_every_rpc_without_a_token_is_unauthenticated(secured, addresses):
    before = _state(secured)
    for service, method in _every_rpc():
        with grpc.insecure_channel(addresses[service.name]) as channel:
            details = _refused(grpc.StatusCode.UNAUTHENTICATED, _call, channel, service, method)
        assert "token" in details
    assert _state(secured) == before


def test_health_checks_need_no_token(addresses):
    for address in addresses.values():
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=_TIMEOUT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_worker_token_makes_no_admin_call(secured, addresses):
    before = _state(secured)
    plain = secured.role_token(tokens.WORKER)
    with grpc.insecure_channel(secured.address) as channel:
        _, call = coordinator_pb2_grpc.CoordinatorServiceStub(channel).JoinWorker.with_call(
            cpb.JoinWorkerRequest(name="auth-test"), metadata=[("authorization", f"Bearer {plain}")], timeout=10
        )
    own = dict(call.trailing_metadata())[tokens.WORKER_TOKEN_KEY]
    for token in (plain, own, secured.role_token(tokens.SHARD)):
        for service, method in _every_rpc():
            if method.name in ADMIN_RPCS[service.name]:
                with grpc.insecure_channel(addresses[service.name]) as channel:
                    details = _refused(grpc.StatusCode.PERMISSION_DENIED, _call, channel, service, method, token=token)
                assert token not in details
    after = _state(secured)
    assert after[0] == before[0] and after[2] == before[2]  # the join added a worker, nothing else


def test_a_worker_token_acts_only_as_its_own_worker(secured, addresses):
    plain = secured.role_token(tokens.WORKER)
    with grpc.insecure_channel(secured.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        as_plain = [("authorization", f"Bearer {plain}")]
        joined, call = stub.JoinWorker.with_call(cpb.JoinWorkerRequest(name="auth-own"), metadata=as_plain, timeout=10)
        me, other = joined.worker_id, joined.worker_id + 1
        own = dict(call.trailing_metadata())[tokens.WORKER_TOKEN_KEY]
        as_own = [("authorization", f"Bearer {own}")]
        # The plain worker token only joins.
        details = _refused(
            grpc.StatusCode.PERMISSION_DENIED,
            lambda: stub.Heartbeat(cpb.HeartbeatRequest(worker_id=me), metadata=as_plain, timeout=10),
        )
        assert "join first" in details
        assert not stub.Heartbeat(cpb.HeartbeatRequest(worker_id=me), metadata=as_own, timeout=10).rejoin
        details = _refused(
            grpc.StatusCode.PERMISSION_DENIED,
            lambda: stub.Heartbeat(cpb.HeartbeatRequest(worker_id=other), metadata=as_own, timeout=10),
        )
        assert f"acts as worker {me}, not as worker {other}" in details
        report = cpb.ReportMetricsRequest(run_id="no-such-run", metrics=cpb.Metrics(worker_id=other))
        _refused(grpc.StatusCode.PERMISSION_DENIED, lambda: stub.ReportMetrics(report, metadata=as_own, timeout=10))
        # No worker makes another leave.
        leave = cpb.LeaveWorkerRequest(worker_id=other)
        _refused(grpc.StatusCode.PERMISSION_DENIED, lambda: stub.LeaveWorker(leave, metadata=as_own, timeout=10))
    shard_service = shard_pb2.DESCRIPTOR.services_by_name["ShardService"]
    with grpc.insecure_channel(addresses["ShardService"]) as channel:
        for name, request in (
            ("Push", shard_pb2.PushRequest(run_id="no-such-run", worker_id=other, part_count=1)),
            ("OpenStream", shard_pb2.OpenStreamRequest(run_id="no-such-run", worker_id=other)),
            ("Pull", shard_pb2.PullRequest(run_id="no-such-run", worker_id=other)),
        ):
            method = shard_service.methods_by_name[name]
            _refused(grpc.StatusCode.PERMISSION_DENIED, _call, channel, shard_service, method, request, own)
            # As itself it passes the door: the shard answers about the run.
            request.worker_id = me
            _refused(grpc.StatusCode.NOT_FOUND, _call, channel, shard_service, method, request, own)


def test_a_token_the_secret_did_not_mint_is_refused(secured, addresses):
    admin = secured.role_token(tokens.ADMIN)
    assert admin is not None
    forged = admin[:-1] + ("A" if admin[-1] != "A" else "B")
    other_cluster = tokens.ClusterSecret("x" * 43).token(tokens.ADMIN)
    list_runs = cpb.DESCRIPTOR.services_by_name["CoordinatorService"].methods_by_name["ListRuns"]
    service = list_runs.containing_service
    with grpc.insecure_channel(addresses["CoordinatorService"]) as channel:
        for token in (forged, other_cluster, "", f"{admin} trailing"):
            details = _refused(grpc.StatusCode.UNAUTHENTICATED, _call, channel, service, list_runs, token=token)
            assert admin not in details
        assert _call(channel, service, list_runs, token=admin) is not None


def test_an_import_path_not_allowed_is_refused_at_submit(secured):
    with Client(secured.address) as client:
        before = client.runs()
        for field in ("dataset", "model"):
            spec = run_spec("sync", workers=1, steps=5, **{field: "os:kill"})
            with pytest.raises(GradpsError) as refused:
                client.submit(spec)
            message = str(refused.value)
            assert message.startswith("PERMISSION_DENIED: import path 'os:kill' is not allowed") and "\n" not in message
        assert client.runs() == before


def test_the_worker_refuses_an_import_path_on_its_own():
    name = "gradps_never_imported_module_for_auth_test"
    with pytest.raises(ImportRefused, match="not allowed"):
        load_dataset(f"{name}:build", allow_import=())
    assert name not in sys.modules
    assert import_allowed("mypkg.models:build", ["mypkg"]) and import_allowed("mypkg:build", ["mypkg."])
    assert not import_allowed("mypkgevil:build", ["mypkg"]) and not import_allowed("os:kill", ["gradps"])
    assert import_allowed("a.b:f", ["a.b:f"]) and not import_allowed("a.b:g", ["a.b:f"])


def test_a_run_with_tokens_completes_and_no_log_holds_a_secret(secured, tmp_path: Path):
    with Client(secured.address) as client:
        spec = run_spec("sync", workers=1, steps=20, model="tests.test_auth:tiny_model", eval_every=0)
        run_id = client.submit(spec)
        summary = follow(client, run_id, tmp_path, show_progress=False)
    assert summary["state"] == "completed", summary
    secrets = [secured.role_token(role) for role in tokens.ROLES]
    for log in secured.log_dir.glob("*.log"):
        text = log.read_text(errors="replace")
        assert not any(s and s in text for s in secrets), log
        assert "gradps1.worker-" not in text, log  # the workers' own tokens neither


def test_a_public_bind_without_a_secret_refuses_to_start():
    argv = [sys.executable, "-m", "ps_server.coordinator", "--port=0", "--bind=0.0.0.0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPS_")}
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2
    assert "refusing to serve on 0.0.0.0 without a cluster secret" in result.stderr
    assert "--insecure" in result.stderr


def test_this_users_other_commands_find_a_local_clusters_token(secured, tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPS_")}
    argv = [sys.executable, "-m", "client.cli", "runs", "--coordinator", secured.address]
    found = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert found.returncode == 0, found.stderr
    # Without the token store, nor any token: refused, in one line.
    empty = tmp_path / "no-tokens"
    refused = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, env={**env, "GRADPS_TOKEN_DIR": str(empty)}
    )
    assert refused.returncode != 0
    (line,) = refused.stderr.strip().splitlines()
    assert "UNAUTHENTICATED" in line and "GRADPS_TOKEN" in line, line


def test_a_worker_with_a_wrong_token_exits_with_one_line(secured):
    worker = secured.role_token(tokens.WORKER)
    assert worker is not None
    forged = worker[:-1] + ("A" if worker[-1] != "A" else "B")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPS_")} | {"GRADPS_TOKEN": forged}
    argv = [sys.executable, "-m", "gpu_worker.service", f"--coordinator={secured.address}", "--device=cpu"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"Error: coordinator {secured.address} refused to join: the token is not valid for this cluster"
    assert forged not in result.stderr


def test_the_cli_prints_a_role_token_from_the_secret():
    secret = "k" * 40
    result = CliRunner().invoke(cli, ["token", "worker"], env={"GRADPS_SECRET": secret})
    assert result.exit_code == 0, result.output
    assert tokens.ClusterSecret(secret).check(result.output.strip()) == tokens.Caller(tokens.WORKER)


# ---- a worker's own token touches its own runs only --------------------------------------------


@dataclass(frozen=True)
class _StandingRun:
    """A running run whose one worker this test plays (it registered the run's tensors and never
    pushes: the run stands still), and a joined worker that is not in it."""

    cluster: LocalCluster
    run_id: str
    shard: str
    part: shard_pb2.PartPlacement
    member: int
    member_token: str
    outsider: int
    outsider_token: str


def _join_as_worker(cluster: LocalCluster, name: str) -> tuple[int, str]:
    """Join with the plain worker token: (worker id, that worker's own token)."""
    plain = [("authorization", f"Bearer {cluster.role_token(tokens.WORKER)}")]
    with grpc.insecure_channel(cluster.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        joined, call = stub.JoinWorker.with_call(cpb.JoinWorkerRequest(name=name), metadata=plain, timeout=10)
    return joined.worker_id, dict(call.trailing_metadata())[tokens.WORKER_TOKEN_KEY]


def _as(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def _tensor_part(p: shard_pb2.PartPlacement, value: float) -> tensor_pb2.TensorPart:
    return tensor_pb2.TensorPart(
        name=p.name,
        index=p.index,
        offset=p.offset,
        count=p.count,
        dtype=tensor_pb2.DTYPE_FLOAT32,
        codec=tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_NONE),
        payload=np.full(p.count, value, np.float32).tobytes(),
    )


_SHARD_SERVICE = shard_pb2.DESCRIPTOR.services_by_name["ShardService"]


@pytest.fixture(scope="module")
def standing():
    with LocalCluster(shards=1, workers=0, heartbeat_timeout_s=120.0) as cluster:
        member, member_token = _join_as_worker(cluster, "member")
        with Client(cluster.address) as client:
            run_id = client.submit(run_spec("sync", workers=1, steps=1000, eval_every=0))
            (shard,) = client.cluster().shards
        with grpc.insecure_channel(cluster.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            poll = cpb.GetAssignmentRequest(worker_id=member, wait_ms=10_000)
            assert stub.GetAssignment(poll, metadata=_as(member_token), timeout=20).run_id == run_id
            tensors = tensor_specs({"w": torch.zeros(64)})
            asked = cpb.GetPlacementRequest(run_id=run_id, tensors=tensors, total_steps=1000, worker_id=member)
            placement = stub.GetPlacement(asked, metadata=_as(member_token), timeout=60).placement
        (part,) = placement.parts
        register = shard_pb2.RegisterTensorsRequest(run_id=run_id, part_count=1, part=_tensor_part(part, 1.0))
        with grpc.insecure_channel(shard) as channel:
            method = _SHARD_SERVICE.methods_by_name["RegisterTensors"]
            _call(channel, _SHARD_SERVICE, method, register, member_token)
        outsider, outsider_token = _join_as_worker(cluster, "outsider")  # after the run started: idle
        yield _StandingRun(cluster, run_id, shard, part, member, member_token, outsider, outsider_token)


def _standing_state(run: _StandingRun) -> tuple:
    """What no refused call may change: the run's status and placement, the cluster's workers, and
    the shard's counters and values of the run."""
    admin = run.cluster.role_token(tokens.ADMIN)
    with Client(run.cluster.address) as client:
        status = client.run(run.run_id).SerializeToString(deterministic=True)
        workers = sorted((w.worker_id, w.alive, w.run_id) for w in client.cluster().workers)
    with grpc.insecure_channel(run.shard) as channel:
        pull = shard_pb2.PullRequest(run_id=run.run_id, worker_id=run.member)
        values = _call(channel, _SHARD_SERVICE, _SHARD_SERVICE.methods_by_name["Pull"], pull, admin)
        stats_method = _SHARD_SERVICE.methods_by_name["GetStats"]
        stats = shard_pb2.GetStatsResponse.FromString(
            _call(channel, _SHARD_SERVICE, stats_method, shard_pb2.GetStatsRequest(run_id=run.run_id), admin)
        )
    stats.bytes_pulled = 0  # this function's own pull counts there
    return status, workers, values, stats.SerializeToString(deterministic=True)


def _worker_calls() -> list[tuple[Any, Any, access.Rule]]:
    """Every RPC a worker makes with its own token: (service, method, rule)."""
    found = []
    for service, method in _every_rpc():
        rule = access.RULES[f"/{service.full_name}/{method.name}"]
        if tokens.OWN_WORKER in rule.roles:
            found.append((service, method, rule))
    return found


def test_a_worker_token_touches_no_run_it_is_not_a_worker_of(standing):
    run, me = standing, standing.outsider
    before = _standing_state(run)
    grad = _tensor_part(run.part, 3e37)
    header = {"run_id": run.run_id, "worker_id": me, "part_count": 1, "part": grad}
    shard_requests = {
        "RegisterTensors": shard_pb2.RegisterTensorsRequest(
            run_id=run.run_id, part_count=1, overwrite=True, part=_tensor_part(run.part, 9.0)
        ),
        "Pull": shard_pb2.PullRequest(run_id=run.run_id, worker_id=me),
        "Push": shard_pb2.PushRequest(**header),
        "PushPull": shard_pb2.PushPullRequest(**header),
        "GroupAverage": shard_pb2.GroupAverageRequest(**header, members=[me]),
        "MapSegment": shard_pb2.MapSegmentRequest(run_id=run.run_id, worker_id=me, segment="gradps-outsider"),
        "OpenStream": shard_pb2.OpenStreamRequest(run_id=run.run_id, worker_id=me),
        "GetStats": shard_pb2.GetStatsRequest(run_id=run.run_id),
    }
    assert set(shard_requests) == {m.name for s, m, _ in _worker_calls() if s is _SHARD_SERVICE}
    with grpc.insecure_channel(run.shard) as channel:
        for name, request in shard_requests.items():
            method = _SHARD_SERVICE.methods_by_name[name]
            details = _refused(
                grpc.StatusCode.PERMISSION_DENIED, _call, channel, _SHARD_SERVICE, method, request, run.outsider_token
            )
            assert details == f"worker {me} is not a worker of run {run.run_id!r}", name
    with grpc.insecure_channel(run.cluster.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        mine = _as(run.outsider_token)
        # Another run's placement is neither read nor defined (the first caller's tensors define it).
        placement = cpb.GetPlacementRequest(
            run_id=run.run_id, tensors=tensor_specs({"x": torch.zeros(3)}), worker_id=me
        )
        details = _refused(
            grpc.StatusCode.PERMISSION_DENIED, lambda: stub.GetPlacement(placement, metadata=mine, timeout=10)
        )
        assert details == f"worker {me} is not a worker of run {run.run_id}"
        # Calls about its own standing in a run it is not in: told to abandon it, nothing more.
        beat = stub.Heartbeat(cpb.HeartbeatRequest(worker_id=me, run_id=run.run_id), metadata=mine, timeout=10)
        assert beat.stop and not beat.rejoin
        for report in (cpb.Metrics(worker_id=me, step=1000, done=True), cpb.Metrics(worker_id=me, error="poison")):
            answer = stub.ReportMetrics(
                cpb.ReportMetricsRequest(run_id=run.run_id, metrics=report), metadata=mine, timeout=10
            )
            assert answer.stop
        assert not stub.GetAssignment(
            cpb.GetAssignmentRequest(worker_id=me, wait_ms=1), metadata=mine, timeout=10
        ).run_id
        # The run's own worker passes the same doors.
        theirs = _as(run.member_token)
        beat = stub.Heartbeat(
            cpb.HeartbeatRequest(worker_id=run.member, run_id=run.run_id), metadata=theirs, timeout=10
        )
        assert not beat.stop
    with grpc.insecure_channel(run.shard) as channel:
        method = _SHARD_SERVICE.methods_by_name["GetStats"]
        stats = _call(channel, _SHARD_SERVICE, method, shard_pb2.GetStatsRequest(run_id=run.run_id), run.member_token)
        assert shard_pb2.GetStatsResponse.FromString(stats).parts == 1
    assert _standing_state(run) == before
    with Client(run.cluster.address) as client:
        assert client.run(run.run_id).run.state == cpb.RUN_STATE_RUNNING


def test_every_worker_call_naming_another_worker_is_refused(standing):
    run = standing
    before = _standing_state(run)
    addresses = {"CoordinatorService": run.cluster.address, "ShardService": run.shard}
    unbound = set()
    for service, method, rule in _worker_calls():
        if not rule.worker_field:
            unbound.add(method.name)
            continue
        request = GetMessageClass(method.input_type)()
        fields = request.DESCRIPTOR.fields_by_name
        if "run_id" in fields:
            request.run_id = run.run_id
        if "part_count" in fields:
            request.part_count = 1
        *outer, last = rule.worker_field
        target = request
        for number in outer:
            target = getattr(target, target.DESCRIPTOR.fields_by_number[number].name)
        setattr(target, target.DESCRIPTOR.fields_by_number[last].name, run.member)
        with grpc.insecure_channel(addresses[service.name]) as channel:
            details = _refused(
                grpc.StatusCode.PERMISSION_DENIED, _call, channel, service, method, request, run.outsider_token
            )
        assert details == f"this token acts as worker {run.outsider}, not as worker {run.member}", method.name
    # The calls that name no worker are bound to the caller's own runs by their handlers (above).
    assert unbound == {"GetPlacement", "RegisterTensors", "GetStats"}
    assert _standing_state(run) == before
