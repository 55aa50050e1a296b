"""The one channel and server factory: every gRPC connection in gradps is made here."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import signal
import threading
import time
from collections.abc import Callable

import click
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gradps.auth.access import AuthInterceptor
from gradps.auth.client_tokens import TokenSource, client_token, with_token
from gradps.auth.limits import DEFAULT_MAX_CALLS_PER_CALLER, CallLimitInterceptor
from gradps.auth.tls import TlsFiles, channel_credentials, client_tls, server_credentials
from gradps.auth.tokens import ClusterSecret
from gradps.errors import StatusInterceptor
from gradps.metrics import ServerMetricsInterceptor, serving_metrics, start_endpoint
from gradps.serving import Server

# Parts are at most the run's part size (default 4 MiB, capped at MAX_PART_BYTES), plus a little
# framing; the limit is explicit so that a misconfigured run fails with RESOURCE_EXHAUSTED rather
# than at gRPC's silent 4 MiB default.
MAX_PART_BYTES = 64 * 1024 * 1024
MAX_MESSAGE_BYTES = MAX_PART_BYTES + 1024 * 1024
# Services listen on loopback unless told otherwise (--bind): reachable from the network only
# on purpose, and then with a cluster secret (gradps.auth).
DEFAULT_BIND = "127.0.0.1"

_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Large streamed transfers on loopback: bigger flow-control windows cut round trips.
    ("grpc.http2.lookahead_bytes", 4 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
    # A restarted service (a shard, the coordinator) is found again within a second: gRPC's
    # default reconnect backoff grows to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


# glibc malloc (mallopt parameter numbers from malloc.h): every message of a part is a few MiB, and
# by default glibc serves each such buffer with a fresh mmap and returns it with munmap, so every
# byte received or sent page-faults into zeroed memory first; it also trims the heap as soon as
# its top is free. Keeping those buffers in the heap and the heap in place makes push + pull ~1.5x
# faster on loopback (docs/performance.md). Freed buffers then stay resident, so all threads share
# one arena: with one arena per gRPC thread, each would keep its own peak (1.7x the memory).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
_MALLOC_OPTIONS = (
    (_M_ARENA_MAX, 1),
    (_M_MMAP_THRESHOLD, 256 << 20),
    (_M_TRIM_THRESHOLD, 512 << 20),
    (_M_TOP_PAD, 64 << 20),
)
_allocator_tuned = False


def tune_allocator() -> bool:
    """Apply the malloc settings above to this process, once; False where it is not glibc.

    `GRADPS_MALLOC_DEFAULTS=1` leaves the allocator alone (to measure the difference).
    """
    global _allocator_tuned
    if _allocator_tuned:
        return True
    if os.environ.get("GRADPS_MALLOC_DEFAULTS") == "1":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    _allocator_tuned = all(mallopt(param, value) == 1 for param, value in _MALLOC_OPTIONS)
    return _allocator_tuned


def open_channel(
    address: str, token: TokenSource = None, tls: TlsFiles | None = None, *, in_caller_thread: bool = False
) -> grpc.Channel:
    """A channel to `address` ("host:port") with gradps's message limits, sending `token` (a
    string, or a function asked per call) as `authorization: Bearer` with every call; without one,
    `gradps.auth.client_tokens.client_token` finds it (GRADPS_TOKEN, GRADPS_TOKEN_FILE, ...).
    TLS with `tls`; without, where `gradps.auth.tls.client_tls` finds it (GRADPS_TLS_CA, ...).
    `in_caller_thread`: its server-streaming calls are read in the thread that iterates them, as
    unary calls are, rather than through a thread grpcio starts whenever the channel's first
    call begins (a thread per call where calls follow one another); such a call must then be
    read and cancelled by that thread only."""
    tune_allocator()
    tls = tls or client_tls(address)
    # A connection of its own: a service counts a caller's calls by connection (without a
    # worker's token), and gRPC would otherwise share one between every channel to an address.
    options: tuple[tuple[str, object], ...] = (*_OPTIONS, ("grpc.use_local_subchannel_pool", 1))
    if in_caller_thread:
        options += ((grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),)
    if tls is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        channel = grpc.secure_channel(address, channel_credentials(tls), options=options)
    return with_token(channel, token if token is not None else client_token(address))


def make_server(
    max_workers: int = 32,
    secret: ClusterSecret | None = None,
    max_calls_per_caller: int = DEFAULT_MAX_CALLS_PER_CALLER,
) -> Server:
    """A gRPC server (gradps.serving: its waiting calls hold no thread, its handlers run on
    `max_workers` threads) with gradps's message limits, whose handlers refuse a request by
    raising a `gradps.errors.GradpsError` (StatusInterceptor); health is added by `add_health`.
    In a process that serves metrics (`serve_metrics` first), every call is counted for
    Prometheus (gradps.metrics), outermost so that its code is the one the client sees. With
    `secret`, every call but health checks needs a token of a role that may make it
    (gradps.auth.access.AuthInterceptor); without, every call is accepted. One caller has at
    most `max_calls_per_caller` calls in flight, and never more than half of the server's
    `max_workers` threads (gradps.auth.limits, inside the token check): one caller never holds
    every thread."""
    tune_allocator()
    auth = (AuthInterceptor(secret),) if secret is not None else ()
    counted = (ServerMetricsInterceptor(),) if serving_metrics() else ()
    limit = CallLimitInterceptor(min(max_calls_per_caller, max(1, max_workers // 2)))
    interceptors = (*counted, *auth, limit, StatusInterceptor())
    return Server(max_workers, interceptors, _OPTIONS)


def add_health(server: Server, service_names: list[str]) -> health.HealthServicer:
    """Serve grpc.health.v1 and mark the server and `service_names` SERVING."""
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ["", *service_names]:
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


def bind(server: Server, port: int, host: str = DEFAULT_BIND, tls: TlsFiles | None = None) -> int:
    """Bind `host:port` (0 picks a free port) and return the bound port; OSError if it cannot.
    With `tls`, the port serves TLS only, its certificate read again when its files change
    (gradps.auth.tls.server_credentials; TlsError when they cannot be used)."""
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host  # an IPv6 address
    try:
        if tls is not None:
            bound = server.add_secure_port(f"{host}:{port}", server_credentials(tls))
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio >= 1.5x raises where older versions returned 0
        bound = 0
    if bound == 0:
        raise OSError(f"cannot bind port {port}: in use, or not permitted")
    return bound


def write_port_file(path: str | None, port: int) -> None:
    """Write the bound port to `path` atomically, so a parent process never reads half a number."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, path)


