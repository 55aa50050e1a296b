"""One run of any scheme driven by many lightweight workers in the test process (each a real
session and parameter client over real sockets to the real coordinator and shards), with the
services' threads, file descriptors, health and GetCluster answer times sampled while it runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.local_cluster import LocalCluster
from client.sdk import Client, run_spec
from gradps.channel import open_channel
from gradps.parameter_client import ParameterClient
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import coordinator_pb2_grpc
from tests.joined_run import join_run, leave

LR = 0.5
SIZE = 1024  # elements per tensor: a small model, so that the load is the calls, not the bytes
Tensors = dict[str, torch.Tensor]


@dataclass
class Sampled:
    """The most seen of each service while the run went on, and what went wrong."""

    threads: dict[str, int] = field(default_factory=dict)
    fds: dict[str, int] = field(default_factory=dict)
    slowest_get_cluster_s: float = 0.0
    failed_health_checks: int = 0
    health_checks: int = 0


@dataclass
class LoadResult:
    scheme: str
    workers: int
    steps: int
    seconds: float
    pulls_s: list[float]
    pushes_s: list[float]
    final: list[Tensors]
    start: Tensors
    sampled: Sampled

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds

    def p99(self, times: list[float]) -> float:
        ordered = sorted(times) or [0.0]
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]

    def line(self) -> str:
        threads = ", ".join(f"{k} {v}" for k, v in sorted(self.sampled.threads.items()))
        fds = ", ".join(f"{k} {v}" for k, v in sorted(self.sampled.fds.items()))
        pull, push = 1e3 * self.p99(self.pulls_s), 1e3 * self.p99(self.pushes_s)
        return (
            f"{self.scheme}, {self.workers} workers: {self.steps_per_s:.2f} steps/s, "
            f"p99 pull {pull:.0f} ms, p99 push {push:.0f} ms; threads {threads}; fds {fds}; "
            f"slowest GetCluster {1e3 * self.sampled.slowest_get_cluster_s:.0f} ms; "
            f"health checks failed {self.sampled.failed_health_checks} of {self.sampled.health_checks}"
        )


def _proc_threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def _sample(cluster: LocalCluster, addresses: dict[str, str], sampled: Sampled, stop: threading.Event) -> None:
    pids = {"coordinator": cluster.coordinator.pid} if cluster.coordinator else {}
    pids |= {f"shard{i}": p.pid for i, p in enumerate(cluster.shards)}
    channels = {name: grpc.insecure_channel(address) for name, address in addresses.items()}
    health = {name: health_pb2_grpc.HealthStub(c) for name, c in channels.items()}
    with open_channel(cluster.address) as channel:
        coordinator = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        while True:  # once at the start (a short run may end before a second look), then every 0.5 s
            for name, pid in pids.items():
                sampled.threads[name] = max(sampled.threads.get(name, 0), _proc_threads(pid))
                sampled.fds[name] = max(sampled.fds.get(name, 0), len(list(Path(f"/proc/{pid}/fd").iterdir())))
            began = time.perf_counter()
            coordinator.GetCluster(cpb.GetClusterRequest(), timeout=30)
            sampled.slowest_get_cluster_s = max(sampled.slowest_get_cluster_s, time.perf_counter() - began)
            for stub in health.values():
                sampled.health_checks += 1
                try:
                    answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    sampled.failed_health_checks += answer.status != health_pb2.HealthCheckResponse.SERVING
                except grpc.RpcError:
                    sampled.failed_health_checks += 1
            if stop.wait(0.5):
                break
    for c in channels.values():
        c.close()


Beside = Callable[[str, list[int], list[str]], Callable[[], None]]


def _step(
    scheme: str, client: ParameterClient, step: int, last: bool, grad: Tensors, into: Tensors, group: list[int]
) -> tuple[float, float]:
    """One step as the scheme's worker makes it (gpu_worker/schemes/): (pull, push) seconds,
    where a combined call counts as a pull (it waits for the step)."""
    began = time.perf_counter()
    if scheme == "sync":
        client.push_pull(grad, step, into, min_version=step + 1)
    elif scheme == "asgd":
        client.push_pull(grad, step, into)
    elif scheme == "ssp":
        client.push_pull(grad, step, into, clock=step + 1)
    elif scheme == "pseudosync":
        client.push(grad, step)
        pushed = time.perf_counter()
        client.pull_gradient(step, into)
        return time.perf_counter() - pushed, pushed - began
    elif scheme == "wagma":  # pairs, and a global round (every member waits for all) at the end
        average, _ = client.group_average(into, step, group, is_global=last)
        for name, t in into.items():
            t.copy_(average[name]).sub_(grad[name], alpha=LR)
    return time.perf_counter() - began, 0.0


def scheme_load(
    cluster: LocalCluster, scheme: str, workers: int, steps: int, beside: Beside | None = None
) -> LoadResult:
    """`steps` steps of `scheme` by `workers` workers, each making the calls its scheme's worker
    makes; `beside(run_id, worker_ids, addresses of the shards holding its parts)`, when given,
    starts more load for the run and returns how to stop it."""
    seeded = torch.Generator().manual_seed(1)
    start = {name: torch.randn(SIZE, generator=seeded) for name in ("a", "b", "c", "d")}
    # One part per tensor (4 KiB), so that the parts spread over the shards.
    spec = run_spec(scheme, workers=workers, steps=steps, eval_every=0, optimizer="sgd", lr=LR, part_size=4 * SIZE)
    run_id, sessions, clients, placement = join_run(cluster.address, spec, start, workers, transport="grpc")
    with Client(cluster.address) as client:
        addresses = {f"shard{i}": address for i, address in enumerate(client.cluster().shards)}
    addresses["coordinator"] = cluster.address
    ids = [session.worker_id for session in sessions]
    sampled, stop = Sampled(), threading.Event()
    sampler = threading.Thread(target=_sample, args=(cluster, addresses, sampled, stop), daemon=True)
    pulls, pushes = [], []
    try:
        clients[0].register(start)
        holding = sorted({placement.shards[p.shard] for p in placement.parts})
        stop_beside = beside(run_id, ids, holding) if beside else None
        sampler.start()

        def work(i: int) -> Tensors:
            grad = {n: torch.full((SIZE,), float(i % 2)) for n in start}
            into = {n: t.clone() for n, t in start.items()}
            pair = sorted({ids[i], ids[i ^ 1 if i ^ 1 < workers else i]})
            for step in range(steps):
                last = step == steps - 1
                pulled, pushed = _step(scheme, clients[i], step, last, grad, into, ids if last else pair)
                pulls.append(pulled)
                if pushed:
                    pushes.append(pushed)
            return into

        began = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            final = list(pool.map(work, range(workers)))
        seconds = time.perf_counter() - began
        if stop_beside:
            stop_beside()
    finally:
        stop.set()
        if sampler.is_alive():
            sampler.join(timeout=60)
        leave(sessions, clients)
    return LoadResult(scheme, workers, steps, seconds, pulls, pushes, final, start, sampled)


def ends_exact(result: LoadResult) -> bool:
    """Whether every worker ended with the weights of plain SGD on the mean gradient (half the
    workers push ones, half zeros: exactly 0.5) at every step, bit for bit (a sync run)."""
    mean = sum(i % 2 for i in range(result.workers)) / result.workers
    weights = {n: t.clone() for n, t in result.start.items()}
    for _ in range(result.steps):
        for t in weights.values():
            t.sub_(torch.full_like(t, mean), alpha=LR)
    return all(all(torch.equal(w[n], weights[n]) for n in weights) for w in result.final)
