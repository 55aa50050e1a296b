"""A run seen the way operators see it: a real Prometheus scrapes a real local cluster, and what
PromQL says about the run agrees with the run's own summary. Also: a service's /metrics endpoint
by itself, the Grafana dashboard's queries and the Kubernetes scrape annotations."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from client.local_cluster import LocalCluster
from client.report import follow
from client.sdk import Client, GradpsError
from gradps.metrics import RUN_STATES, series_names
from gradps.v1 import run_pb2
from tests.services import free_ports

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "docker" / "grafana" / "gradps-dashboard.json"
_LOCALHOST = "127.0.0.1"
_SHARDS, _WORKERS, _STEPS = 2, 2, 30


def _get(url: str, timeout_s: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read()


def _wait_for(ready: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _config(targets: dict[str, str]) -> dict:
    """One job per service kind, scraped every second (the run is short)."""
    jobs: dict[str, list[str]] = {}
    for name, address in targets.items():
        jobs.setdefault(f"gradps-{name.split('-')[0]}", []).append(address)
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": sorted(addresses)}]} for job, addresses in jobs.items()
        ],
    }


class Prometheus:
    """A Prometheus server on loopback and its HTTP API."""

    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict]:
        """An instant query's result vector; fails on a query Prometheus refuses."""
        body = json.loads(_get(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        """The value of a query that yields one series (None when it yields none)."""
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return float(result[0]["value"][1]) if result else None

    def names(self) -> set[str]:
        body = json.loads(_get(f"{self.url}/api/v1/label/__name__/values"))
        return set(body["data"])


@contextmanager
def _prometheus(binary: str, folder: Path, targets: dict[str, str]) -> Iterator[Prometheus]:
    folder.mkdir()
    config = folder / "prometheus.yml"
    config.write_text(yaml.safe_dump(_config(targets)))
    url = f"http://{_LOCALHOST}:{free_ports(1)[0]}"
    argv = [
        binary,
        f"--config.file={config}",
        f"--storage.tsdb.path={folder / 'data'}",
        f"--web.listen-address={url.removeprefix('http://')}",
        "--log.level=warn",
    ]
    log = folder / "prometheus.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def ready() -> bool:
        assert process.poll() is None, f"prometheus exited: {log.read_text(errors='replace')[-2000:]}"
        try:
            return _get(f"{url}/-/ready", timeout_s=1.0).startswith(b"Prometheus")
        except OSError:
            return False

    try:
        _wait_for(ready, "prometheus to be ready")
        yield Prometheus(url)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _spec() -> run_pb2.RunSpec:
    return run_pb2.RunSpec(
        scheme="sync",
        workers=_WORKERS,
        batch_size=32,
        steps=_STEPS,
        eval_every=0,
        optimizer=run_pb2.OptimizerSpec(name="sgd", lr=0.1),
    )


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_prometheus_scrapes_a_run_and_agrees_with_its_summary(tmp_path: Path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not found (Debian: apt-get install prometheus; .ci/run installs it)")
    with (
        LocalCluster(shards=_SHARDS, workers=_WORKERS, heartbeat_timeout_s=2.0, metrics=True) as cluster,
        Client(cluster.address) as client,
    ):
        targets = cluster.metrics_targets()
        assert sorted(targets) == ["coordinator", "shard-0", "shard-1", "worker-0", "worker-1"]
        assert all(address.startswith(f"{_LOCALHOST}:") for address in targets.values())
        with _prometheus(binary, tmp_path / "prometheus", targets) as prom:
            _wait_for(lambda: prom.value("count(up == 1)") == len(targets), "every target up")
            with pytest.raises(GradpsError, match="NOT_FOUND"):  # one refusal, to be counted by its code
                client.run("no-such-run")
            run_id = client.submit(_spec())
            summary = follow(client, run_id, tmp_path / run_id, show_progress=False)
            run = client.run(run_id)
            ended = time.time()
            # Every target scraped once more after the run: its last counts are in.
            _wait_for(lambda: (prom.value("min(timestamp(up))") or 0) > ended, "a scrape after the run")
            latest = list(run.run.latest)
            # A push is one call to each shard that holds parts of the run (a small model may fit one).
            calls = len({p.shard for p in run.placement.parts}) * sum(m.pushes for m in latest)
            _check_against_summary(prom, summary, latest, calls)
            _check_grpc_series(prom, calls)
            _check_names_and_dashboard(prom)


def _check_against_summary(prom: Prometheus, summary: dict, latest: list, calls: int) -> None:
    assert summary["state"] == "completed", summary
    pushes = sum(m.pushes for m in latest)
    assert summary["steps"] == _STEPS and pushes == _WORKERS * _STEPS, (summary, pushes)

    def total(series: str) -> float | None:
        return prom.value(f"sum({series})")

    figures = {
        # What the workers report (the summary's own numbers) ...
        "gradps_worker_pushed_bytes_total": summary["bytes_pushed"],
        "gradps_worker_pulled_bytes_total": summary["bytes_pulled"],
        # ... and what the shards counted: sync with codec none applies every push once, whole.
        "gradps_shard_pushed_bytes_total": summary["bytes_pushed"],
        "gradps_shard_pulled_bytes_total": summary["bytes_pulled"],
        "gradps_worker_steps_total": _WORKERS * summary["steps"],
        "gradps_worker_step_seconds_count": _WORKERS * summary["steps"],
        "gradps_worker_wait_seconds_count": _WORKERS * summary["steps"],
        "gradps_worker_samples_total": sum(m.samples for m in latest),
        # Each push applied by each shard it reaches; none is stale in sync.
        "gradps_shard_push_staleness_count": calls,
        "gradps_shard_push_staleness_sum": summary["max_staleness"],
        "gradps_shard_push_seconds_count": calls,
    }
    measured = {series: total(series) for series in figures}
    for series, expected in figures.items():  # `pytest -s` shows them side by side
        print(f"{series}: PromQL {measured[series]!r}, summary.json {expected!r}")
    assert measured == pytest.approx(figures), measured
    assert summary["bytes_pushed"] > 0
    # Labels say where the bytes went: codec none, shared memory (the local cluster's default).
    by_labels = prom.query("sum by (codec, transport) (gradps_shard_pushed_bytes_total)")
    assert [r["metric"] for r in by_labels] == [{"codec": "none", "transport": "shm"}]
    # Wait is part of each step.
    assert 0 < total("gradps_worker_wait_seconds_sum") < total("gradps_worker_step_seconds_sum")
    assert prom.value("gradps_coordinator_live_workers") == summary["workers"] == _WORKERS
    assert prom.value("gradps_coordinator_live_shards") == summary["shards"] == _SHARDS
    runs = {r["metric"]["state"]: float(r["value"][1]) for r in prom.query("gradps_coordinator_runs")}
    assert runs == {state: float(state == "completed") for state in RUN_STATES}


def _check_grpc_series(prom: Prometheus, calls: int) -> None:
    def total(series: str) -> float | None:
        return prom.value(f"sum({series})")

    push_pull = 'method="gradps.v1.ShardService/PushPull"'
    assert total(f'gradps_grpc_server_handled_total{{{push_pull}, code="OK"}}') == calls
    assert total(f"gradps_grpc_server_handling_seconds_count{{{push_pull}}}") == calls
    # Each push streams at least one message in, and its answer at least one out.
    assert total(f"gradps_grpc_server_msg_received_total{{{push_pull}}}") >= calls
    assert total(f"gradps_grpc_server_msg_sent_total{{{push_pull}}}") >= calls
    # Every call started on a shard ends (the coordinator's EndRun may still be on its way).
    shard = '{job="gradps-shard"}'
    in_flight = f"sum(gradps_grpc_server_started_total{shard}) - sum(gradps_grpc_server_handled_total{shard})"
    _wait_for(lambda: prom.value(in_flight) == 0, "every call started on a shard to end")
    assert total(f"gradps_grpc_server_handled_total{shard}") > calls
    # The one refused call, under its status code.
    refused = prom.query('gradps_grpc_server_handled_total{code!~"OK|CANCELLED|DEADLINE_EXCEEDED"}')
    assert [(r["metric"]["method"], r["metric"]["code"], r["value"][1]) for r in refused] == [
        ("gradps.v1.CoordinatorService/GetRun", "NOT_FOUND", "1")
    ]


def _check_names_and_dashboard(prom: Prometheus) -> None:
    exported = {name for name in prom.names() if name.startswith("gradps_")}
    assert exported <= series_names(), f"series defined outside gradps.metrics: {exported - series_names()}"
    # Everything a sync run touches (wagma's rounds are the only series it leaves empty).
    assert series_names() - exported == {f"gradps_shard_round_seconds{s}" for s in ("_bucket", "_sum", "_count")}
    for expr in _dashboard_queries():  # every panel's query is one Prometheus accepts
        prom.query(expr.replace("$__rate_interval", "1m"))


def _names_in(expr: str) -> set[str]:
    return set(re.findall(r"\b(gradps_[a-z0-9_]+)\b", expr))


def test_the_dashboard_queries_only_series_the_services_export():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {"Throughput", "Step time", "Wait", "Staleness", "Bytes by codec", "Live workers"} <= titles
    used = set().union(*(_names_in(expr) for expr in _dashboard_queries()))
    assert used, "the dashboard queries no gradps series"
    assert used <= series_names(), f"not exported by any service: {sorted(used - series_names())}"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", f"{panel['title']}: pick the datasource at import"


def test_k8s_pods_are_annotated_with_the_port_their_service_serves_metrics_on():
    from tests.test_k8s import K8S, _container, _render, _workloads

    for name, workload in _workloads(_render(K8S)).items():
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        env = {e["name"]: e.get("value") for e in _container(workload)["env"]}
        assert annotations["prometheus.io/scrape"] == "true", name
        assert annotations["prometheus.io/port"] == env["GRADPS_METRICS_PORT"], name
        assert annotations["prometheus.io/path"] == "/metrics", name
        assert env["GRADPS_METRICS_HOST"] in ("::", "0.0.0.0"), f"{name}: Prometheus scrapes the pod's IP"


def _coordinator(tmp_path: Path, name: str, *metrics_args: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "ps_server.coordinator", "--port=0", f"--port-file={tmp_path / name}.port"]
    with open(tmp_path / f"{name}.log", "wb") as log:
        return subprocess.Popen([*argv, *metrics_args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _read_port(path: Path, process: subprocess.Popen) -> int:
    _wait_for(lambda: path.exists() or process.poll() is not None, f"{path.name}")
    assert process.poll() is None, "the service exited at start-up"
    return int(path.read_text())


def test_a_service_serves_metrics_on_a_free_port_and_refuses_a_taken_one(tmp_path: Path):
    port_file = tmp_path / "metrics.port"
    first = _coordinator(
        tmp_path, "first", "--metrics-port=0", f"--metrics-host={_LOCALHOST}", f"--metrics-port-file={port_file}"
    )
    second = None
    try:
        port = _read_port(port_file, first)
        _read_port(tmp_path / "first.port", first)  # serving gRPC too
        text = _get(f"http://{_LOCALHOST}:{port}/metrics").decode()
        families = {family.name: family for family in text_string_to_metric_families(text)}
        assert families["gradps_coordinator_live_workers"].samples[0].value == 0
        states = {s.labels["state"]: s.value for s in families["gradps_coordinator_runs"].samples}
        assert states == dict.fromkeys(RUN_STATES, 0)
        # The same port again: the second coordinator says so and exits, before serving anything.
        second = _coordinator(tmp_path, "second", f"--metrics-port={port}", f"--metrics-host={_LOCALHOST}")
        assert second.wait(timeout=60) == 2
        log = (tmp_path / "second.log").read_text()
        assert f"--metrics-port {port}" in log and not (tmp_path / "second.port").exists(), log
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(timeout=60)
