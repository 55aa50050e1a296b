"""The protobuf API as a contract: a worker in JavaScript (examples/node-worker, @grpc/grpc-js with
stock settings, written against the proto alone) trains asgd and sync runs with codecs none and
int8 against a real coordinator and shards at the default part size, and the run's export equals
its last pull bit for bit; its done report's weights digest is the proto's layout. Over mTLS with
the worker token too, where without its certificate it is refused."""

from __future__ import annotations

import base64
import json
import math
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from torch import nn

from client.local_cluster import LocalCluster
from client.sdk import Client
from gpu_worker.trainer import weights_digest
from gradps.auth.tokens import WORKER
from gradps.datasets import Dataset, load_dataset
from gradps.placement import DEFAULT_PART_SIZE, STOCK_MESSAGE_BYTES
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import coordinator_pb2_grpc, run_pb2, tensor_pb2
from tests.services import Services, until

ROOT = Path(__file__).resolve().parent.parent
WORKER_DIR = ROOT / "examples" / "node-worker"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(
    NODE is None or not (WORKER_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(),
    reason="needs node and examples/node-worker/node_modules (npm ci in examples/node-worker)",
)
# Long enough that a worker seen gone went by LeaveWorker, not by missed heartbeats.
HEARTBEAT_TIMEOUT_S = 60
STEPS = 12
# Outputs of the wide model's one layer: its weight is more than one default part.
WIDE_OUT = 17_000


def wide(dataset: Dataset) -> nn.Module:
    """A model by import path (the cluster allows tests.test_node_worker): one linear layer whose
    weight takes two default parts, the first a full one, so a pull and an export of it carry a
    message as large as the default part size makes them."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(dataset.input_shape), WIDE_OUT))


def _tensors_of(model: nn.Module) -> list[dict]:
    return [{"name": name, "shape": list(p.shape)} for name, p in model.named_parameters()]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Services]:
    services = Services(
        tmp_path_factory.mktemp("node"),
        f"--heartbeat-timeout={HEARTBEAT_TIMEOUT_S}",
        "--allow-import=tests.test_node_worker",
    )
    try:
        services.start_coordinator()
        services.add_shard()
        services.add_shard()
        yield services
    finally:
        services.stop()


def _start_worker(
    address: str, codec: str, tensors: list[dict] | None, out: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """A node worker joining `address`, with the token and TLS of `env` alone (GRADPS_TOKEN, GRADPS_TLS_*)."""
    args = [str(NODE), str(WORKER_DIR / "worker.js"), "--coordinator", address, "--codec", codec, "--out", str(out)]
    if tensors is not None:
        args += ["--tensors", json.dumps(tensors)]
    log = open(out.with_suffix(".log"), "wb")
    own = {k: v for k, v in os.environ.items() if not k.startswith(("GRADPS_TOKEN", "GRADPS_TLS_"))}
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**own, **(env or {})})


def _pulled(out: Path, run_id: str) -> dict[str, torch.Tensor]:
    written = json.loads(out.read_text())
    assert written["run_id"] == run_id
    return {
        name: torch.from_numpy(
            np.frombuffer(base64.b64decode(t["float32_le_base64"]), dtype="<f4").reshape(t["shape"]).copy()
        )
        for name, t in written["tensors"].items()
    }


CASES = [
    # asgd with one worker: its last pull is the final model; the built-in mlp's documented tensors.
    pytest.param("asgd", tensor_pb2.CODEC_NONE, 1, "mlp", id="asgd-none-mlp"),
    pytest.param("asgd", tensor_pb2.CODEC_INT8, 1, "mlp", id="asgd-int8-mlp"),
    # sync with two: both pull the final model; a weight of more than one default part.
    pytest.param("sync", tensor_pb2.CODEC_NONE, 2, "wide", id="sync-none-wide"),
    pytest.param("sync", tensor_pb2.CODEC_INT8, 2, "wide", id="sync-int8-wide"),
]


@pytest.mark.parametrize(("scheme", "codec", "workers", "model"), CASES)
def test_a_node_worker_trains_and_the_export_is_its_last_pull(cluster, tmp_path, scheme, codec, workers, model):
    run_id, exported, largest = _train_and_compare(cluster.address, tmp_path, scheme, codec, workers, model)
    # A stock client (gRPC's 4 MiB receive limit) exports the run too: every message fits.
    assert largest + 1024 < STOCK_MESSAGE_BYTES
    with grpc.insecure_channel(cluster.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        parts = list(stub.ExportRun(cpb.ExportRunRequest(run_id=run_id), timeout=60))
    assert sum(r.part.count for r in parts) == sum(t.numel() for t in exported.values())


@pytest.fixture(scope="module")
def mtls_cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    """A local cluster with a secret, whose every port serves TLS and asks for a client certificate
    of its own CA (mTLS); no workers of its own."""
    logs = tmp_path_factory.mktemp("node-mtls")
    with LocalCluster(1, 0, HEARTBEAT_TIMEOUT_S, logs, tls_certs=True, tls_client_auth=True) as cluster:
        yield cluster


def test_a_node_worker_trains_over_mtls_with_the_worker_token(mtls_cluster, tmp_path):
    assert mtls_cluster.client_tls is not None
    tls_env = mtls_cluster.client_tls.client_env()
    token = mtls_cluster.role_token(WORKER)
    assert token is not None and tls_env.keys() == {"GRADPS_TLS_CA", "GRADPS_TLS_CERT", "GRADPS_TLS_KEY"}
    # The same worker without its certificate, or in plaintext, is refused in one line.
    for without in (["GRADPS_TLS_CERT", "GRADPS_TLS_KEY"], list(tls_env)):
        env = {"GRADPS_TOKEN": token, **{k: v for k, v in tls_env.items() if k not in without}}
        out = tmp_path / f"refused-{len(without)}.json"
        refused = _start_worker(mtls_cluster.address, "none", None, out, env)
        assert refused.wait(timeout=60) == 1
        lines = out.with_suffix(".log").read_text().strip().splitlines()
        assert len(lines) == 1 and "failed: UNAVAILABLE" in lines[0], lines
    _train_and_compare(
        mtls_cluster.address, tmp_path, "asgd", tensor_pb2.CODEC_INT8, 1, "mlp", {"GRADPS_TOKEN": token, **tls_env}
    )


def _train_and_compare(
    address: str,
    tmp_path: Path,
    scheme: str,
    codec: int,
    workers: int,
    model: str,
    env: dict[str, str] | None = None,
) -> tuple[str, dict[str, torch.Tensor], int]:
    """`workers` node workers (environment `env`) train one run at `address` to completion; their
    last pulls are its export bit for bit. The run's id, its export and its largest part in bytes."""
    codec_name = tensor_pb2.Codec.Name(codec).removeprefix("CODEC_").lower()
    tensors = _tensors_of(wide(load_dataset("digits", 0, 0))) if model == "wide" else None
    outs = [tmp_path / f"worker-{i}.json" for i in range(workers)]
    nodes = [_start_worker(address, codec_name, tensors, out, env) for out in outs]
    try:
        with Client(address) as client:
            until(
                lambda: sum(w.alive for w in client.cluster().workers) >= workers, 30, "the node workers never joined"
            )
            # Only what the run is about: part_size and everything else as the coordinator's defaults.
            spec = run_pb2.RunSpec(
                model="tests.test_node_worker:wide" if model == "wide" else "mlp",
                scheme=scheme,
                workers=workers,
                steps=STEPS,
                seed=7,
                eval_every=0,
                optimizer=run_pb2.OptimizerSpec(lr=0.1),
                codec=tensor_pb2.CodecParams(codec=codec),
            )
            run_id = client.submit(spec)
            for node, out in zip(nodes, outs, strict=True):
                rc = node.wait(timeout=180)
                assert rc == 0, out.with_suffix(".log").read_text()[-3000:]
            got = client.run(run_id)
            assert got.run.state == cpb.RUN_STATE_COMPLETED, got.run
            assert got.run.spec.part_size == DEFAULT_PART_SIZE
            largest = max(4 * p.count for p in got.placement.parts)
            assert largest == (DEFAULT_PART_SIZE if model == "wide" else 128 * 64 * 4)
            # They left at once: gone from the live pool well before the heartbeat timeout.
            ids = set(got.run.workers)
            assert not any(w.alive for w in client.cluster().workers if w.worker_id in ids)

            exported = client.export_state_dict(run_id)
            for out in outs:
                pulled = _pulled(out, run_id)
                assert pulled.keys() == exported.keys()
                for name, values in exported.items():
                    assert torch.equal(pulled[name], values), name  # bit for bit
            done = [m for m in got.run.latest if m.done]
            assert len(done) == workers and all(m.step == STEPS for m in done)
            assert {m.weights_digest for m in done} == {weights_digest(exported)}
            assert all(m.pushes >= STEPS for m in done) and all(m.loss > 0 for m in done)
        return run_id, exported, largest
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
