"""`--log-format json` (GRADPS_LOG_FORMAT): every line of every service of a real local cluster is
one JSON object, and the lines about a run or a worker carry its id as a field; SIGUSR1 writes a
service's thread stacks to its log."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.local_cluster import LocalCluster
from client.report import follow
from client.sdk import Client
from gradps.v1 import run_pb2
from tests.services import Services, until


def test_every_service_logs_json_lines_with_run_and_worker_ids(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("GRADPS_LOG_FORMAT", "json")
    monkeypatch.setenv("GRADPS_LOG_LEVEL", "INFO")
    logs = tmp_path / "logs"
    spec = run_pb2.RunSpec(scheme="asgd", workers=2, batch_size=32, steps=20, eval_every=0)
    with LocalCluster(shards=1, workers=2, log_dir=logs) as cluster, Client(cluster.address) as client:
        run_id = client.submit(spec)
        assert follow(client, run_id, tmp_path / "run", show_progress=False)["state"] == "completed"
        workers = {w.worker_id for w in client.cluster().workers}

    lines: dict[str, list[dict]] = {}
    for path in sorted(logs.glob("*.log")):
        text = path.read_text().splitlines()
        assert text, f"{path.name} is empty"
        lines[path.stem] = [json.loads(line) for line in text]  # every line parses, or this fails
    services = {line["service"] for rows in lines.values() for line in rows}
    assert services == {"coordinator", "shard", "worker"}, services
    for rows in lines.values():
        for line in rows:
            assert {"time", "level", "service", "logger", "message"} <= line.keys(), line
            assert line["time"].endswith("Z") and line["level"] in ("INFO", "WARNING", "ERROR", "DEBUG")

    everything = [line for rows in lines.values() for line in rows]
    about_run = [line for line in everything if run_id in line["message"]]
    assert about_run and all(line.get("run_id") == run_id for line in about_run), about_run
    # Each worker's lines of the run name the worker; the coordinator's joins name them too.
    worker_lines = [line for line in everything if line["service"] == "worker" and line.get("run_id") == run_id]
    assert {line["worker_id"] for line in worker_lines} == workers
    joins = [line for line in everything if line["service"] == "coordinator" and "joined" in line["message"]]
    assert {line["worker_id"] for line in joins} == workers
    shard_lines = [line for line in everything if line["service"] == "shard" and line.get("run_id") == run_id]
    assert shard_lines and all(line["shard_index"] == 0 for line in shard_lines)


@pytest.mark.parametrize("service", ["ps_server.coordinator", "ps_server.shard", "gpu_worker.service"])
def test_an_unknown_log_format_is_a_one_line_usage_error(service: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", service, "--log-format", "xml"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "'--log-format' (env var: 'GRADPS_LOG_FORMAT'): 'xml' is not one of 'text', 'json'." in done.stderr


def test_sigusr1_writes_every_threads_stack_to_the_log_and_the_service_goes_on(tmp_path: Path) -> None:
    services = Services(tmp_path)
    try:
        services.start_coordinator()
        services.add_shard()
        processes = {"coordinator": services.coordinator, "shard-0": services.shards[0]}
        for name, process in processes.items():
            assert process is not None
            process.send_signal(signal.SIGUSR1)
            log = tmp_path / f"{name}.log"
            until(lambda log=log: "run_forever" in log.read_text(), 30, f"no stacks in {log}")  # the loop's thread
            text = log.read_text()
            assert "Thread 0x" in text, text
            assert "serve_until_signal" in text, text  # the main thread, waiting for its stop signal
            with grpc.insecure_channel(
                services.address if name == "coordinator" else f"127.0.0.1:{services.shard_ports[0]}"
            ) as channel:
                answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            assert process.poll() is None
    finally:
        services.stop()
