"""An embedded cluster: coordinator, shards and workers as local processes on loopback."""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import os
import secrets
import signal
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from client.fork_server import Service, start_service, warm_up
from client.sdk import Client, GradpsError
from client.stopping import terminate
from gradps.auth import tls
from gradps.auth.certs import make_certs
from gradps.auth.client_tokens import forget, read_token_file, remember, store_token, unstore_token, write_private_file
from gradps.auth.tokens import ADMIN, WORKER, ClusterSecret
from gradps.netem import EmulatedNetwork, Layout

# Each shard and worker is a process (forked with torch loaded: ~40 MiB of its own at start, far
# more once it trains): a typo such as --workers 4000 must not fork the machine to a halt.
MAX_PROCESSES = 256
# In the state dir: the shards' ports, for the next cluster on it.
_SHARD_PORTS = "shard-ports.json"
# Unconfigured, Python's logging writes a warning's message alone to stderr: what a user of the
# CLI or the SDK sees of a service that crashed while it stopped.
_LOGGER = logging.getLogger("gradps.local_cluster")


def own_certs(folder: Path, hosts: Sequence[str] = ()) -> Path:
    """`folder`, holding a local cluster's own CA and the certificates of its services (for loopback
    and `hosts`) and clients, as `gradps certs` makes them: made now unless it holds them already,
    valid for every one of `hosts` and for a day more at least. The CA's key is not kept: no one
    can issue another certificate that the cluster trusts. GradpsError (one line) when the folder
    cannot be written."""
    names = ["127.0.0.1", "localhost", *hosts]
    if _usable_certs(folder, names):
        return folder
    try:
        make_certs(folder, names)
        (folder / "ca-key.pem").unlink()
    except OSError as e:
        raise GradpsError(f"TLS certificates in {folder}: {e.strerror or e}") from None
    return folder


def _usable_certs(folder: Path, names: Sequence[str]) -> bool:
    """Whether `folder` holds a CA and certificates, for `names`, that remain valid a day more."""
    from cryptography import x509

    try:
        files = {name: (folder / f"{name}.pem").read_bytes() for name in ("ca", "service", "client")}
        if not all((folder / f"{name}-key.pem").is_file() for name in ("service", "client")):
            return False
        certificates = {name: x509.load_pem_x509_certificate(pem) for name, pem in files.items()}
        alt = certificates["service"].extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return False
    soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1)
    if any(c.not_valid_after_utc < soon for c in certificates.values()):
        return False
    served = {str(a) for a in alt.get_values_for_type(x509.IPAddress)} | set(alt.get_values_for_type(x509.DNSName))
    return set(names) <= served


