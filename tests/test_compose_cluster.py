"""docker-compose.yml for real: its images built and its services run as containers, with Debian's
podman standing in for a Docker engine (rootful; Docker Compose v2 talks to `podman system service`).

Nothing is fetched inside a build: the base image is made from Debian's packages
(docker/debian-base.sh), the wheels are downloaded on the host into docker/wheelhouse/ and the
images install them with `--no-index` and no network. Then the cluster comes up (`up --wait`, the
health checks run by this module: there is no systemd to time them), trains a short sync and an
asgd run from the host, which must reach the accuracy that a local cluster reaches with the same
settings, exports a model, and goes down. The secured cluster (docker-compose.tls.yml) then has a
shard container restarted mid-run: it takes the run back from the checkpoint on its state volume,
the run goes on to complete, and the cluster trains again. Afterwards no container, network,
volume, mount or process of the test is left. Skipped (one line) where podman is missing or cannot run: it needs root.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from tests.images import BASE, IN_CI, ROOT, TLS_OVERRIDE, docker_compose, gradps_services, load_yaml, tool_missing

pytestmark = [pytest.mark.containers, pytest.mark.timeout(1800)]

PROJECT = "gradps-smoke"  # compose project: its containers, network and volumes are named after it
BASE_IMAGE = "python:3.11-slim-bookworm"
WHEELHOUSE = ROOT / "docker" / "wheelhouse"
COORDINATOR = "127.0.0.1:50051"  # docker-compose.yml publishes it on the host's loopback
PACKAGES = "podman runc catatonit netavark aardvark-dns iptables mmdebstrap"
# What each run trains: short, and the same on the compose cluster and on the local one.
RUN_ARGS = ["--steps", "300", "--eval-every", "0", "--seed", "0", "--no-progress"]
# How far the compose cluster's accuracy may be from the local cluster's: sync is deterministic
# up to float summation order; asgd's interleaving of pushes differs from run to run, the more so
# on a busy host (0.911 against 0.967 with one busy loop per core beside the suite).
TOLERANCE = {"sync": 0.02, "asgd": 0.1}

_UP_TIMEOUT = timedelta(minutes=5)  # `up --wait`: torch imports on a busy 2-core host
_BUILD_TIMEOUT = timedelta(minutes=15)
_RUN_TIMEOUT = timedelta(minutes=5)
_HEALTH_EVERY = timedelta(seconds=2)
_RESOLVE_AGAIN = timedelta(seconds=90)  # gRPC's 30 s between DNS resolutions, and its reconnect backoff


def _hard_limit(kind: int, cap: int) -> int:
    hard = resource.getrlimit(kind)[1]
    return cap if hard == resource.RLIM_INFINITY else min(hard, cap)


def containers_conf() -> str:
    """podman's settings for a host without systemd and with hybrid cgroups: runc (crun refuses
    them), cgroupfs, events in a file, and ulimits within this host's hard limits (podman's
    defaults are above them, and the runtime's setrlimit would fail)."""
    nofile = _hard_limit(resource.RLIMIT_NOFILE, 1 << 20)
    nproc = _hard_limit(resource.RLIMIT_NPROC, 32768)
    init = '\ninit_path = "/usr/bin/catatonit"' if Path("/usr/bin/catatonit").exists() else ""
    return f"""[containers]
default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]{init}

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"

[network]
network_backend = "netavark"
"""


def _mounts() -> set[str]:
    return set(Path("/proc/mounts").read_text().splitlines())


def _mount_point(line: str) -> str:
    return line.split()[1].replace("\\040", " ")


def _podmans(point: str) -> bool:
    """Whether podman made a mount there: its storage and run folders, its network namespaces, and
    the /run/netns bind mount that holds them (unless other namespaces are in it)."""
    if point.startswith(("/var/lib/containers/", "/run/containers/", "/run/libpod/", "/run/netns/netns-")):
        return True
    return point == "/run/netns" and not any(Path(point).iterdir())


def _new_podman_mounts(before: set[str]) -> list[str]:
    """Mounts podman made since `before`, innermost first."""
    points = [_mount_point(line) for line in _mounts() - before]
    return sorted((p for p in points if _podmans(p)), key=len, reverse=True)


