"""TLS and mTLS (gradps/auth/tls.py) on real coordinator, shard and worker processes.

A plaintext client is refused by a TLS port; a training run over mTLS completes; a relay that
records every byte between the test (as a worker) and a shard, data stream included, finds the
pulled tensor's bytes when the cluster runs in plaintext and none of them when it runs in TLS; a
client certificate from another CA is refused; a certificate whose files are replaced is served to
the next connection without a restart; `gradps certs` writes a CA and certificates that fit together.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.cli import cli
from client.local_cluster import LocalCluster, own_certs
from client.report import follow
from client.sdk import Client, run_spec
from gradps.auth import certs, tls
from gradps.auth.tls import TlsFiles
from gradps.channel import open_channel
from gradps.data_stream import DataStream, StreamError
from gradps.v1 import run_pb2, shard_pb2, shard_pb2_grpc
from tests.images import BASE, ROOT, gradps_services, load_yaml, merge_compose
from tests.joined_run import join_run, leave
from tests.services import until
from tests.test_compose import _compose_config, _validate_compose

HOSTS = ["127.0.0.1", "127.0.0.2", "localhost"]
# 16 bytes that are four finite float32 values: the tensor the wire test pulls is this, repeated.
PATTERN = b"GRADPS-WEIGHTS:)"
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("certs")
    certs.make_certs(folder, HOSTS)
    return folder


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second CA with its own client certificate: not the cluster's."""
    folder = tmp_path_factory.mktemp("other-ca")
    certs.make_certs(folder, HOSTS)
    return folder


def _client_files(folder: Path, ca: Path | None = None) -> TlsFiles:
    return TlsFiles(folder / "client.pem", folder / "client-key.pem", ca or folder / "ca.pem")


@pytest.fixture(scope="module")
def mtls_cluster(cert_dir: Path) -> Iterator[LocalCluster]:
    """A cluster (tokens too) whose every port asks for a client certificate of the cluster's CA."""
    with LocalCluster(shards=1, workers=1, transport="stream", tls_certs=cert_dir, tls_client_auth=True) as c:
        yield c


def _shard_address(cluster: LocalCluster) -> str:
    with Client(cluster.address) as client:
        return client.cluster().shards[0]


def _health(address: str, files: TlsFiles | None, plaintext: bool = False) -> grpc.StatusCode | int:
    """The health status a fresh channel gets (its code when the call fails)."""
    channel = grpc.insecure_channel(address) if plaintext else open_channel(address, tls=files)
    with channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError as e:
            return e.code()


def test_a_plaintext_client_is_refused_by_a_tls_server(mtls_cluster: LocalCluster, cert_dir: Path):
    for address in (mtls_cluster.address, _shard_address(mtls_cluster)):
        assert _health(address, None, plaintext=True) == grpc.StatusCode.UNAVAILABLE, address
        assert _health(address, _client_files(cert_dir)) == SERVING, address


def test_a_training_run_over_mtls_completes(mtls_cluster: LocalCluster, tmp_path: Path):
    with Client(mtls_cluster.address) as client:
        run_id = client.submit(run_spec("sync", workers=1, steps=20, eval_every=0))
        summary = follow(client, run_id, tmp_path, show_progress=False)
    assert summary["state"] == "completed", summary


def test_a_client_certificate_from_another_ca_is_refused(mtls_cluster: LocalCluster, cert_dir: Path, other_ca: Path):
    foreign = _client_files(other_ca, ca=cert_dir / "ca.pem")  # trusts the cluster, is not trusted by it
    without = TlsFiles(ca=cert_dir / "ca.pem")  # no client certificate at all
    for address in (mtls_cluster.address, _shard_address(mtls_cluster)):
        assert _health(address, foreign) == grpc.StatusCode.UNAVAILABLE, address
        assert _health(address, without) == grpc.StatusCode.UNAVAILABLE, address
        assert _health(address, _client_files(cert_dir)) == SERVING, address


def test_the_images_health_probe_speaks_tls_where_the_environment_says(mtls_cluster: LocalCluster, cert_dir: Path):
    """docker/healthcheck.py, as a container runs it: with the service's own files (GRADPS_TLS_*), healthy;
    without them, not."""
    probe = [sys.executable, "docker/healthcheck.py", "--address", mtls_cluster.address]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPS_TLS_")}
    files = {"GRADPS_TLS_CA": "ca.pem", "GRADPS_TLS_CERT": "service.pem", "GRADPS_TLS_KEY": "service-key.pem"}
    secure = {**env, **{name: str(cert_dir / file) for name, file in files.items()}}
    assert subprocess.run(probe, env=secure, capture_output=True, timeout=60).returncode == 0
    plain = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 1 and plain.stderr.startswith("unhealthy: UNAVAILABLE"), plain.stderr


