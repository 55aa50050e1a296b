"""An embedded cluster: coordinator, shards and workers as local processes on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from client.sdk import Client, GradpsError

# Each shard and worker is a process with its own torch (~300 MiB): a typo such as --workers 4000
# must not fork the machine to a halt.
MAX_PROCESSES = 256


class LocalCluster:
    """Starts real processes (one per service) and stops them with SIGTERM."""

    def __init__(
        self,
        shards: int = 2,
        workers: int = 2,
        heartbeat_timeout_s: float = 5.0,
        log_dir: str | os.PathLike | None = None,
        device: str = "cpu",
        transport: str = "shm",
    ) -> None:
        if shards < 1 or workers < 0:
            raise GradpsError("a local cluster needs at least 1 shard")
        if shards + workers > MAX_PROCESSES:
            raise GradpsError(
                f"{shards} shards and {workers} workers are more than the {MAX_PROCESSES} processes a local "
                "cluster starts on one machine"
            )
        self.n_shards = shards
        self.n_workers = workers
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.device = device
        # Where the workers' payloads travel (gradps-worker --transport).
        self.transport = transport
        self._tmp = tempfile.TemporaryDirectory(prefix="gradps-")
        self.log_dir = Path(log_dir) if log_dir else Path(self._tmp.name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.coordinator: subprocess.Popen | None = None
        self.shards: list[subprocess.Popen] = []
        self.workers: list[subprocess.Popen] = []
        self.address = ""

    def _spawn(self, name: str, module: str, *args: str) -> subprocess.Popen:
        env = dict(os.environ)
        # One compute thread per process: a small cluster shares few cores.
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("GRADPS_LOG_LEVEL", "WARNING")
        log = open(self.log_dir / f"{name}.log", "ab")
        return subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def _port(self, path: Path, process: subprocess.Popen, timeout_s: float = 60.0) -> int:
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if process.poll() is not None:
                raise GradpsError(f"a local service exited at start-up; see {self.log_dir}")
            if time.monotonic() > deadline:
                raise GradpsError(f"a local service did not start in {timeout_s:.0f}s; see {self.log_dir}")
            time.sleep(0.05)
        return int(path.read_text())

    def start(self) -> LocalCluster:
        """Start every process and wait until all shards and workers joined."""
        port_file = Path(self._tmp.name) / "coordinator.port"
        self.coordinator = self._spawn(
            "coordinator",
            "ps_server.coordinator",
            "--port=0",
            f"--port-file={port_file}",
            f"--heartbeat-timeout={self.heartbeat_timeout_s}",
        )
        self.address = f"127.0.0.1:{self._port(port_file, self.coordinator)}"
        for i in range(self.n_shards):
            self.add_shard(i)
        for i in range(self.n_workers):
            self.add_worker(i)
        with Client(self.address) as client:
            client.wait_for_cluster(self.n_shards, self.n_workers)
        return self

    def add_shard(self, i: int) -> subprocess.Popen:
        port_file = Path(self._tmp.name) / f"shard-{i}.port"
        p = self._spawn(
            f"shard-{i}",
            "ps_server.shard",
            "--port=0",
            "--data-port=0",
            f"--port-file={port_file}",
            f"--coordinator={self.address}",
            "--advertise-host=127.0.0.1",
            f"--device={self.device}",
        )
        self.shards.append(p)
        self._port(port_file, p)  # registered once the port file exists
        return p

    def add_worker(self, i: int) -> subprocess.Popen:
        p = self._spawn(
            f"worker-{i}",
            "gpu_worker.service",
            f"--coordinator={self.address}",
            f"--name=local-worker-{i}",
            f"--device={self.device}",
            f"--transport={self.transport}",
        )
        self.workers.append(p)
        return p

    def stop(self, grace_s: float = 5.0) -> list[int]:
        """SIGTERM every process (workers first), then SIGKILL what is left; returns exit codes."""
        processes = [*self.workers, *self.shards, *([self.coordinator] if self.coordinator else [])]
        for p in processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        codes = []
        for p in processes:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        self._tmp.cleanup()
        return codes

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop(grace_s=1.0)
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