def port_option(default: int) -> Callable:
    """A service's `--port` (GRADPS_PORT): a TCP port, 0 for any free one."""
    return click.option(
        "--port",
        envvar="GRADPS_PORT",
        show_envvar=True,
        default=default,
        type=click.IntRange(0, 65535),
        help="Port to bind (0: any free).",
    )


def bind_option(fn: Callable) -> Callable:
    """A service's `--bind` (GRADPS_BIND, the parameter `bind_address`): where its gRPC port listens."""
    return click.option(
        "--bind",
        "bind_address",
        envvar="GRADPS_BIND",
        show_envvar=True,
        default=DEFAULT_BIND,
        help="Address to listen on: 127.0.0.1 serves this machine only; [::] or 0.0.0.0 every interface "
        "(which needs a cluster secret, or --insecure).",
    )(fn)


def coordinator_option(fn: Callable) -> Callable:
    """A shard's or worker's `--coordinator` (GRADPS_COORDINATOR): HOST:PORT, required."""
    return click.option(
        "--coordinator", envvar="GRADPS_COORDINATOR", show_envvar=True, required=True, help="Coordinator HOST:PORT."
    )(fn)


def _port_file(ctx: click.Context, param: click.Parameter, path: str | None) -> str | None:
    folder = os.path.dirname(path or "") or "."
    if path and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
        raise click.BadParameter(f"cannot write a file in {folder}", ctx, param)
    return path


def port_file_option(fn: Callable) -> Callable:
    """A service's `--port-file` (GRADPS_PORT_FILE), its folder checked before the service starts."""
    return click.option(
        "--port-file",
        envvar="GRADPS_PORT_FILE",
        show_envvar=True,
        default=None,
        callback=_port_file,
        help="Write the bound port here.",
    )(fn)


