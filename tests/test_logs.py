"""`--log-format json` (GRADPS_LOG_FORMAT): every line of every service of a real local cluster is
one JSON object, and the lines about a run or a worker carry its id as a field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from client.local_cluster import LocalCluster
from client.report import follow
from client.sdk import Client
from gradps.v1 import run_pb2


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