def test_a_workers_health_probe_needs_no_token_without_the_worker_list(mtls_cluster: LocalCluster, cert_dir: Path):
    """`gradps-healthcheck worker` as a worker's container runs it on a cluster with tokens: the worker
    list is an admin call, refused in one line that names the way out; --without-token, the
    coordinator's health over the worker's TLS, passes, and fails without that TLS."""
    probe = [sys.executable, "docker/healthcheck.py", "worker", "--coordinator", mtls_cluster.address]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADPS_TLS_", "GRADPS_TOKEN"))}
    files = {"GRADPS_TLS_CA": "ca.pem", "GRADPS_TLS_CERT": "client.pem", "GRADPS_TLS_KEY": "client-key.pem"}
    worker = {**env, **{name: str(cert_dir / file) for name, file in files.items()}}
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=60)
    listed = run([*probe, "--name", "local-worker-0"], env=worker)
    assert listed.returncode == 1 and "--without-token" in listed.stderr, listed.stderr
    assert listed.stderr.startswith("unhealthy: UNAUTHENTICATED") and len(listed.stderr.splitlines()) == 1
    healthy = run([*probe, "--without-token"], env=worker)
    assert healthy.returncode == 0, healthy.stderr
    plain = run([*probe, "--without-token"], env=env)
    assert plain.returncode == 1 and plain.stderr.startswith("unhealthy: UNAVAILABLE"), plain.stderr