def _service_env() -> dict[str, str]:
    """The environment of the cluster's services: this process's, less what would make them another
    cluster's."""
    env = dict(os.environ)
    # One compute thread per process: a small cluster shares few cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("GRADPS_LOG_LEVEL", "WARNING")
    # The coordinator keeps runs only where this cluster says (--state-dir): never in the
    # folder of one the user runs elsewhere, which it would lock.
    env.pop("GRADPS_STATE_DIR", None)
    # Its own secret and tokens, bind and allow-list: never the user's for another cluster.
    for key in (
        "GRADPS_SECRET",
        "GRADPS_SECRET_FILE",
        "GRADPS_TOKEN",
        "GRADPS_TOKEN_FILE",
        "GRADPS_INSECURE",
        "GRADPS_BIND",
        "GRADPS_ALLOW_IMPORT",
        tls.TLS_CERT_ENV,
        tls.TLS_KEY_ENV,
        tls.TLS_CA_ENV,
        tls.TLS_CLIENT_AUTH_ENV,
    ):
        env.pop(key, None)
    # Likewise metrics: one fixed port set for a single service would collide here.
    for key in ("GRADPS_METRICS_PORT", "GRADPS_METRICS_HOST", "GRADPS_METRICS_PORT_FILE"):
        env.pop(key, None)
    return env


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
        state_dir: str | os.PathLike | None = None,
        metrics: bool = False,
        allow_import: Sequence[str] = (),
        secure: bool = True,
        tls_certs: str | os.PathLike | bool = False,
        port: int = 0,
        tls_client_auth: bool = False,
        network: EmulatedNetwork | None = None,
        layout: Layout | None = None,
    ) -> None:
        """`state_dir`: where the coordinator keeps its runs (a later cluster with the same one takes
        them back); None: in memory. `metrics`: every process serves Prometheus metrics on a free
        loopback port (`metrics_targets`). `tls_certs`: every connection in TLS, with the
        certificates of a `gradps certs` folder, or (True) of a CA of its own, made in `state_dir`/tls
        (kept there for the next cluster with that folder) or else in a folder removed at `stop`
        (`own_certs`); `tls_client_auth`:
        mTLS, the workers and this process presenting the folder's client certificate. `port`: the
        coordinator's (0: a free one). `network`: every process on a host of that emulated network,
        as `layout` places it (default: colocated), binding its host's address; the caller must be
        on one of its hosts too (`gradps.netem.enter`) to reach them."""
        if shards < 1 or workers < 0:
            raise GradpsError("a local cluster needs at least 1 shard")
        if shards + workers > MAX_PROCESSES:
            raise GradpsError(
                f"{shards} shards and {workers} workers are more than the {MAX_PROCESSES} processes a local "
                "cluster starts on one machine"
            )
        self.n_shards = shards
        self.n_workers = workers
        self.network = network
        self.layout = layout or Layout.colocated(shards, max(workers, 1))
        if network and self.layout.hosts > network.hosts:
            raise GradpsError(f"the layout needs {self.layout.hosts} hosts; the emulated network has {network.hosts}")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.device = device
        # Where the workers' payloads travel (gradps-worker --transport).
        self.transport = transport
        self.state_dir = Path(state_dir) if state_dir else None
        self.metrics = metrics
        # Each process's metrics address and port file, by process name.
        self._metrics_ports: dict[str, tuple[str, Path, Service]] = {}
        self._tmp = tempfile.TemporaryDirectory(prefix="gradps-")
        # Import paths runs may name (the coordinator's and the workers' --allow-import).
        self.allow_import = tuple(allow_import)
        # Secure by default: a secret of its own in a folder only this user reads (mkdtemp: 0700),
        # files 0600; the shards and the coordinator check with it, the workers join with the worker
        # token, and this process's channels to the cluster send the admin token (`remember`).
        self.token: str | None = None
        self.token_file: Path | None = None
        self._auth_files: dict[str, Path] = {}
        if secure:
            secret = secrets.token_urlsafe(32)
            tokens = {"secret": secret, ADMIN: ClusterSecret(secret).token(ADMIN)}
            tokens[WORKER] = ClusterSecret(secret).token(WORKER)
            for name, text in tokens.items():
                self._auth_files[name] = Path(self._tmp.name) / f"{name}.token"
                write_private_file(self._auth_files[name], text)
            self.token, self.token_file = tokens[ADMIN], self._auth_files[ADMIN]
        self._remembered: list[str] = []
        # TLS: the services' files and the clients' (the workers', this process's), or plaintext.
        self.tls_dir: Path | None = None
        self.client_tls: tls.TlsFiles | None = None
        if tls_certs:
            if tls_certs is True:
                hosts = [network.address(k) for k in range(network.hosts)] if network else []
                folder = self.state_dir / "tls" if self.state_dir else Path(self._tmp.name) / "tls"
                self.tls_dir = own_certs(folder, hosts)
            else:
                self.tls_dir = Path(tls_certs)
            self.client_tls = tls.TlsFiles(
                self.tls_dir / "client.pem", self.tls_dir / "client-key.pem", self.tls_dir / "ca.pem"
            )
        self.tls_client_auth = tls_client_auth
        self.port = port
        self.log_dir = Path(log_dir) if log_dir else Path(self._tmp.name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.coordinator: Service | None = None
        self.shards: list[Service] = []
        self.shard_ports: list[int] = []
        self.workers: list[Service] = []
        self._names: dict[int, str] = {}  # by pid: "coordinator", "shard-0", "worker-1"
        self.address = ""

    @property
    def worker_token_file(self) -> Path | None:
        """The file (0600) of the plain worker token, that workers join with; None without a secret."""
        return self._auth_files.get(WORKER)

    def host_address(self, host: int) -> str:
        """Where the processes of `host` listen: its address on the emulated network, or loopback."""
        return self.network.address(host) if self.network else "127.0.0.1"

    def _spawn(self, name: str, module: str, *args: str, host: int = 0) -> Service:
        env = _service_env()
        port_file = Path(self._tmp.name) / f"{name}.metrics-port"
        address = self.host_address(host)  # an emulated host's loopback is its own
        if self.metrics:
            args = (*args, "--metrics-port=0", f"--metrics-host={address}", f"--metrics-port-file={port_file}")
        # On an emulated network it must start inside its host's namespace.
        within = functools.partial(self.network.command, host) if self.network else None
        process = start_service(module, args, env, self.log_dir / f"{name}.log", within)
        self._names[process.pid] = name
        if self.metrics:
            self._metrics_ports[name] = (address, port_file, process)
        return process

    def metrics_targets(self) -> dict[str, str]:
        """Every process's metrics endpoint ("127.0.0.1:PORT", or its emulated host's address), by
        name ("coordinator", "shard-0", "worker-1"), once each has written its port; empty unless
        the cluster serves metrics."""
        return {name: f"{host}:{self._port(path, p)}" for name, (host, path, p) in self._metrics_ports.items()}

    def _port(self, path: Path, process: Service, timeout_s: float = 60.0) -> int:
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if process.poll() is not None:
                raise GradpsError(
                    f"{self._name(process)} exited at start-up{self._refusal(process)}; see {self.log_dir}"
                )
            if time.monotonic() > deadline:
                raise GradpsError(f"{self._name(process)} did not start in {timeout_s:.0f}s; see {self.log_dir}")
            time.sleep(0.05)
        return int(path.read_text())

    def _name(self, process: Service) -> str:
        """The local service's name as its log file has it ("shard-0"), for messages."""
        return self._names.get(process.pid, f"process {process.pid}")

    def _log_lines(self, process: Service) -> list[str]:
        """The lines of a local service's log; none before it has one."""
        path = self.log_dir / f"{self._name(process)}.log"
        return path.read_text(errors="replace").splitlines() if path.exists() else []

    def _refusal(self, process: Service) -> str:
        """A service's one-line refusal (`Error: ...`, click's), when its log ends with one."""
        lines = self._log_lines(process)
        return f" ({lines[-1]})" if lines and lines[-1].startswith("Error: ") else ""

    def start(self) -> LocalCluster:
        """Start every process and wait until all shards and workers joined. The shards start side
        by side, then the workers: each process spends seconds importing torch."""
        if not self.network:
            warm_up(_service_env())  # the fork server imports the services while the coordinator starts
        self.address = self._start_coordinator(self.port)
        self._remember(self.address)
        kept = self._kept_shard_ports()
        port_files = [self._spawn_shard(i, port) for i, port in enumerate(kept)]
        for i, (port, port_file) in enumerate(zip(kept, port_files, strict=True)):
            try:
                self._registered(i, port_file)
            except GradpsError:
                if not port:
                    raise
                # Its port is taken now: its runs cannot be taken up again.
                self._registered(i, self._spawn_shard(i, 0))
        self._keep_shard_ports()
        for i in range(self.n_workers):
            self.add_worker(i)
        with Client(self.address) as client:
            client.wait_for_cluster(self.n_shards, self.n_workers)
        return self

    def _start_coordinator(self, port: int) -> str:
        """Start the coordinator on `port` (0: any free one); its address once it listens."""
        port_file = Path(self._tmp.name) / "coordinator.port"
        port_file.unlink(missing_ok=True)
        state = [f"--state-dir={self.state_dir}"] if self.state_dir else []
        host = self.layout.coordinator
        bind = [f"--bind={self.host_address(host)}"] if self.network else []
        self.coordinator = self._spawn(
            "coordinator",
            "ps_server.coordinator",
            f"--port={port}",
            f"--port-file={port_file}",
            f"--heartbeat-timeout={self.heartbeat_timeout_s}",
            *state,
            *self._secret_args(),
            *self._tls_args(),
            *(f"--allow-import={prefix}" for prefix in self.allow_import),
            *bind,
            host=host,
        )
        return f"{self.host_address(host)}:{self._port(port_file, self.coordinator)}"

    def restart_coordinator(self) -> None:
        """Start the coordinator again after it exited (killed, say), on its port (the shards and
        workers know it there) and wait until it listens: with a state dir, it takes its runs back."""
        if self.coordinator is None or self.coordinator.poll() is None:
            raise RuntimeError("the coordinator is still running")
        self._start_coordinator(int(self.address.rsplit(":", 1)[1]))

    def add_shard(self, i: int, port: int = 0) -> Service:
        """Start shard `i` (on `port`; 0: any free one) and wait until it registered."""
        self._registered(i, self._spawn_shard(i, port))
        return self.shards[i]

    def _spawn_shard(self, i: int, port: int) -> Path:
        """Start shard `i` (on `port`; 0: any free one) as `self.shards[i]`; the file that will hold
        its port once it registered."""
        port_file = Path(self._tmp.name) / f"shard-{i}.port"
        port_file.unlink(missing_ok=True)
        host = self._shard_host(i)
        address = self.host_address(host)
        p = self._spawn(
            f"shard-{i}",
            "ps_server.shard",
            f"--port={port}",
            "--data-port=0",
            f"--port-file={port_file}",
            f"--coordinator={self.address}",
            f"--advertise-host={address}",
            f"--device={self.device}",
            # The shards' checkpoints go in the state dir too, each under its index.
            *([f"--state-dir={self.state_dir}", f"--shard-id=local-{i}"] if self.state_dir else []),
            *self._secret_args(),
            *self._tls_args(),
            *([f"--bind={address}"] if self.network else []),
            host=host,
        )
        if i < len(self.shards):
            self.shards[i] = p
        else:
            self.shards.append(p)
        return port_file

    def _registered(self, i: int, port_file: Path) -> None:
        """Wait until shard `i` registered (its port file exists), and note its port."""
        port = self._port(port_file, self.shards[i])
        self._remember(f"{self.host_address(self._shard_host(i))}:{port}")
        self.shard_ports[i : i + 1] = [port]

    def _shard_host(self, i: int) -> int:
        return self.layout.shards[i % len(self.layout.shards)]

    def _kept_shard_ports(self) -> list[int]:
        """The ports the shards had when the cluster last ran on this state dir (0: any free one):
        a run's placement names its shards by address, so a run of that cluster can go on (or be
        resumed) only with its shards where they were."""
        kept: list[int] = []
        if self.state_dir is not None:
            with contextlib.suppress(OSError, ValueError):
                kept = [int(p) for p in json.loads((self.state_dir / _SHARD_PORTS).read_text())]
        return (kept + [0] * self.n_shards)[: self.n_shards]

    def _keep_shard_ports(self) -> None:
        if self.state_dir is not None:
            with contextlib.suppress(OSError):
                (self.state_dir / _SHARD_PORTS).write_text(json.dumps(self.shard_ports))

    def restart_shard(self, i: int) -> Service:
        """Start shard `i` again after it exited (killed, say), at its address: with a state dir,
        its runs go on from their checkpoints."""
        if self.shards[i].poll() is None:
            raise RuntimeError(f"shard {i} is still running")
        return self.add_shard(i, self.shard_ports[i])

    def role_token(self, role: str) -> str | None:
        """The token of `role` (admin, shard, worker) for this cluster; None when it runs without one."""
        if not self._auth_files:
            return None
        return ClusterSecret(read_token_file(self._auth_files["secret"])).token(role)

    def _secret_args(self) -> list[str]:
        return [f"--secret-file={self._auth_files['secret']}"] if self._auth_files else []

    def _tls_args(self, service: bool = True) -> list[str]:
        """A service's TLS options (`service`), or a worker's."""
        if self.tls_dir is None:
            return []
        name = "service" if service else "client"
        files = [f"--tls-cert={self.tls_dir / name}.pem", f"--tls-key={self.tls_dir / name}-key.pem"]
        auth = ["--tls-client-auth"] if service and self.tls_client_auth else []
        return [*files, f"--tls-ca={self.tls_dir / 'ca.pem'}", *auth]

    def _remember(self, address: str) -> None:
        """This process's channels to `address` (SDK, CLI, tests) send the admin token, and so do
        this user's other commands (the token store) while the cluster runs; they use the
        cluster's TLS, or plaintext."""
        tls.remember(address, self.client_tls)
        self._remembered.append(address)
        if self.token:
            remember(address, self.token)
            try:
                store_token(address, self.token)
            except OSError:  # a read-only home: other commands then need GRADPS_TOKEN_FILE
                pass

    def add_worker(self, i: int) -> Service:
        p = self._spawn(
            f"worker-{i}",
            "gpu_worker.service",
            f"--coordinator={self.address}",
            f"--name=local-worker-{i}",
            f"--device={self.device}",
            f"--transport={self.transport}",
            *([f"--token-file={self._auth_files[WORKER]}"] if self._auth_files else []),
            *self._tls_args(service=False),
            *(f"--allow-import={prefix}" for prefix in self.allow_import),
            host=self.layout.workers[i % len(self.layout.workers)],
        )
        self.workers.append(p)
        return p

    def stop(self, grace_s: float = 5.0) -> list[int]:
        """SIGTERM the shards, then the workers, then the coordinator, each group waited for and
        SIGKILLed after `grace_s`; returns exit codes. The shards go first: a run takes no step
        once a process of the cluster stops (none with only part of its workers, which a
        checkpoint could keep). The coordinator goes last: it hears each worker leave, so a
        stopped cluster leaves no run recorded as running with workers that are gone, which the
        next cluster on the same state dir would take up on its own. A service that was running
        and does not exit 0 is warned about (logger `gradps.local_cluster`), with its log's end.
        Interrupted while it waits (a second Ctrl-C), it SIGKILLs every service at once: none is
        left running on its own."""
        groups = [self.shards, self.workers, [self.coordinator] if self.coordinator else []]
        running = {p.pid for group in groups for p in group if p.poll() is None}
        try:
            codes = [code for group in groups for code in terminate(group, grace_s)]
        except BaseException:
            for p in (p for group in groups for p in group):
                p.kill()
            self._release()
            raise
        for p in (p for group in groups for p in group if p.pid in running and p.returncode != 0):
            self._say_stop_failed(p, grace_s)
        self._release()
        return codes

    def _release(self) -> None:
        """Drop what this client keeps for the cluster: its tokens and certificates by address, and its
        temporary folder."""
        for address in self._remembered:
            forget(address)
            tls.forget(address)
            unstore_token(address)
        self._remembered.clear()
        self._tmp.cleanup()

    def _say_stop_failed(self, process: Service, grace_s: float) -> None:
        """A warning for a service that did not stop cleanly on SIGTERM, with the end of its log
        (the folder may be a temporary one, removed now)."""
        how = (
            f"did not stop within {grace_s:.0f} s of SIGTERM and was killed"
            if process.returncode == -signal.SIGKILL
            else f"exited with {process.returncode} when stopped"
        )
        tail = "\n".join(self._log_lines(process)[-5:])
        _LOGGER.warning("local cluster: %s %s; its log ends:\n%s", self._name(process), how, tail)

    def __enter__(self) -> LocalCluster:
        try:
            return self.start()
        except BaseException:
            self.stop(grace_s=1.0)
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