def _podman_processes() -> dict[int, str]:
    """conmon, aardvark-dns and podman processes (pid -> command line): what a container or a
    network may leave running."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            name, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2]
            if name in ("conmon", "aardvark-dns", "podman", "catatonit") and state != "Z":  # a zombie has exited
                found[int(entry.name)] = command.strip()
    return found


class Podman:
    """Rootful podman with this module's settings, its API socket for Docker Compose, and the
    health checks that systemd would otherwise time."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.socket = workdir / "podman.sock"
        conf = workdir / "containers.conf"
        conf.write_text(containers_conf())
        self.env = {
            **os.environ,
            "CONTAINERS_CONF": str(conf),
            "DOCKER_HOST": f"unix://{self.socket}",
            # Compose's own builder would fetch moby/buildkit from a registry; the images are built
            # with podman beforehand anyway.
            "DOCKER_BUILDKIT": "0",
            "COMPOSE_BAKE": "false",
        }
        self.service: subprocess.Popen | None = None
        self.stray: dict[int, str] = {}  # what `stop` found still running, and ended
        self._stop_health = threading.Event()
        self._health: threading.Thread | None = None
        self.mounts_before = _mounts()
        self.processes_before = _podman_processes()

    def run(self, *args: str, timeout: timedelta = timedelta(minutes=2), check: bool = True) -> str:
        result = subprocess.run(
            ["podman", *args], env=self.env, capture_output=True, text=True, timeout=timeout.total_seconds()
        )
        if check and result.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)}: exit {result.returncode}\n{result.stderr[-4000:]}")
        return result.stdout

    def start_service(self) -> None:
        log = open(self.workdir / "podman-service.log", "wb")
        self.service = subprocess.Popen(
            ["podman", "system", "service", "--time=0", f"unix://{self.socket}"],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while True:
            assert self.service.poll() is None, (self.workdir / "podman-service.log").read_text()
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(self.socket))
                return
            except OSError:
                assert time.monotonic() < deadline, "podman system service did not open its socket"
                time.sleep(0.2)

    def _run_health_checks(self) -> None:
        while not self._stop_health.wait(_HEALTH_EVERY.total_seconds()):
            try:
                for container in self.run("ps", "-q", "--filter", _label(), check=False).split():
                    self.run("healthcheck", "run", container, timeout=timedelta(seconds=30), check=False)
            except subprocess.TimeoutExpired:  # a check that hangs counts as failed; the next round goes on
                pass

    def start_health_checks(self) -> None:
        self._health = threading.Thread(target=self._run_health_checks, name="healthchecks", daemon=True)
        self._health.start()

    def stop(self) -> None:
        """The health checks and the API service; then the mounts podman made (its storage's
        private bind mount, /run/netns) and any conmon or aardvark-dns it left."""
        self._stop_health.set()
        if self._health is not None:
            self._health.join(timeout=60)
        if self.service is not None and self.service.poll() is None:
            self.service.terminate()
            try:
                self.service.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.service.kill()
                self.service.wait()
        self.stray = {pid: c for pid, c in _podman_processes().items() if pid not in self.processes_before}
        for pid in self.stray:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while set(self.stray) & set(_podman_processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        for point in _new_podman_mounts(self.mounts_before):
            subprocess.run(["umount", point], capture_output=True)


def _podman_or_skip() -> None:
    """Podman installed and root; else skip with one line (in CI, which installs it, fail)."""
    if os.geteuid() != 0:
        pytest.skip("the compose cluster runs under rootful podman: needs root")
    if shutil.which("podman") is None or shutil.which("mmdebstrap") is None:
        tool_missing("podman or mmdebstrap", f"apt-get install --no-install-recommends {PACKAGES}")


def _fill_wheelhouse() -> None:
    """Every wheel the images install, downloaded by the host's pip (its index settings, its cache)
    for the base image's CPython 3.11, whichever Python runs the test."""
    WHEELHOUSE.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(WHEELHOUSE)]
    command += ["--python-version=3.11", "--implementation=cp"]
    result = subprocess.run(
        [*command, str(ROOT), "setuptools>=68", "wheel"], capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-4000:]
    torch = sorted(p.name for p in WHEELHOUSE.glob("torch-*.whl"))
    assert torch and all("+cpu" in name for name in torch), (
        f"the wheelhouse needs torch's CPU wheel, has {torch}: set PIP_EXTRA_INDEX_URL to torch's CPU index"
    )


