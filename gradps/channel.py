"""The one channel and server factory: every gRPC connection in gradps is made here."""

from __future__ import annotations

import os
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

# Parts are at most the run's part size (default 4 MiB, capped at MAX_PART_BYTES), plus a little
# framing; the limit is explicit so that a misconfigured run fails with RESOURCE_EXHAUSTED rather
# than at gRPC's silent 4 MiB default.
MAX_PART_BYTES = 64 * 1024 * 1024
MAX_MESSAGE_BYTES = MAX_PART_BYTES + 1024 * 1024

_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Large streamed transfers on loopback: bigger flow-control windows cut round trips.
    ("grpc.http2.lookahead_bytes", 4 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
)


def open_channel(address: str) -> grpc.Channel:
    """A channel to `address` ("host:port") with gradps's message limits."""
    return grpc.insecure_channel(address, options=_OPTIONS)


def make_server(max_workers: int = 32) -> grpc.Server:
    """A threaded gRPC server with gradps's message limits and grpc.health.v1 registered."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=_OPTIONS)
    return server


def add_health(server: grpc.Server, service_names: list[str]) -> health.HealthServicer:
    """Serve grpc.health.v1 and mark the server and `service_names` SERVING."""
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ["", *service_names]:
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


def bind(server: grpc.Server, port: int) -> int:
    """Bind `[::]:port` (0 picks a free port) and return the bound port."""
    bound = server.add_insecure_port(f"[::]:{port}")
    if bound == 0:
        raise OSError(f"cannot bind port {port}")
    return bound


def write_port_file(path: str | None, port: int) -> None:
    """Write the bound port to `path` atomically, so a parent process never reads half a number."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, path)


def serve_until_signal(server: grpc.Server) -> None:
    """Block until SIGTERM/SIGINT, then stop gracefully."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=2).wait()
