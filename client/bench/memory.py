"""`gradps bench memory`: a shard's peak memory while workers push and pull, against what it must
hold: its parameters, their optimizer state and one in-flight push per worker.

With shared-memory payloads the shard maps each worker's segment (gradps/shared_memory.py). Those
pages are the worker's, allocated once on the host, but they count in the shard's resident set
(and its VmHWM) once touched; they are reported apart, as `shared_mib`, and left out of `used`.
Every page of a segment is touched in the first iteration and stays mapped until the run ends, so
the shared resident set read after the last round is the one that was there at the peak.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from client.bench.display import ProgressLine, short_rows
from client.bench.options import json_option, parse_choices, parse_counts, transport_option, write_json
from client.bench.workers import BenchWorkers, Job, submit_run
from client.local_cluster import LocalCluster
from client.terminal import table_console
from client.usage import one_line_errors
from gradps.placement import DEFAULT_PART_SIZE

MiB = 1 << 20
# Optimizer state, in copies of the parameters: plain SGD (no momentum) keeps none, Adam two moments.
_STATE = {"sgd": 0, "adam": 2}


@dataclass
class MemoryRow:
    """One configuration on a fresh single-shard cluster."""

    op: str
    size_mib: float
    workers: int
    optimizer: str
    # Where payloads travel: shm (shared memory) or grpc (in the messages).
    transport: str
    # Resident memory of the shard process after start-up, and its peak (VmHWM) over the run.
    baseline_mib: float
    peak_mib: float
    # The workers' shared segments resident in the shard at the end of the run (shm only).
    shared_mib: float
    # peak - shared - baseline, and what the shard must hold: params + optimizer state + workers * push.
    used_mib: float
    expected_mib: float
    ratio: float


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def _reset_peak(pid: int) -> None:
    """Reset the process's VmHWM to its current RSS (Linux >= 4.0)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def _run(
    bench_workers: BenchWorkers,
    address: str,
    op: str,
    size_mib: float,
    workers: int,
    optimizer: str,
    transport: str,
    rounds: int,
    shard_pid: int,
) -> int:
    """Run the job; the shard's shared resident KiB after the last round (segments still mapped)."""
    run_id = submit_run(address, op, workers, "none", DEFAULT_PART_SIZE, 2 + rounds, optimizer)
    job = Job(run_id, op, size_mib, "none", warmup=2, rounds=rounds, iters=1, transport=transport)
    bench_workers.start(job, workers)
    for _ in range(rounds):
        bench_workers.round()
    shared = _status_kib(shard_pid, "RssShmem")
    bench_workers.finish()
    return shared


def measure_memory(
    size_mib: float,
    workers: int,
    optimizer: str,
    op: str = "push_pull",
    transport: str = "shm",
    rounds: int = 3,
) -> MemoryRow:
    """Peak memory of the one shard of a fresh cluster while `workers` push and pull `size_mib`."""
    with LocalCluster(shards=1, workers=0) as cluster, BenchWorkers(cluster.address, workers) as bench_workers:
        pid = cluster.shards[0].pid
        # A tiny run first: the shard's first run loads code (torch.optim's first optimizer alone
        # is ~70 MiB), which is start-up, not a cost of the parameters.
        _run(bench_workers, cluster.address, op, 0.01, workers, optimizer, transport, 1, pid)
        _reset_peak(pid)
        baseline = _status_kib(pid, "VmRSS") - _status_kib(pid, "RssShmem")
        shared = _run(bench_workers, cluster.address, op, size_mib, workers, optimizer, transport, rounds, pid)
        peak = _status_kib(pid, "VmHWM")
    used = (peak - shared - baseline) / 1024
    expected = size_mib * (1 + _STATE[optimizer]) + workers * size_mib
    return MemoryRow(
        op, size_mib, workers, optimizer, transport, baseline / 1024, peak / 1024, shared / 1024, used, expected,
        used / expected,
    )  # fmt: skip


def print_rows(rows: list[MemoryRow], console: Console) -> None:
    """The rows as a table; a long matrix shortened to the largest worker count, with a line
    saying so (`--json FILE` keeps every row)."""
    shown, note = short_rows(rows, lambda r: r.workers, lambda workers: f"{workers:g}-worker")
    table = Table(
        "op", "MiB", "workers", "optimizer", "via", "baseline MiB", "peak MiB", "shared MiB", "used MiB",
        "expected MiB", "used / expected",
        title="gradps bench memory: shard peak (VmHWM) - workers' shared segments - start-up RSS\n"
        "vs params + optimizer state + workers x push",
    )  # fmt: skip
    for r in shown:
        table.add_row(
            r.op,
            f"{r.size_mib:g}",
            str(r.workers),
            r.optimizer,
            r.transport,
            f"{r.baseline_mib:.0f}",
            f"{r.peak_mib:.0f}",
            f"{r.shared_mib:.0f}",
            f"{r.used_mib:.0f}",
            f"{r.expected_mib:.0f}",
            f"{r.ratio:.2f}",
        )
    console.print(table)
    if note:
        console.print(note)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--size", "size_mib", default=64.0, type=click.FloatRange(min=0.001), help="Parameter set, MiB.")
@click.option("--workers", "worker_counts", default="1,2", callback=parse_counts, help="Worker counts.")
@click.option(
    "--optimizer", "opt_names", default="sgd,adam", callback=parse_choices(tuple(_STATE)), help="sgd and/or adam."
)
@click.option(
    "--op",
    "op_names",
    default="push_pull,sync_step",
    callback=parse_choices(("push_pull", "sync_step")),
    help="push_pull (asgd) and/or sync_step (sync).",
)
@transport_option()
@json_option()
@one_line_errors
def memory(
    size_mib: float,
    worker_counts: list[int],
    opt_names: list[str],
    op_names: list[str],
    transports: list[str],
    json_path: Path | None,
) -> None:
    """Shard peak memory vs params + optimizer state + one in-flight push per worker."""
    console = Console(stderr=True)
    configurations = [
        (op, opt, w, transport)
        for op in op_names
        for opt in opt_names
        for w in worker_counts
        for transport in transports
        if not (op == "sync_step" and w < 2)
    ]
    rows = []
    with ProgressLine(console, len(configurations), "starting") as progress:
        for op, opt, w, transport in configurations:
            progress.measuring(f"{op} {size_mib:g} MiB, {w} worker{'s' * (w > 1)}, {opt}, {transport}")
            rows.append(measure_memory(size_mib, w, opt, op, transport))
            progress.done()
    print_rows(rows, table_console())
    if json_path:
        write_json(json_path, [asdict(r) for r in rows], console)