def _images() -> dict[str, str]:
    """The images of the compose file's own services: tag -> Dockerfile."""
    return {s["image"]: s["build"]["dockerfile"] for s in gradps_services(load_yaml(BASE)).values()}


def _build_images(podman: Podman) -> None:
    out = subprocess.run(
        ["bash", str(ROOT / "docker" / "debian-base.sh")], env=podman.env, capture_output=True, text=True, timeout=900
    )
    print(out.stdout.strip())
    if out.returncode == 0:  # and a container runs
        probe = ["run", "--rm", "--network=none", BASE_IMAGE, "true"]
        out = subprocess.run(["podman", *probe], env=podman.env, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        message = f"podman cannot make or run the base image here: {(out.stderr.strip().splitlines() or ['?'])[-1]}"
        if IN_CI:
            pytest.fail(message + "\n" + out.stderr[-4000:])
        pytest.skip(message)
    _fill_wheelhouse()
    for tag, dockerfile in _images().items():
        started = time.monotonic()
        podman.run(
            "build",
            "--format=docker",  # keeps the HEALTHCHECK (the OCI format has none)
            "--pull=never",
            "--network=none",
            "--build-arg=PIP_INDEX=--no-index",
            f"--file={ROOT / dockerfile}",
            f"--tag={tag}",
            str(ROOT),
            timeout=_BUILD_TIMEOUT,
        )
        print(f"built {tag} in {time.monotonic() - started:.0f} s")


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    _podman_or_skip()
    p = Podman(tmp_path_factory.mktemp("podman"))
    try:
        _build_images(p)
        p.start_service()
        p.start_health_checks()
        yield p
    finally:
        try:
            _compose(p, [BASE], "down", "--volumes", "--remove-orphans", "--timeout=15", check=False)
            _remove_leftovers(p)
        finally:
            p.stop()
    _assert_nothing_left(p)


def _compose(
    podman: Podman, files: list[Path], *args: str, project_dir: Path = ROOT, check: bool = True, timeout_s: float = 600
) -> subprocess.CompletedProcess:
    command = [*docker_compose(), "--project-name", PROJECT, "--project-directory", str(project_dir)]
    for file in files:
        command += ["--file", str(file)]
    result = subprocess.run(
        [*command, *args], env=podman.env, capture_output=True, text=True, cwd=project_dir, timeout=timeout_s
    )
    if check and result.returncode != 0:
        raise AssertionError(f"compose {' '.join(args)}: exit {result.returncode}\n{result.stderr[-6000:]}")
    return result


def _label() -> str:
    return f"label=com.docker.compose.project={PROJECT}"


def _remove_leftovers(podman: Podman) -> None:
    """What `compose down` may have missed: a failed start's containers, the network, volumes."""
    for container in podman.run("ps", "-aq", "--filter", _label(), check=False).split():
        podman.run("rm", "--force", "--volumes", container, check=False)
    for network in podman.run("network", "ls", "-q", "--filter", _label(), check=False).split():
        podman.run("network", "rm", "--force", network, check=False)
    for volume in podman.run("volume", "ls", "-q", "--filter", _label(), check=False).split():
        podman.run("volume", "rm", "--force", volume, check=False)


def _assert_nothing_left(podman: Podman) -> None:
    containers = podman.run("ps", "-a", "--format", "{{.Names}}", check=False).split()
    networks = podman.run("network", "ls", "--format", "{{.Name}}", check=False).split()
    volumes = podman.run("volume", "ls", "--format", "{{.Name}}", check=False).split()
    mounts = _new_podman_mounts(podman.mounts_before)
    processes = {pid: c for pid, c in _podman_processes().items() if pid not in podman.processes_before}
    print(f"after the test: containers {containers}, networks {networks}, volumes {volumes}, new mounts {mounts}")
    assert not [c for c in containers if c.startswith(PROJECT)], containers
    assert not [n for n in networks if n.startswith(PROJECT)], networks
    assert not [v for v in volumes if v.startswith(PROJECT)], volumes
    assert not mounts, mounts
    assert not processes, processes
    assert not podman.stray, f"left running after compose down and the service's stop: {podman.stray}"


def _logs(podman: Podman, files: list[Path], project_dir: Path = ROOT) -> str:
    result = _compose(podman, files, "logs", "--no-color", "--tail=30", project_dir=project_dir, check=False)
    return result.stdout[-8000:]


def _up(podman: Podman, files: list[Path], project_dir: Path = ROOT) -> None:
    started = time.monotonic()
    up = ["up", "--detach", "--no-build", "--pull=never", "--wait"]
    up.append(f"--wait-timeout={int(_UP_TIMEOUT.total_seconds())}")
    result = _compose(podman, files, *up, project_dir=project_dir, check=False)
    assert result.returncode == 0, f"compose up: {result.stderr[-4000:]}\n{_logs(podman, files, project_dir)}"
    print(f"compose up --wait: {time.monotonic() - started:.0f} s")


def _train(out: Path, scheme: str, *where: str, env: dict[str, str] | None = None) -> dict:
    """`gradps train` from the host; its summary.json."""
    command = [sys.executable, "-m", "client.cli", "train", "--scheme", scheme, *RUN_ARGS, "--out", str(out), *where]
    result = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=_RUN_TIMEOUT.total_seconds()
    )
    assert result.returncode == 0, f"gradps train {scheme} {where}: {result.stdout[-3000:]}{result.stderr[-3000:]}"
    return json.loads((out / "summary.json").read_text())