def _served_serial(address: str, ca: Path) -> int:
    """The serial number of the certificate a new TLS connection to `address` is shown."""
    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context(cafile=str(ca))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname=host) as sock:
            der = sock.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def _serial(path: Path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


def test_replaced_certificate_files_are_served_to_new_connections_without_a_restart(cert_dir: Path, tmp_path: Path):
    folder = tmp_path / "live"
    shutil.copytree(cert_dir, folder)
    ca = certs.Issued(folder / "ca.pem", folder / "ca-key.pem")
    with LocalCluster(shards=1, workers=0, tls_certs=folder) as cluster:
        addresses = [cluster.address, _shard_address(cluster)]
        old = _serial(folder / "service.pem")
        assert [_served_serial(a, ca.cert) for a in addresses] == [old, old]
        kept = open_channel(cluster.address)  # connected before the change: keeps working
        health_pb2_grpc.HealthStub(kept).Check(health_pb2.HealthCheckRequest(), timeout=5)
        fresh = certs.issue(ca, tmp_path, "fresh", HOSTS)
        # Half done (a new certificate beside the old key): the old pair is served meanwhile.
        os.replace(fresh.cert, folder / "service.pem")
        assert [_served_serial(a, ca.cert) for a in addresses] == [old, old]
        os.replace(fresh.key, folder / "service-key.pem")
        new = _serial(folder / "service.pem")
        assert new != old
        assert [_served_serial(a, ca.cert) for a in addresses] == [new, new]
        for address in addresses:
            assert _health(address, cluster.client_tls) == SERVING
        assert health_pb2_grpc.HealthStub(kept).Check(health_pb2.HealthCheckRequest(), timeout=5).status == SERVING
        kept.close()
        processes = [cluster.coordinator, *cluster.shards]
        assert all(p is not None and p.poll() is None for p in processes)  # never restarted


class Relay:
    """A TCP relay on `host` (port 0: any free) to `target`, recording every byte both ways."""

    def __init__(self, host: str, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._captured = bytearray()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def captured(self) -> bytes:
        with self._lock:
            return bytes(self._captured)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                with self._lock:
                    self._captured += data
                sink.sendall(data)
        except OSError:
            pass
        for sock in (sink, source):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                sock.close()


def _spawn(tmp: Path, name: str, module: str, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADPS_TLS_", "GRADPS_SECRET", "GRADPS_TOKEN"))}
    env.update(OMP_NUM_THREADS="1", GRADPS_LOG_LEVEL="INFO")
    log = open(tmp / f"{name}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", module, *args], stdout=log, stderr=subprocess.STDOUT, env=env)


def _port(path: Path, process: subprocess.Popen) -> int:
    until(lambda: path.exists() or process.poll() is not None, 60, f"{path.name} never written")
    assert process.poll() is None, f"{path.name}: the service exited at start-up"
    return int(path.read_text())


def _tensor(nbytes: int) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(PATTERN * (nbytes // len(PATTERN)), dtype=np.float32).copy())


@pytest.mark.parametrize("secure", [False, True], ids=["plaintext", "mtls"])
def test_a_capture_between_worker_and_shard_finds_no_weight_bytes_in_tls(
    secure: bool, cert_dir: Path, other_ca: Path, tmp_path: Path
):
    """The shard advertises 127.0.0.2, where relays of its gRPC and data ports record everything
    the coordinator and the test (as the run's worker, data stream on) exchange with it. In
    plaintext the capture holds the pulled tensor's bytes: the capture sees them when they are
    there. In (m)TLS it holds none, and the data port refuses a stream's token presented in
    plaintext or with a client certificate of another CA."""
    tls_args = (
        [f"--tls-cert={cert_dir / 'service.pem'}", f"--tls-key={cert_dir / 'service-key.pem'}"]
        + [f"--tls-ca={cert_dir / 'ca.pem'}", "--tls-client-auth"]
        if secure
        else []
    )
    files = _client_files(cert_dir) if secure else None
    processes: list[subprocess.Popen] = []
    relays: list[Relay] = []
    addresses: list[str] = []
    try:
        coordinator = _spawn(
            tmp_path,
            "coordinator",
            "ps_server.coordinator",
            "--port=0",
            f"--port-file={tmp_path / 'c.port'}",
            *tls_args,
        )
        processes.append(coordinator)
        address = f"127.0.0.1:{_port(tmp_path / 'c.port', coordinator)}"
        # The relays take their ports on 127.0.0.2 first; the shard listens on the same ports on 127.0.0.1.
        grpc_relay, data_relay = Relay("127.0.0.2", ("127.0.0.1", 0)), Relay("127.0.0.2", ("127.0.0.1", 0))
        relays += [grpc_relay, data_relay]
        grpc_relay.target, data_relay.target = ("127.0.0.1", grpc_relay.port), ("127.0.0.1", data_relay.port)
        shard = _spawn(
            tmp_path,
            "shard",
            "ps_server.shard",
            f"--port={grpc_relay.port}",
            f"--data-port={data_relay.port}",
            f"--port-file={tmp_path / 's.port'}",
            f"--coordinator={address}",
            "--advertise-host=127.0.0.2",
            "--device=cpu",
            *tls_args,
        )
        processes.append(shard)
        _port(tmp_path / "s.port", shard)
        addresses = [address, f"127.0.0.2:{grpc_relay.port}"]
        for each in addresses:
            tls.remember(each, files)
        spec = run_pb2.RunSpec(scheme="asgd", workers=1, steps=10, optimizer=run_pb2.OptimizerSpec(name="sgd", lr=0.1))
        weights = {"w": _tensor(1 << 20)}
        run_id, sessions, clients, _ = join_run(address, spec, weights, transport="stream")
        try:
            assert clients[0].streamed_shards == [0]  # the pull below comes on the data stream
            clients[0].register(weights)
            pulled = {"w": torch.zeros_like(weights["w"])}
            before = len(data_relay.captured())
            clients[0].pull(pulled)
            assert torch.equal(pulled["w"], weights["w"])
            assert len(data_relay.captured()) - before >= weights["w"].numel() * 4  # it did
            if secure:
                _streams_refused(addresses[1], run_id, sessions[0].worker_id, cert_dir, other_ca)
        finally:
            leave(sessions, clients)
        needle = PATTERN * 4
        for relay in relays:
            assert (needle in relay.captured()) is not secure
    finally:
        for each in addresses:
            tls.forget(each)
        for relay in relays:
            relay.close()
        for p in processes:
            p.send_signal(signal.SIGTERM)
        for p in processes:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _streams_refused(shard: str, run_id: str, worker_id: int, cert_dir: Path, other_ca: Path) -> None:
    """A stream token from a real OpenStream, presented without TLS, or with a client certificate of
    another CA: refused; with the cluster's: attached."""
    host = shard.rsplit(":", 1)[0]
    request = shard_pb2.OpenStreamRequest(run_id=run_id, worker_id=worker_id)
    with open_channel(shard) as channel:
        stub = shard_pb2_grpc.ShardServiceStub(channel)
        for files in (None, _client_files(other_ca, ca=cert_dir / "ca.pem")):
            opened = stub.OpenStream(request, timeout=5)
            with pytest.raises(StreamError):
                DataStream.connect(host, opened.port, opened.token, opened.stream, 5.0, files)
        opened = stub.OpenStream(request, timeout=5)
        DataStream.connect(host, opened.port, opened.token, opened.stream, 5.0, _client_files(cert_dir)).close()


def test_gradps_certs_writes_a_ca_and_certificates_that_fit(tmp_path: Path):
    out = tmp_path / "certs"
    result = CliRunner().invoke(cli, ["certs", "--out", str(out), "--hosts", "shard-0,10.0.0.7"])
    assert result.exit_code == 0, result.output
    for name in ("ca", "service", "client"):
        assert (out / f"{name}-key.pem").stat().st_mode & 0o077 == 0, name
        TlsFiles(out / f"{name}.pem", out / f"{name}-key.pem", out / "ca.pem").check()  # the key fits
    service = x509.load_pem_x509_certificate((out / "service.pem").read_bytes())
    names = service.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["shard-0", "localhost"]  # loopback: its own probe
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.7", "127.0.0.1", "::1"]
    context = ssl.create_default_context(cafile=str(out / "ca.pem"))
    context.load_cert_chain(out / "client.pem", out / "client-key.pem")
    again = CliRunner().invoke(cli, ["certs", "--out", str(out)])
    assert again.exit_code == 2 and "--force" in again.output.splitlines()[-1]


@pytest.mark.parametrize(
    "args, words",
    [
        (["--tls-cert=/nonexistent/service.pem"], "both a TLS certificate and its key"),
        (["--tls-client-auth"], "needs --tls-ca"),
        (["--tls-cert=/nonexistent/a.pem", "--tls-key=/nonexistent/a-key.pem"], "/nonexistent/a.pem"),
    ],
)
def test_a_service_with_unusable_tls_options_refuses_to_start_in_one_line(args: list[str], words: str):
    result = subprocess.run(
        [sys.executable, "-m", "ps_server.coordinator", "--port=0", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines[-1].startswith("Error: ") and words in lines[-1], result.stderr


def test_the_compose_tls_override_mounts_every_services_certificates(tmp_path: Path):
    """docker-compose.tls.yml over docker-compose.yml: valid (schema and Docker Compose itself), each
    service's GRADPS_TLS_* naming a secret it mounts, from the files `gradps certs` writes."""
    override = ROOT / "docker-compose.tls.yml"
    merged = merge_compose(load_yaml(BASE), load_yaml(override))
    _validate_compose(yaml.safe_dump(merged, sort_keys=False))
    certs.make_certs(tmp_path / "certs", ["coordinator", "shard-0", "shard-1"])
    assert all((tmp_path / secret["file"]).is_file() for secret in merged["secrets"].values())
    for name, service in gradps_services(merged).items():
        environment, mounted = service["environment"], {f"/run/secrets/{s}" for s in service["secrets"]}
        assert {environment[f"GRADPS_TLS_{key}"] for key in ("CA", "CERT", "KEY")} <= mounted, name
        assert (environment.get("GRADPS_TLS_CLIENT_AUTH") == "1") == (not name.startswith("worker")), name
    project = tmp_path / "project"
    shutil.copytree(tmp_path / "certs", project / "certs")
    for file in (BASE, override):
        shutil.copy(file, project / file.name)
    result = _compose_config([project / BASE.name, project / override.name], project)
    assert result.returncode == 0, result.stderr


def test_a_service_takes_its_tls_and_mtls_from_the_environment(cert_dir: Path, other_ca: Path, tmp_path: Path):
    """GRADPS_TLS_CERT/KEY/CA and GRADPS_TLS_CLIENT_AUTH=1, as the compose override sets them."""
    files = {"CA": "ca.pem", "CERT": "service.pem", "KEY": "service-key.pem"}
    env = {f"GRADPS_TLS_{key}": str(cert_dir / file) for key, file in files.items()}
    port_file = tmp_path / "c.port"
    command = [sys.executable, "-m", "ps_server.coordinator", "--port=0", f"--port-file={port_file}"]
    log = open(tmp_path / "coordinator.log", "ab")
    process = subprocess.Popen(
        command, env={**os.environ, **env, "GRADPS_TLS_CLIENT_AUTH": "1"}, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        address = f"127.0.0.1:{_port(port_file, process)}"
        assert _health(address, None, plaintext=True) == grpc.StatusCode.UNAVAILABLE
        assert _health(address, TlsFiles(ca=cert_dir / "ca.pem")) == grpc.StatusCode.UNAVAILABLE  # no certificate
        assert _health(address, _client_files(other_ca, ca=cert_dir / "ca.pem")) == grpc.StatusCode.UNAVAILABLE
        assert _health(address, _client_files(cert_dir)) == SERVING
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.mark.slow
def test_the_transport_bench_measures_each_configuration_with_and_without_tls(tmp_path: Path):
    out = tmp_path / "rows.json"
    args = ["bench", "transport", "--sizes", "1", "--shards", "1", "--workers", "1", "--transport", "stream"]
    result = CliRunner().invoke(cli, [*args, "--tls", "both", "--rounds", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    assert [(r["transport"], r["tls"]) for r in rows] == [("stream", False), ("stream", True)]
    assert all(r["gbps"] > 0 and r["seconds"] > 0 for r in rows)


# ---- the embedded cluster's own TLS: gradps up --tls, train --local --tls, launch --tls ------------


def _cli_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of a `gradps` command run as a user runs it: none of this machine's cluster
    settings, a home of its own (the token store), INFO logs, temporary folders under `tmp`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADPS_", "XDG_"))}
    (tmp / "home").mkdir(parents=True, exist_ok=True)
    (tmp / "tmp").mkdir(exist_ok=True)
    env.update(HOME=str(tmp / "home"), TMPDIR=str(tmp / "tmp"), OMP_NUM_THREADS="1", GRADPS_LOG_LEVEL="INFO")
    return {**env, **extra}


def _gradps(*args: str, env: dict[str, str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "client.cli", *args]
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _exports(lines: list[str]) -> dict[str, str]:
    """The variables of the `export A=1 B=2   # ...` lines `gradps up` prints."""
    found: dict[str, str] = {}
    for line in lines:
        if line.split()[:1] == ["export"]:
            found.update(word.split("=", 1) for word in shlex.split(line, comments=True)[1:])
    return found


def test_up_tls_serves_tls_only_and_prints_what_another_shell_needs(tmp_path: Path):
    state = tmp_path / "state"
    up = subprocess.Popen(
        [sys.executable, "-m", "client.cli", "up", "--tls", "--port", "0", "--shards", "1", "--workers", "0",
         "--device", "cpu", "--state-dir", str(state)],
        env=_cli_env(tmp_path / "up"), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    assert up.stdout is not None
    threading.Thread(target=lambda: lines.extend(iter(up.stdout.readline, "")), daemon=True).start()
    try:
        until(lambda: any("worker token" in line for line in lines) or up.poll() is not None, 90, f"{lines}")
        assert up.poll() is None, "".join(lines)
        exports = _exports(lines)
        assert exports.keys() == {"GRADPS_COORDINATOR", "GRADPS_TLS_CA", "GRADPS_TLS_CERT", "GRADPS_TLS_KEY"}, lines
        address = exports["GRADPS_COORDINATOR"]
        assert all(Path(exports[k]).parent == state / "tls" for k in exports if k.startswith("GRADPS_TLS_"))
        admin_token = re.search(r"admin token \(0600\): (\S+)", "".join(lines))
        assert admin_token, lines
        # Another shell (another home: no token store), with the lines printed and the token file.
        shell = _cli_env(tmp_path / "shell", GRADPS_TOKEN_FILE=admin_token.group(1))
        status = _gradps("status", env={**shell, **exports}, cwd=tmp_path)
        assert status.returncode == 0 and "1 live shard" in status.stdout, status.stdout + status.stderr
        plain = _gradps("status", env={**shell, "GRADPS_COORDINATOR": address}, cwd=tmp_path)
        assert plain.returncode == 1 and len(plain.stderr.strip().splitlines()) == 1, plain.stderr
        assert _health(address, None, plaintext=True) == grpc.StatusCode.UNAVAILABLE
        assert _health(address, TlsFiles(ca=Path(exports["GRADPS_TLS_CA"]))) == SERVING
        assert not (state / "tls" / "ca-key.pem").exists(), "the CA's key is kept: it could issue more"
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(timeout=30)
    assert code == 0, "".join(lines)


def test_a_clusters_own_certificates_are_kept_while_they_serve_and_made_anew_when_they_do_not(tmp_path: Path):
    folder = tmp_path / "tls"
    assert own_certs(folder) == folder
    first = (folder / "ca.pem").read_bytes()
    own_certs(folder)
    assert (folder / "ca.pem").read_bytes() == first, "a later `gradps up` keeps the CA its users trust"
    own_certs(folder, ["10.0.0.9"])  # a name the service certificate lacks: all anew
    assert (folder / "ca.pem").read_bytes() != first
    names = x509.load_pem_x509_certificate((folder / "service.pem").read_bytes()).extensions
    alt = names.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "10.0.0.9" in {str(ip) for ip in alt.get_values_for_type(x509.IPAddress)}
    TlsFiles(folder / "client.pem", folder / "client-key.pem", folder / "ca.pem").check()


@pytest.mark.slow
def test_train_local_tls_completes_on_a_cluster_that_refuses_plaintext(tmp_path: Path):
    out, env = tmp_path / "run", _cli_env(tmp_path)
    train = subprocess.Popen(
        [sys.executable, "-m", "client.cli", "train", "--local", "--tls", "--shards", "1", "--workers", "1",
         "--device", "cpu", "--steps", "300", "--eval-every", "0", "--no-progress", "--out", str(out)],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        log = out / "logs" / "coordinator.log"
        serving = lambda: re.search(r"serving on port (\d+)", log.read_text() if log.exists() else "")  # noqa: E731
        until(lambda: serving() or train.poll() is not None, 90, "the coordinator never served")
        match = serving()
        assert match, train.communicate()[0]
        address = f"127.0.0.1:{match.group(1)}"
        cas = list((tmp_path / "tmp").glob("gradps-*/tls/ca.pem"))  # the cluster's own, removed at its end
        assert len(cas) == 1, f"no CA of the cluster's own: {cas}"
        ca = cas[0]
        until(lambda: _health(address, TlsFiles(ca=ca)) == SERVING, 30, "no TLS health")
        assert _health(address, None, plaintext=True) == grpc.StatusCode.UNAVAILABLE
        assert train.poll() is None, "the run ended before the plaintext call: it proves nothing"
        output, _ = train.communicate(timeout=300)
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()
    assert train.returncode == 0, output[-3000:]
    assert json.loads((out / "summary.json").read_text())["state"] == "completed"
    assert not list((tmp_path / "tmp").glob("gradps-*")), "the certificates outlived the cluster"


@pytest.mark.slow
def test_launch_tls_gives_the_scripts_the_clusters_certificates(tmp_path: Path):
    script = tmp_path / "tiny.py"
    script.write_text(
        "import os, grpc, torch\nimport gradps\nfrom grpc_health.v1 import health_pb2, health_pb2_grpc\n\n"
        "gradps.init()\n"
        "with grpc.insecure_channel(os.environ['GRADPS_COORDINATOR']) as plain:\n"
        "    try:\n"
        "        health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)\n"
        "        print('PLAINTEXT ANSWERED')\n"
        "    except grpc.RpcError as e:\n"
        "        print('PLAINTEXT', e.code().name)\n"
        "model = torch.nn.Linear(4, 2)\n"
        "opt = gradps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model)\n"
        "for x in gradps.batches([torch.randn(8, 4)] * 3):\n"
        "    opt.zero_grad()\n"
        "    model(x).pow(2).mean().backward()\n"
        "    opt.step()\n"
    )
    out = tmp_path / "run"
    args = ["launch", "--tls", "--workers", "1", "--shards", "1", "--device", "cpu", "--steps", "3", "--no-progress"]
    result = _gradps(*args, "--out", str(out), str(script), env=_cli_env(tmp_path), cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PLAINTEXT UNAVAILABLE" in result.stdout, result.stdout[-3000:]
    assert json.loads((out / "summary.json").read_text())["state"] == "completed"


@pytest.mark.parametrize(
    "args, words",
    [
        (["train", "--coordinator", "127.0.0.1:1", "--tls"], "--tls is --local's"),
        (["launch", "--coordinator", "127.0.0.1:1", "--tls", "tests/__init__.py"], "--tls starts the local cluster"),
    ],
)
def test_tls_with_another_clusters_coordinator_is_a_one_line_usage_error(args: list[str], words: str):
    result = CliRunner().invoke(cli, args)
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and words in lines[-1], result.output