def metrics_options(fn: Callable) -> Callable:
    """A service's Prometheus endpoint: `--metrics-port` (GRADPS_METRICS_PORT), `--metrics-host`
    (GRADPS_METRICS_HOST) and `--metrics-port-file` (GRADPS_METRICS_PORT_FILE). Off by default
    (many services share one host in a local cluster, and a fixed port would collide), and on
    loopback unless told otherwise, like the gRPC port."""
    options = (
        click.option(
            "--metrics-port",
            envvar="GRADPS_METRICS_PORT",
            show_envvar=True,
            default=-1,
            type=click.IntRange(-1, 65535),
            help="Serve Prometheus metrics on http://HOST:PORT/metrics (0: any free port, -1: off).",
        ),
        click.option(
            "--metrics-host",
            envvar="GRADPS_METRICS_HOST",
            show_envvar=True,
            default=DEFAULT_BIND,
            help="Address the metrics endpoint listens on: 127.0.0.1 serves this machine only, :: every interface.",
        ),
        click.option(
            "--metrics-port-file",
            envvar="GRADPS_METRICS_PORT_FILE",
            show_envvar=True,
            default=None,
            callback=_port_file,
            help="Write the metrics endpoint's bound port here.",
        ),
    )
    for option in reversed(options):
        fn = option(fn)
    return fn


def serve_metrics(port: int, host: str, port_file: str | None) -> int | None:
    """Start the metrics endpoint the options above name (None when off); its bound port is
    written to `port_file`. A click usage error when the port cannot be bound."""
    if port < 0:
        return None
    try:
        bound = start_endpoint(port, host)
    except OSError as e:
        raise click.UsageError(f"--metrics-port {port} on {host}: {e.strerror or e}") from None
    write_port_file(port_file, bound)
    return bound


def time_left(end: float) -> float:
    """Seconds until the monotonic time `end`, at least 0."""
    return max(0.0, end - time.monotonic())


def wait_for_call(
    cond: threading.Condition,
    ready: Callable[[], bool],
    timeout_s: float,
    context: grpc.ServicerContext,
    slice_s: float = 0.25,
) -> bool:
    """`cond.wait_for(ready, timeout_s)` for a handler (`cond` held) that also gives up, False, once
    its call ended (the client cancelled, or the call's deadline passed): it wakes every `slice_s`
    to look, so a server thread never waits out a long poll for a client that is gone."""
    end = time.monotonic() + timeout_s
    while not ready():
        remaining = context.time_remaining()
        left = min(end - time.monotonic(), math.inf if remaining is None else remaining)
        if left <= 0 or not context.is_active():
            return False
        cond.wait(min(slice_s, left))
    return True


def stop_on_signal() -> threading.Event:
    """An event set once the process gets SIGTERM or SIGINT (call from the main thread).

    The kernel may deliver a signal to any thread, and Python runs a signal's handler only when
    its main thread next runs Python code: a main thread blocked in a wait may never do so (a
    service then never stops). The interpreter's own C handler, though, writes the signal's
    number to the wakeup fd at once, whichever thread it interrupted: a thread of its own,
    blocked reading that pipe, sets the event."""
    stop = threading.Event()
    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake, warn_on_full_buffer=False)
    stopping = (signal.SIGTERM, signal.SIGINT)
    for sig in stopping:
        signal.signal(sig, _noticed_by_wakeup_fd)

    def watch() -> None:
        while os.read(woken, 1)[0] not in stopping:  # another signal Python handles
            pass
        stop.set()

    threading.Thread(target=watch, name="signals", daemon=True).start()
    return stop


def _noticed_by_wakeup_fd(signum: int, _frame: object) -> None:
    """In place of the default action (end the process, or KeyboardInterrupt): the wakeup fd
    has told the watcher."""


def serve_until_signal(server: Server) -> None:
    """Block until SIGTERM/SIGINT, then stop gracefully."""
    stop_on_signal().wait()
    server.stop(grace=2).wait()
