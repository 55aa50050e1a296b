"""The worker service as a process: it outlives its coordinator and leaves cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from client.sdk import Client
from gpu_worker.service import _failure


def _spawn(tmp_path: Path, name: str, module: str, *args: str) -> subprocess.Popen:
    log = open(tmp_path / f"{name}.log", "ab")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", module, *args], stdout=log, stderr=subprocess.STDOUT, env=env)


def _coordinator(tmp_path: Path, port: int = 0) -> tuple[subprocess.Popen, int]:
    port_file = tmp_path / "port"
    port_file.unlink(missing_ok=True)
    args = ("--port", str(port), "--port-file", str(port_file))
    process = _spawn(tmp_path, "coordinator", "ps_server.coordinator", *args)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        assert process.poll() is None and time.monotonic() < deadline, "coordinator did not start"
        time.sleep(0.05)
    return process, int(port_file.read_text())


def _live_workers(address: str) -> list[str]:
    with Client(address) as client:
        return [w.name for w in client.cluster().workers if w.alive]


def _wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_worker_waits_out_a_coordinator_restart_and_stops_cleanly(tmp_path: Path):
    coordinator, port = _coordinator(tmp_path)
    address = f"127.0.0.1:{port}"
    worker = _spawn(tmp_path, "worker", "gpu_worker.service", "--coordinator", address, "--name", "w0")
    try:
        _wait_for(lambda: _live_workers(address) == ["w0"], "the worker did not join")
        coordinator.kill()
        coordinator.wait()
        time.sleep(3)  # several of the worker's 1 s long polls fail meanwhile
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-2000:]

        coordinator, _ = _coordinator(tmp_path, port)  # same address, no memory of the worker
        _wait_for(lambda: _live_workers(address) == ["w0"], "the worker did not rejoin the new coordinator")

        coordinator.kill()  # and a SIGTERM while the coordinator is gone still exits cleanly
        coordinator.wait()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, (tmp_path / "worker.log").read_text()[-2000:]
        assert "Traceback" not in (tmp_path / "worker.log").read_text()
    finally:
        for process in (worker, coordinator):
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.mark.slow
def test_each_worker_moves_payloads_the_way_it_was_told(tmp_path: Path):
    from client.local_cluster import LocalCluster
    from gradps.v1 import coordinator_pb2 as cpb
    from gradps.v1 import run_pb2

    transports = ("shm", "stream", "grpc")
    with LocalCluster(shards=2, workers=0) as cluster:
        workers = [
            _spawn(
                tmp_path,
                name,
                "gpu_worker.service",
                "--coordinator",
                cluster.address,
                "--name",
                name,
                "--transport",
                name,
            )
            for name in transports
        ]
        try:
            # Small parts, so that the small model is spread over both shards.
            spec = run_pb2.RunSpec(scheme="sync", workers=3, steps=5, eval_every=0, part_size=4096)
            with Client(cluster.address) as client:
                client.wait_for_cluster(shards=2, workers=3)
                run_id = client.submit(spec)
                for update in client.watch(run_id):
                    if update.run.state not in (cpb.RUN_STATE_PENDING, cpb.RUN_STATE_RUNNING):
                        break
                assert update.run.state == cpb.RUN_STATE_COMPLETED, update.run.message
        finally:
            for worker in workers:
                worker.send_signal(signal.SIGTERM)
                worker.wait(timeout=30)
    shm, stream, grpc = ((tmp_path / f"{name}.log").read_text() for name in transports)
    assert "to shards [0, 1] through shared memory, to [] on data streams, to [] inline" in shm, shm[-2000:]
    assert "to shards [] through shared memory, to [0, 1] on data streams, to [] inline" in stream, stream[-2000:]
    assert "to shards [] through shared memory, to [] on data streams, to [0, 1] inline" in grpc, grpc[-2000:]
    for log in (shm, stream, grpc):
        assert "Traceback" not in log and "payloads inline for now" not in log, log[-2000:]


class _Unreachable(grpc.RpcError):
    """What grpcio raises for a shard that went away: str() is a multi-line dump of the call."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "failed to connect to all addresses"

    def __str__(self) -> str:
        return "<_InactiveRpcError of RPC that terminated with:\n\tstatus = StatusCode.UNAVAILABLE\n>"


def test_a_failed_run_is_reported_in_one_line():
    assert _failure(_Unreachable()).error == "UNAVAILABLE: failed to connect to all addresses"
    assert _failure(ValueError("no such\nmodel")).error == "ValueError: no such model"
