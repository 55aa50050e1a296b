"""Bench worker processes: each joins a cluster as a worker and drives a ParameterClient on command.

The parent submits a run, tells the workers its shape (a flat float32 parameter set of N MiB),
then starts timed rounds. Every round starts when the parent says so, on all workers at once;
its time is from the first worker's start to the last worker's end (`time.perf_counter` is
CLOCK_MONOTONIC on Linux, so timestamps compare across processes).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradps.auth.tls import TlsFiles
    from gradps.netem import Host
    from gradps.worker_session import WorkerSession

MiB = 1 << 20


@dataclass(frozen=True)
class Job:
    """What the workers of one run do."""

    run_id: str
    # push_pull (asgd: push, then pull) or sync_step (sync: push step t, pull the weights of t + 1).
    op: str
    size_mib: float
    # CLI codec string for the push.
    codec: str
    warmup: int
    rounds: int
    # Iterations per round (small sizes repeat to make a round long enough to time).
    iters: int
    # Where payloads travel (gradps.transport.TRANSPORTS): shared memory, data streams, or
    # the gRPC messages; or "colocated": shared memory with shard rank % shards, data streams with
    # the others. The bench checks that every shard got what was asked.
    transport: str = "shm"
    # Where the worker's parameters and gradients live.
    device: str = "cpu"
    # CLI codec string for the pull (the weights), e.g. "bf16".
    pull_codec: str = "none"


def _run_job(
    index: int, session: WorkerSession, job: Job, commands: mp.Queue, results: mp.Queue, host: Host | None
) -> None:
    """Join the job's run, time its rounds, report, and leave the run. On an emulated `host`,
    "shm" takes shared memory with the shards of its host only, data streams to the others."""
    import torch

    from client.bench.options import COLOCATED
    from gradps.codec_table import parse_codec
    from gradps.parameter_client import ParameterClient, tensor_specs
    from gradps.v1 import coordinator_pb2 as cpb

    assignment = None
    while assignment is None or assignment.run_id != job.run_id:
        assignment = session.wait_for_assignment(wait_s=5.0)
    n = int(job.size_mib * MiB) // 4
    generator = torch.Generator().manual_seed(index)
    params = {"params": torch.randn(n, generator=generator).to(job.device)}
    grads = {"params": (torch.randn(n, generator=generator) * 1e-3).to(job.device)}
    total = job.warmup + job.rounds * job.iters  # the run's steps: done after the last one
    placement = session.placement(job.run_id, tensor_specs(params), total)
    owners = sorted({p.shard for p in placement.parts})
    local, wanted = _expected_routes(job, assignment.rank, list(placement.shards), owners, host)
    client = ParameterClient(
        placement,
        job.run_id,
        session.worker_id,
        parse_codec(job.codec),
        parse_codec(job.pull_codec),
        transport="shm" if job.transport == COLOCATED else job.transport,
        local_shards=local,
    )
    got = {"shm": client.shared_shards, "stream": client.streamed_shards, "grpc": owners}
    if any(got[t] != shards for t, shards in wanted.items()):
        raise RuntimeError(f"{job.transport}: shards {got}, expected {wanted}")
    step = 0

    def once() -> None:
        # As the schemes exchange: one PushPull call per shard, each shard's pull right after its
        # push (sync: once the step is complete there).
        nonlocal step
        client.push_pull(grads, step, params, min_version=step + 1 if job.op == "sync_step" else 0)
        step += 1

    try:
        client.register(params)
        for _ in range(job.warmup):
            once()
        results.put(("ready", index, None))
        for _ in range(job.rounds):
            if commands.get() != "go":
                raise RuntimeError("bench worker: expected 'go'")
            start = time.perf_counter()
            for _ in range(job.iters):
                once()
            results.put(("round", index, (start, time.perf_counter())))
        results.put(("traffic", index, dict(vars(client.traffic))))
    finally:
        client.close()
        # Done only after the run's last step (the coordinator refuses an early done); cut short, failed.
        ended = {"done": True} if step >= total else {"error": f"bench worker stopped at step {step} of {total}"}
        session.report(job.run_id, cpb.Metrics(step=step, test_accuracy=-1.0, **ended))


def _expected_routes(
    job: Job, rank: int, shards: list[str], owners: list[int], host: Host | None
) -> tuple[list[int] | None, dict[str, list[int]]]:
    """The shards a worker may share memory with (None: any that maps its segment), and the shards
    each route must reach ("shm", "stream", "grpc"), which the bench checks."""
    from client.bench.options import COLOCATED

    if job.transport == COLOCATED:
        local = [rank % len(shards)]
        return local, {"shm": [s for s in owners if s in local], "stream": [s for s in owners if s not in local]}
    if host and job.transport == "shm":
        # Each shard maps a segment only for a process of its own host.
        here = [s for s in owners if shards[s].rsplit(":", 1)[0] == host.address]
        return None, {"shm": here, "stream": [s for s in owners if s not in here]}
    return None, {job.transport: owners}


def _worker_main(
    index: int,
    coordinator: str,
    commands: mp.Queue,
    results: mp.Queue,
    tls: TlsFiles | None = None,
    metrics: bool = False,
    host: Host | None = None,
) -> None:
    """One bench worker: join, then serve jobs until told to stop (None); with `tls`, every
    connection (to the coordinator, to the shards, data streams) in TLS; with `metrics`, serving
    Prometheus metrics on a free loopback port, as a worker service does; on `host` of an
    emulated network."""
    if host:
        host.enter()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from gradps.auth.tls import set_process_tls
    from gradps.worker_session import WorkerSession

    set_process_tls(tls)
    if metrics:
        from gradps.channel import serve_metrics

        serve_metrics(0, "127.0.0.1", None)

    torch.set_num_threads(1)
    session = WorkerSession(coordinator, name=f"bench-{index}")
    results.put(("joined", index, session.worker_id))
    try:
        while (job := commands.get()) is not None:
            _run_job(index, session, job, commands, results, host)
    except Exception as e:  # reported to the parent, which fails the bench with it
        results.put(("error", index, f"{type(e).__name__}: {e}"))
    finally:
        session.close()


def submit_run(
    address: str, op: str, workers: int, codec: str, part_size: int, steps: int, optimizer: str = "sgd"
) -> str:
    """Submit the run a Job runs in, once every worker is idle: asgd for push_pull, sync for
    sync_step; returns its id."""
    from client.sdk import Client
    from gradps.codec_table import parse_codec
    from gradps.v1 import run_pb2

    spec = run_pb2.RunSpec(
        scheme="sync" if op == "sync_step" else "asgd",
        workers=workers,
        steps=steps,
        part_size=part_size,
        codec=parse_codec(codec),
        eval_every=0,
        optimizer=run_pb2.OptimizerSpec(name=optimizer, lr=0.01),
    )
    with Client(address) as client:
        # The coordinator gives a run the lowest idle ids, and BenchWorkers starts the job on those:
        # a worker still leaving the previous run would make it pick another one.
        deadline = time.monotonic() + 60
        while any(w.alive and w.run_id for w in client.cluster().workers):
            if time.monotonic() > deadline:
                raise RuntimeError("bench workers still busy with an earlier run after 60 s")
            time.sleep(0.02)
        return client.submit(spec)


class BenchWorkers:
    """`count` bench worker processes joined to the coordinator at `address` (in TLS with `tls`),
    worker i on `hosts[i]` where given."""

    def __init__(
        self,
        address: str,
        count: int,
        timeout_s: float = 300.0,
        tls: TlsFiles | None = None,
        metrics: bool = False,
        hosts: list[Host] | None = None,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.timeout_s = timeout_s
        self._results = ctx.Queue()
        self._commands = [ctx.Queue() for _ in range(count)]
        self._processes = [
            ctx.Process(
                target=_worker_main,
                args=(i, address, self._commands[i], self._results, tls, metrics, hosts[i] if hosts else None),
                daemon=True,
            )
            for i in range(count)
        ]
        for p in self._processes:
            p.start()
        self.pids = [p.pid for p in self._processes]
        self._early: list[list[tuple[str, Any]]] = [[] for _ in range(count)]
        self._chosen: list[int] = []
        # The coordinator gives a run the idle workers with the lowest ids: order them by id.
        joined = dict(self._expect("joined", range(count)))
        self._order = sorted(range(count), key=lambda i: joined[i])

    def _expect(self, kind: str, indices: Iterable[int]) -> list[tuple[int, Any]]:
        """Wait for the next message of each worker in `indices`, which must be a `kind`.

        A worker may run ahead (its next message arrives while others are still awaited): what
        arrives early is kept for the next call.
        """
        waiting = set(indices)
        got = []
        deadline = time.monotonic() + self.timeout_s
        while waiting:
            ready = [i for i in waiting if self._early[i]]
            for index in ready:
                what, value = self._early[index].pop(0)
                if what == "error":
                    raise RuntimeError(f"bench worker {index}: {value}")
                if what != kind:
                    raise RuntimeError(f"bench worker {index}: expected {kind!r}, got {what!r}")
                waiting.discard(index)
                got.append((index, value))
            if not waiting:
                break
            try:
                what, index, value = self._results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                dead = [i for i in waiting if not self._processes[i].is_alive()]
                raise RuntimeError(f"bench workers {sorted(waiting)} did not answer (dead: {dead})") from None
            self._early[index].append((what, value))
        return got

    def start(self, job: Job, workers: int) -> None:
        """Start `job` on the first `workers` workers (the run must ask for exactly that many):
        they join the run, register and warm up, then wait for `round()`."""
        self._chosen = self._order[:workers]
        for i in self._chosen:
            self._commands[i].put(job)
        self._expect("ready", self._chosen)

    def round(self) -> float:
        """One timed round of the started job on all its workers at once: seconds from the first
        worker's start to the last worker's end."""
        for i in self._chosen:
            self._commands[i].put("go")
        spans = [span for _, span in self._expect("round", self._chosen)]
        return max(e for _, e in spans) - min(s for s, _ in spans)

    def finish(self) -> list[dict]:
        """After the job's last round: each worker's Traffic counters (as dicts)."""
        return [t for _, t in sorted(self._expect("traffic", self._chosen))]

    def close(self) -> None:
        for q in self._commands:
            q.put(None)
        for p in self._processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> BenchWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
