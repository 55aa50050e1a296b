"""A coordinator (restartable on its port) and shards as real processes, each logging to a folder:
for tests that kill, pause or restart the services themselves; and ports to start services on."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from client.fork_server import Service, start_service


def until(condition: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.02) -> None:
    """Wait for `condition`; AssertionError(`what`) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(poll_s)


def free_ports(n: int) -> list[int]:
    """`n` distinct ports that can be bound now, for services told their port in advance. They
    lie below the kernel's ephemeral range: one from inside it could be handed to any process's
    connection or `port 0` bind between this look and the service's own bind."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    candidates = random.sample(range(10_000, low), min(10 * n + 100, low - 10_000))
    sockets: list[socket.socket] = []
    try:
        for port in candidates:
            s = socket.socket()
            try:
                s.bind(("", port))  # every address: a service may bind any of them
            except OSError:
                s.close()
                continue
            sockets.append(s)  # held until all are found, so that they differ
            if len(sockets) == n:
                return [s.getsockname()[1] for s in sockets]
        raise RuntimeError(f"no {n} free ports below {low}")
    finally:
        for s in sockets:
            s.close()


class Services:
    """A coordinator started with `coordinator_args` (again on the same port after a restart) and
    shards registered with it, each a process logging to `tmp`."""

    def __init__(self, tmp: Path, *coordinator_args: str) -> None:
        self.tmp = tmp
        self.coordinator_args = coordinator_args
        self.coordinator: Service | None = None
        self.port = 0
        self.shards: list[Service] = []
        self.shard_args: list[tuple[str, ...]] = []
        self.shard_ports: list[int] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _spawn(self, name: str, module: str, *args: str) -> Service:
        env = dict(os.environ, OMP_NUM_THREADS="1", GRADPS_LOG_LEVEL="INFO")
        return start_service(module, args, env, self.tmp / f"{name}.log")  # as the local cluster does

    def _port_of(self, port_file: Path, process: Service) -> int:
        until(lambda: port_file.exists() or process.poll() is not None, 60, f"{port_file.name} never written")
        assert process.poll() is None, f"a service exited at start-up; see {self.tmp}"
        return int(port_file.read_text())

    def start_coordinator(self, *args: str) -> None:
        """Start the coordinator (`args` after the constructor's); on the port it had before, when
        it ran already."""
        port_file = self.tmp / "coordinator.port"
        port_file.unlink(missing_ok=True)
        self.coordinator = self._spawn(
            "coordinator",
            "ps_server.coordinator",
            f"--port={self.port}",
            f"--port-file={port_file}",
            *self.coordinator_args,
            *args,
        )
        self.port = self._port_of(port_file, self.coordinator)

    def kill_coordinator(self) -> None:
        assert self.coordinator is not None
        self.coordinator.send_signal(signal.SIGKILL)
        self.coordinator.wait()

    def add_shard(self, *args: str) -> None:
        """Start a shard (`args` added to its flags); restart_shard starts it again as it was."""
        self.shard_args.append(args)
        self.shard_ports.append(0)
        self.shards.append(self._start_shard(len(self.shards)))

    def _start_shard(self, index: int) -> Service:
        name = f"shard-{index}"
        port_file = self.tmp / f"{name}.port"
        port_file.unlink(missing_ok=True)
        shard = self._spawn(
            name,
            "ps_server.shard",
            f"--port={self.shard_ports[index]}",
            "--data-port=-1",
            f"--port-file={port_file}",
            f"--coordinator={self.address}",
            "--advertise-host=127.0.0.1",
            "--device=cpu",
            *self.shard_args[index],
        )
        self.shard_ports[index] = self._port_of(port_file, shard)
        return shard

    def kill_shard(self, index: int) -> None:
        self.shards[index].send_signal(signal.SIGKILL)
        self.shards[index].wait()

    def restart_shard(self, index: int) -> None:
        """Start shard `index` again, with its flags, on the port it had (its address in placements)."""
        assert self.shards[index].poll() is not None, "kill it first"
        self.shards[index] = self._start_shard(index)

    def coordinator_rss(self) -> int:
        """The coordinator's resident memory, bytes."""
        assert self.coordinator is not None
        for line in Path(f"/proc/{self.coordinator.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def stop(self) -> None:
        """SIGTERM every service still running; one that does not stop within 10 s, or stops with
        a status other than 0, is warned about with the end of its log (a service that outlives
        its SIGTERM first writes its threads' stacks there: gradps.logs)."""
        named = [
            *((f"shard-{i}", p) for i, p in enumerate(self.shards)),
            *([("coordinator", self.coordinator)] if self.coordinator else []),
        ]
        running = [(name, p) for name, p in named if p.poll() is None]
        for _, p in running:
            p.send_signal(signal.SIGCONT)  # a test may have paused it
            p.terminate()
        for name, p in running:
            try:
                p.wait(timeout=10)
                trouble = None if p.returncode == 0 else f"exited with {p.returncode} on SIGTERM"
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGUSR1)
                time.sleep(1)
                p.kill()
                p.wait()
                trouble = "did not stop within 10 s of SIGTERM"
            if trouble:
                log = self.tmp / f"{name}.log"
                warnings.warn(f"{name} {trouble}; its log ends:\n{log.read_text()[-8000:]}", stacklevel=1)