_LOCAL_ACCURACY: dict[str, float] = {}  # by scheme: each local run once per module


def _local_accuracy(out: Path, scheme: str) -> float:
    """The same run on a local cluster (client/local_cluster.py) shaped as the compose one:
    2 shards, 2 workers, CPU, payloads on data streams."""
    if scheme not in _LOCAL_ACCURACY:
        local = ["--local", "--shards", "2", "--workers", "2", "--device", "cpu", "--transport", "stream"]
        _LOCAL_ACCURACY[scheme] = _train(out, scheme, *local)["final_test_accuracy"]
    return _LOCAL_ACCURACY[scheme]


def _export(out: Path, run_id: str) -> dict:
    """`gradps export` from the host (the coordinator relays the shards' parts); the state_dict."""
    command = [sys.executable, "-m", "client.cli", "export", run_id, "--out", str(out), "--coordinator", COORDINATOR]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    import torch

    return torch.load(out, weights_only=True)


def test_the_compose_cluster_trains_as_the_local_cluster_does(podman: Podman, tmp_path: Path):
    files = [BASE]
    _up(podman, files)
    try:
        for scheme in ("sync", "asgd"):
            summary = _train(tmp_path / f"compose-{scheme}", scheme, "--coordinator", COORDINATOR)
            assert summary["state"] == "completed" and summary["workers"] == 2 and summary["shards"] == 2, summary
            local = _local_accuracy(tmp_path / f"local-{scheme}", scheme)
            accuracy = summary["final_test_accuracy"]
            print(f"{scheme}: test accuracy {accuracy:.4f} on the compose cluster, {local:.4f} on a local one")
            assert abs(accuracy - local) <= TOLERANCE[scheme], (scheme, accuracy, local)
        state = _export(tmp_path / "model.pt", summary["run_id"])
        assert state and all(t.numel() for t in state.values()), sorted(state)
    finally:
        _compose(podman, files, "down", "--volumes", "--timeout=15", check=False)


def _step(metrics: Path) -> int:
    """The furthest step that metrics.jsonl (written as the run goes) reports."""
    if not metrics.exists():
        return 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]
    return max((row["step"] for row in rows), default=0)


def _started_at(podman: Podman, container: str) -> str:
    return podman.run("inspect", "--format", "{{.State.StartedAt}}", container).strip()


def _wait_healthy(podman: Podman, container: str) -> None:
    started = time.monotonic()
    while (status := podman.run("inspect", "--format", "{{.State.Health.Status}}", container).strip()) != "healthy":
        assert time.monotonic() - started < _UP_TIMEOUT.total_seconds(), f"{container} is {status}"
        time.sleep(0.5)
    print(f"{container} healthy again in {time.monotonic() - started:.0f} s")


