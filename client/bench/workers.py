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
from dataclasses import dataclass, field

MiB = 1 << 20
# Ops a bench worker knows: asgd push then pull, and one sync step (push step t, pull t + 1).
OPS = ("push_pull", "sync_step")


@dataclass(frozen=True)
class Job:
    """What the workers of one run do."""

    run_id: str
    op: str
    size_mib: float
    # CLI codec string for the push (the pull is always `none`).
    codec: str
    warmup: int
    rounds: int
    # Iterations per round (small sizes repeat to make a round long enough to time).
    iters: int


@dataclass
class RoundTimes:
    """Per-round (start, end) of each worker and the worker's Traffic counters after the job."""

    starts: list[list[float]] = field(default_factory=list)
    ends: list[list[float]] = field(default_factory=list)
    traffic: list[dict] = field(default_factory=list)

    def seconds(self) -> list[float]:
        """Wall time of each round: first start to last end, over the workers."""
        return [max(e) - min(s) for s, e in zip(self.starts, self.ends, strict=True)]


def _run_job(index: int, session, job: Job, commands: mp.Queue, results: mp.Queue) -> None:
    """Join the job's run, time its rounds, report, and leave the run."""
    import torch

    from gpu_worker.ps_client import ParameterClient, tensor_specs
    from gradps.codecs import parse_codec
    from gradps.v1 import coordinator_pb2 as cpb
    from gradps.v1 import tensor_pb2

    assignment = None
    while assignment is None or assignment.run_id != job.run_id:
        assignment = session.wait_for_assignment(wait_s=5.0)
    n = int(job.size_mib * MiB) // 4
    generator = torch.Generator().manual_seed(index)
    params = {"params": torch.randn(n, generator=generator)}
    grads = {"params": torch.randn(n, generator=generator) * 1e-3}
    total = job.warmup + job.rounds * job.iters + 1
    placement = session.placement(job.run_id, tensor_specs(params), total)
    none = tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_NONE)
    client = ParameterClient(placement, job.run_id, session.worker_id, parse_codec(job.codec), none)
    step = 0

    def once() -> None:
        nonlocal step
        client.push(grads, step)
        if job.op == "sync_step":
            client.pull(params, min_version=step + 1)
        else:
            client.pull(params)
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
        session.report(job.run_id, cpb.Metrics(done=True, step=step, test_accuracy=-1.0))


def _worker_main(index: int, coordinator: str, commands: mp.Queue, results: mp.Queue) -> None:
    """One bench worker: join, then serve jobs until told to stop (None)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from gpu_worker.session import WorkerSession

    torch.set_num_threads(1)
    session = WorkerSession(coordinator, name=f"bench-{index}")
    results.put(("joined", index, session.worker_id))
    try:
        while (job := commands.get()) is not None:
            _run_job(index, session, job, commands, results)
    except Exception as e:  # reported to the parent, which fails the bench with it
        results.put(("error", index, f"{type(e).__name__}: {e}"))
    finally:
        session.close()


def submit_run(
    address: str, op: str, workers: int, codec: str, part_size: int, steps: int, optimizer: str = "sgd"
) -> str:
    """Submit the run a Job runs in: asgd for push_pull, sync for sync_step; returns its id."""
    from client.sdk import Client
    from gradps.codecs import parse_codec
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
        return client.submit(spec)


class BenchWorkers:
    """`count` bench worker processes joined to the coordinator at `address`."""

    def __init__(self, address: str, count: int, timeout_s: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self.timeout_s = timeout_s
        self._results = ctx.Queue()
        self._commands = [ctx.Queue() for _ in range(count)]
        self._processes = [
            ctx.Process(target=_worker_main, args=(i, address, self._commands[i], self._results), daemon=True)
            for i in range(count)
        ]
        for p in self._processes:
            p.start()
        self.pids = [p.pid for p in self._processes]
        self._early: list[list[tuple[str, object]]] = [[] for _ in range(count)]
        # The coordinator gives a run the idle workers with the lowest ids: order them by id.
        joined = dict(self._expect("joined", range(count)))
        self._order = sorted(range(count), key=lambda i: joined[i])

    def _expect(self, kind: str, indices) -> list[tuple[int, object]]:
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

    def run(self, job: Job, workers: int) -> RoundTimes:
        """Run `job` on the first `workers` workers (the run must ask for exactly that many)."""
        chosen = self._order[:workers]
        for i in chosen:
            self._commands[i].put(job)
        self._expect("ready", chosen)
        times = RoundTimes()
        for _ in range(job.rounds):
            for i in chosen:
                self._commands[i].put("go")
            spans = [span for _, span in self._expect("round", chosen)]
            times.starts.append([s for s, _ in spans])
            times.ends.append([e for _, e in spans])
        times.traffic = [t for _, t in sorted(self._expect("traffic", chosen))]
        return times

    def close(self) -> None:
        for q in self._commands:
            q.put(None)
        for p in self._processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> BenchWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
