"""Bearer tokens and roles (gradps/auth/) against a real local cluster, and the import allow-list.

Every RPC of every service, listed from the proto descriptors, is refused without a token, and every
admin RPC with a worker's; a worker's own token acts only as its own worker id; a token of the right
shape that the cluster's secret did not mint is refused; a run naming an import path the operator
did not allow is refused at submit; a normal run with tokens completes, and no log holds a secret.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
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
from gradps.datasets import Dataset, ImportRefused, import_allowed, load_dataset
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
        "DeleteRun",
        "WatchRun",
        "GetCluster",
        "ExportRun",
    },
    "ShardService": {"OpenRun", "CloseRun", "EndRun", "SetMembership"},
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