def _train_after_restart(tmp_path: Path, env: dict[str, str]) -> dict:
    """A sync run once the workers reach the restarted shard: it came back on a new address, which
    their channels resolve again only after gRPC's DNS re-resolution interval (30 s by default);
    until then a run fails UNAVAILABLE at its first push."""
    deadline = time.monotonic() + _RESOLVE_AGAIN.total_seconds()
    for attempt in range(1, 100):
        try:
            return _train(tmp_path / f"after-restart-{attempt}", "sync", "--coordinator", COORDINATOR, env=env)
        except AssertionError as e:
            if "UNAVAILABLE" not in str(e) or time.monotonic() > deadline:
                raise
            print(f"run {attempt} after the restart: UNAVAILABLE, the workers' channels not yet resolved again")
            time.sleep(5)
    raise AssertionError("unreachable")


def test_the_secured_cluster_takes_a_restarted_shards_run_back_from_its_volume(podman: Podman, tmp_path: Path):
    """docker-compose.tls.yml (mTLS everywhere, the certificates as compose secrets) over the base
    file. shard-0's container, restarted mid-run, takes the run back from the newest checkpoint on
    its state volume; the cluster then trains as the local one does."""
    project = tmp_path / "project"  # the override's ./certs are relative to the project directory
    certs = project / "certs"
    made = subprocess.run(
        [sys.executable, "-m", "client.cli", "certs", "--out", str(certs), "--hosts", "coordinator,shard-0,shard-1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert made.returncode == 0, made.stderr
    for key in certs.glob("*-key.pem"):  # the images run as uid 10001; compose mounts files as they are
        os.chown(key, 10001, 10001)
    files = [BASE, TLS_OVERRIDE]
    env = {
        **os.environ,
        "GRADPS_TLS_CA": str(certs / "ca.pem"),
        "GRADPS_TLS_CERT": str(certs / "client.pem"),
        "GRADPS_TLS_KEY": str(certs / "client-key.pem"),
    }
    _up(podman, files, project)
    try:
        out = tmp_path / "restarted"
        command = [sys.executable, "-m", "client.cli", "train", "--scheme", "sync", "--coordinator", COORDINATOR]
        command += ["--steps", "2000", "--checkpoint-every", "50", "--seed", "0", "--no-progress", "--out", str(out)]
        command += ["--part-size", "16384"]  # the MLP's parts on both shards (else all on one of them)
        log = open(tmp_path / "restarted-train.log", "wb")
        train = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + _RUN_TIMEOUT.total_seconds()
            while _step(out / "metrics.jsonl") < 200:
                assert train.poll() is None, (tmp_path / "restarted-train.log").read_text()
                assert time.monotonic() < deadline, "the run did not reach step 200"
                time.sleep(0.2)
            container = f"{PROJECT}-shard-0-1"
            before = _started_at(podman, container)
            _compose(podman, files, "restart", "--timeout=15", "shard-0", project_dir=project)
            assert _started_at(podman, container) != before, "shard-0 was not restarted"
            print(f"restarted shard-0 at step {_step(out / 'metrics.jsonl')}")
            train.wait(timeout=_RUN_TIMEOUT.total_seconds())
        finally:
            if train.poll() is None:
                train.kill()
                train.wait()
        # The workers waited for the shard, which took the run back from its volume, and every
        # shard went back to their newest common checkpoint.
        summary = json.loads((out / "summary.json").read_text())
        print(f"the run across the restart: {summary['state']} {summary['message']}")
        assert summary["state"] == "completed" and summary["shard_restores"] == 1, summary
        _wait_healthy(podman, container)  # not `up` again: compose would recreate every container
        shard_log = _compose(podman, files, "logs", "--no-color", "shard-0", project_dir=project).stdout
        restored = [line for line in shard_log.splitlines() if f"run {summary['run_id']} restored from" in line]
        assert restored, shard_log[-4000:]
        print(restored[-1].split("|", 1)[-1].strip())

        after = _train_after_restart(tmp_path, env)
        local = _local_accuracy(tmp_path / "local-after", "sync")
        accuracy = after["final_test_accuracy"]
        print(f"sync: test accuracy {accuracy:.4f} on the secured compose cluster, {local:.4f} on a local one")
        assert after["state"] == "completed" and abs(accuracy - local) <= TOLERANCE["sync"], (after, local)
    finally:
        _compose(podman, files, "down", "--volumes", "--timeout=15", project_dir=project, check=False)
