#!/usr/bin/env python3
"""Health probe of the gradps images: their HEALTHCHECK, and the healthchecks of docker-compose.yml.

    gradps-healthcheck           grpc.health.v1 Check on 127.0.0.1:$GRADPS_PORT (coordinator, shard)
    gradps-healthcheck worker    the coordinator at $GRADPS_COORDINATOR lists a live worker named
                                 $GRADPS_WORKER_NAME (default: this host's name)
    gradps-healthcheck worker --without-token
                                 the coordinator at $GRADPS_COORDINATOR answers grpc.health.v1
                                 SERVING, reached as the worker reaches it (its TLS)

Exits 0 when healthy and 1 otherwise (Docker's contract), with one line on stderr saying why.
A worker serves no port of its own, so its health is what matters to a run: being a live member.
The list of members is an admin call, which a cluster with tokens refuses a worker's probe (a
worker holds the worker token alone): there, `--without-token` asks what every caller may ask,
the coordinator's health, over the same address and TLS that the worker's own calls take.
With GRADPS_TLS_CA set it connects in TLS, presenting GRADPS_TLS_CERT/KEY where they are set (the
service's own certificate, which `gradps certs` makes valid for loopback too).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import grpc

_TIMEOUT_S = 3.0


def _channel(address: str) -> grpc.Channel:
    """A channel to `address`, in TLS when GRADPS_TLS_CA names a CA file."""
    if not os.environ.get("GRADPS_TLS_CA"):
        return grpc.insecure_channel(address)

    def read(name: str) -> bytes | None:
        path = os.environ.get(name)
        return Path(path).read_bytes() if path else None

    credentials = grpc.ssl_channel_credentials(read("GRADPS_TLS_CA"), read("GRADPS_TLS_KEY"), read("GRADPS_TLS_CERT"))
    return grpc.secure_channel(address, credentials)


def _check_server(address: str, service: str) -> str | None:
    """None when `address` answers SERVING for `service`, else why not."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with _channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        response = health_pb2_grpc.HealthStub(channel).Check(request, timeout=_TIMEOUT_S)
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{address} is {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}"
    return None


def _check_worker(coordinator: str, name: str) -> str | None:
    """None when the coordinator lists a live worker called `name`, else why not."""
    from gradps.v1 import coordinator_pb2, coordinator_pb2_grpc

    with _channel(coordinator) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        try:
            cluster = stub.GetCluster(coordinator_pb2.GetClusterRequest(), timeout=_TIMEOUT_S)
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                raise
            return f"{e.code().name}: the worker list is an admin call; with tokens, probe with --without-token"
    if any(w.name == name and w.alive for w in cluster.workers):
        return None
    return f"coordinator {coordinator} lists no live worker named {name!r}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradps-healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", choices=["server", "worker"], default="server")
    parser.add_argument("--address", help="server mode: HOST:PORT (default 127.0.0.1:$GRADPS_PORT)")
    parser.add_argument("--service", default="", help="server mode: health service name ('' = whole server)")
    parser.add_argument("--coordinator", default=os.environ.get("GRADPS_COORDINATOR"))
    parser.add_argument("--name", default=os.environ.get("GRADPS_WORKER_NAME") or socket.gethostname())
    parser.add_argument(
        "--without-token",
        action="store_true",
        help="worker mode: the coordinator's grpc.health.v1 (open to every caller) instead of its worker list",
    )
    args = parser.parse_args(argv)
    if args.without_token and args.role != "worker":
        parser.error("--without-token is worker mode's")
    problem: str | None
    try:
        if args.role == "worker":
            if not args.coordinator:
                problem = "worker mode needs --coordinator or GRADPS_COORDINATOR"
            elif args.without_token:
                problem = _check_server(args.coordinator, "gradps.v1.CoordinatorService")
            else:
                problem = _check_worker(args.coordinator, args.name)
        else:
            port = os.environ.get("GRADPS_PORT")
            address = args.address or (f"127.0.0.1:{port}" if port else None)
            problem = _check_server(address, args.service) if address else "no --address and no GRADPS_PORT"
    except grpc.RpcError as e:
        problem = f"{e.code().name}: {e.details()}"
    except OSError as e:  # a TLS file that cannot be read
        problem = f"{e.filename}: {e.strerror or e}"
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
