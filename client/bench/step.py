"""`gradps bench step`: one training step of a real run, broken down into compute and each part
of the exchange with the shards, and how much of the communication overlapped compute."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from client.bench.checkpoint_cost import CheckpointCost, CheckpointTimes, checkpoint_cost
from client.bench.display import ProgressLine
from client.bench.options import json_option, write_json
from client.local_cluster import LocalCluster
from client.sdk import Client
from client.terminal import table_console
from client.usage import one_line_errors
from gradps.channel import open_channel
from gradps.codec_table import parse_codec
from gradps.device import device_option
from gradps.schemes import SCHEMES
from gradps.transport import TRANSPORTS
from gradps.v1 import run_pb2, shard_pb2, shard_pb2_grpc

# Per-step fields, in seconds, that a worker reports (see StepBreakdown).
_FIELDS = (
    "step_s",
    "compute_s",
    "exchange_s",
    "encode_s",
    "push_s",
    "wait_s",
    "pull_s",
    "decode_s",
    "average_s",
    "apply_s",
)


@dataclass
class StepBreakdown:
    """Median per step over the measured steps, averaged over the workers; seconds."""

    model: str
    dataset: str
    scheme: str
    workers: int
    shards: int
    batch_size: int
    codec: str
    # Where the workers and shards computed.
    device: str
    # Where payloads travelled (gradps.transport.TRANSPORTS).
    transport: str
    params: int
    # Whole step: forward + backward + the exchange with the shards.
    step_s: float
    # The mean, not the median, of the whole step: the rare steps a checkpoint slows count in it.
    step_mean_s: float
    # Forward and backward (and the batch fetch).
    compute_s: float
    # Time the training loop is blocked after backward (the scheme's exchange).
    exchange_s: float
    # Inside the push and pull calls (wall time of the calls): encoding gradients (CPU, summed
    # over the shard threads), the push call, the pull call, decoding the weights into the model.
    encode_s: float
    push_s: float
    pull_s: float
    decode_s: float
    # wagma's group-average calls (its exchange: deposit the model, receive the group's average).
    average_s: float
    # push + pull wall time not spent encoding or decoding: the wire and the shards (which apply
    # the update before a sync pull returns).
    wait_s: float
    # Work in the exchange outside the calls (gradient accumulation, the local update, copies).
    apply_s: float
    # Communication that ran while the loop computed (background pushes/pulls), and what was
    # left exposed, as a fraction of the step.
    overlap_s: float
    exposed_comm_fraction: float
    steps: int
    # Shards' checkpoints every this many seconds (0: none), and how many were written in the run.
    checkpoint_every_s: float = 0.0
    checkpoints: int = 0
    # Same run (client/bench/checkpoint_cost.py): seconds a worker's steps lost to each checkpoint
    # (of every shard), that over the interval (the fraction of the run's time checkpoints take),
    # and the checkpoints per shard that fell within the measured steps.
    checkpoint_lost_s: float = 0.0
    checkpoint_cost: float = 0.0
    checkpoints_beside_steps: float = 0.0
    # One checkpoint of every shard after the run (CheckpointRun, one shard after another): its
    # bytes and write time (all shards), the longest lock hold for a snapshot, and a plain
    # sequential write of as many bytes (one file, fsync) in the same folder.
    checkpoint_bytes: int = 0
    checkpoint_snapshot_s: float = 0.0
    checkpoint_write_s: float = 0.0
    plain_write_s: float = 0.0


def _spawn_worker(
    index: int, coordinator: str, warmup: int, device: str, transport: str, out: Path, token: str | None = None
) -> subprocess.Popen:
    """One bench worker as its own process (gpu_worker.step_bench), so the client imports no worker
    code; it joins with `token` (the cluster's worker token) where given."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if token:
        env["GRADPS_TOKEN"] = token
    args = [f"--coordinator={coordinator}", f"--index={index}", f"--warmup={warmup}", f"--device={device}"]
    args += [f"--transport={transport}", f"--out={out}"]
    return subprocess.Popen([sys.executable, "-m", "gpu_worker.step_bench", *args], env=env)


def _failure(index: int, p: subprocess.Popen, out: Path) -> str:
    error = json.loads(out.read_text()).get("error") if out.exists() else None
    return f"step bench worker {index}: {error or f'exited with status {p.returncode}'}"


def _collect(
    processes: list[subprocess.Popen], outs: list[Path], timeout_s: float, waiting: Callable[[], None] = lambda: None
) -> list[tuple[int, list[dict]]]:
    """Each worker's (params, per-step records) once all exited, calling `waiting` meanwhile;
    RuntimeError at the first failure."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in processes):
        waiting()
        for index, p in enumerate(processes):
            if p.poll() not in (None, 0):
                raise RuntimeError(_failure(index, p, outs[index]))
        if time.monotonic() > deadline:
            raise RuntimeError(f"step bench workers did not finish in {timeout_s:.0f} s")
        time.sleep(0.1)
    for index, p in enumerate(processes):
        if p.returncode != 0 or not outs[index].exists():
            raise RuntimeError(_failure(index, p, outs[index]))
    return [(r["params"], r["records"]) for r in (json.loads(out.read_text()) for out in outs)]


def _checkpoint_after(client: Client, run_id: str, folder: Path) -> dict[str, float]:
    """Checkpoint the run on every shard now, then write as many bytes plainly (one file, fsync)
    beside the checkpoints: the disk's own sequential speed, in the same run."""
    answers = []
    for address in client.cluster().shards:
        with open_channel(address) as channel:
            stub = shard_pb2_grpc.ShardServiceStub(channel)
            answers.append(stub.CheckpointRun(shard_pb2.CheckpointRunRequest(run_id=run_id), timeout=600))
    nbytes = sum(a.bytes for a in answers)
    block = os.urandom(16 << 20)
    began = time.perf_counter()
    with open(folder / "plain-write.bin", "wb") as f:
        for start in range(0, nbytes, len(block)):
            f.write(block[: min(len(block), nbytes - start)])
        f.flush()
        os.fsync(f.fileno())
    plain_s = time.perf_counter() - began
    (folder / "plain-write.bin").unlink()
    return {
        "checkpoints": max(a.sequence for a in answers) - 1,
        "checkpoint_bytes": nbytes,
        "checkpoint_snapshot_s": max(a.snapshot_seconds for a in answers),
        "checkpoint_write_s": sum(a.write_seconds for a in answers),  # one shard after another
        "plain_write_s": plain_s,
    }


def measure_step(
    model: str,
    dataset: str,
    scheme: str,
    workers: int,
    shards: int,
    batch_size: int,
    steps: int,
    warmup: int,
    codec: str,
    device: str = "cpu",
    console: Console | None = None,
    transport: str = "shm",
    checkpoint_every_s: float = 0.0,
    allow_import: tuple[str, ...] = (),
) -> StepBreakdown:
    """Train `warmup + steps` steps of a real run on a local cluster and break the steps down.
    `checkpoint_every_s`: the shards checkpoint the run that often (in a temporary state dir,
    which the coordinator keeps its runs in either way). `allow_import`: prefixes of the model's
    or dataset's import path the cluster accepts. The progress line goes to `console`."""
    spec = run_pb2.RunSpec(
        model=model,
        dataset=dataset,
        scheme=scheme,
        workers=workers,
        batch_size=batch_size,
        steps=warmup + steps,
        codec=parse_codec(codec),
        eval_every=0,
        optimizer=run_pb2.OptimizerSpec(name="sgd", lr=0.01, momentum=0.9),
        checkpoint_every_seconds=checkpoint_every_s,
    )
    saved: dict[str, float] = {}
    cost: CheckpointCost | None = None
    parts = 3 if checkpoint_every_s else 2  # the cluster, the steps, the checkpoint after them
    with (
        ProgressLine(console, parts, f"starting {shards} shard{'s' * (shards > 1)} on {device}") as progress,
        tempfile.TemporaryDirectory() as tmp,
        LocalCluster(
            shards=shards, workers=0, device=device, state_dir=Path(tmp) / "state", allow_import=allow_import
        ) as cluster,
    ):
        outs = [Path(tmp) / f"worker-{i}.json" for i in range(workers)]
        token = cluster.role_token("worker")
        processes = [
            _spawn_worker(i, cluster.address, warmup, device, transport, outs[i], token) for i in range(workers)
        ]
        try:
            with Client(cluster.address) as client:
                progress.measuring(f"{workers} worker{'s' * (workers > 1)} joining")
                client.wait_for_cluster(shards, workers)
                run_id = client.submit(spec)
                progress.done()
                progress.measuring(f"{warmup + steps} steps of {model} on {dataset}, {scheme}, {transport}")
                if checkpoint_every_s:
                    times = CheckpointTimes(client.cluster().shards, run_id, checkpoint_every_s)
                    try:
                        done = _collect(processes, outs, timeout_s=3600, waiting=times.poll)
                        times.poll(now=True)
                    finally:
                        times.close()
                    cost = checkpoint_cost([records for _, records in done], times.windows(), checkpoint_every_s)
                else:
                    done = _collect(processes, outs, timeout_s=3600)
                progress.done()
                if checkpoint_every_s:
                    progress.measuring("a checkpoint of every shard, and a plain write of as many bytes")
                    saved = _checkpoint_after(client, run_id, Path(tmp) / "state")
                    progress.done()
        finally:
            for p in processes:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    per_worker = [{k: statistics.median(r[k] for r in records) for k in (*_FIELDS, "overlap_s")} for _, records in done]
    mean = {k: statistics.mean(w[k] for w in per_worker) for k in per_worker[0]}
    step_mean = statistics.mean(statistics.mean(r["step_s"] for r in records) for _, records in done)
    exposed = mean["push_s"] + mean["pull_s"] + mean["average_s"] - mean["overlap_s"]
    return StepBreakdown(
        model=model,
        dataset=dataset,
        scheme=scheme,
        workers=workers,
        shards=shards,
        batch_size=batch_size,
        codec=codec,
        device=device,
        transport=transport,
        params=done[0][0],
        exposed_comm_fraction=exposed / mean["step_s"] if mean["step_s"] else 0.0,
        steps=steps,
        checkpoint_every_s=checkpoint_every_s,
        step_mean_s=step_mean,
        checkpoint_lost_s=cost.lost_s if cost else 0.0,
        checkpoint_cost=cost.fraction if cost else 0.0,
        checkpoints_beside_steps=cost.checkpoints if cost else 0.0,
        **mean,
        **saved,  # type: ignore[arg-type]
    )


def print_breakdown(b: StepBreakdown, console: Console) -> None:
    table = Table(
        "part", "ms / step", "% of step",
        title=f"gradps bench step: {b.model} on {b.dataset}, {b.scheme}, {b.workers} workers, {b.shards} shards, "
        f"batch {b.batch_size}, {b.params / 1e6:.1f} M params, {b.device}, {b.transport} (medians of {b.steps} steps)",
    )  # fmt: skip
    rows = [
        ("step", b.step_s),
        ("step, mean (what checkpoints cost shows here)" if b.checkpoint_every_s else "step, mean", b.step_mean_s),
        ("  compute (forward + backward)", b.compute_s),
        ("  exchange (loop blocked after backward)", b.exchange_s),
        ("    push call", b.push_s),
        ("      encode", b.encode_s),
        ("    pull call", b.pull_s),
        ("      decode", b.decode_s),
        ("    group average call (wagma)", b.average_s),
        ("    wait (in calls, not coding: wire + shards)", b.wait_s),
        ("    apply (local update, outside calls)", b.apply_s),
        ("communication overlapped with compute", b.overlap_s),
    ]
    for name, seconds in rows:
        table.add_row(name, f"{seconds * 1e3:.1f}", f"{seconds / b.step_s:.1%}" if b.step_s else "-")
    table.add_row("exposed communication", "", f"{b.exposed_comm_fraction:.1%}")
    console.print(table)
    if b.checkpoint_bytes:
        mb = b.checkpoint_bytes / 1e6
        console.print(
            f"checkpoints every {b.checkpoint_every_s:g} s: {b.checkpoints} in the run; one more after it: "
            f"{mb:.0f} MB, lock held {b.checkpoint_snapshot_s * 1e3:.0f} ms, written in {b.checkpoint_write_s:.2f} s "
            f"({mb / b.checkpoint_write_s:.0f} MB/s); a plain sequential write of as many bytes: "
            f"{b.plain_write_s:.2f} s ({mb / b.plain_write_s:.0f} MB/s)"
        )
    if b.checkpoint_every_s:
        console.print(
            f"same run: a checkpoint of every shard ({b.checkpoints_beside_steps:g} among the measured steps) cost "
            f"each worker {b.checkpoint_lost_s * 1e3:.0f} ms beside the steps that met none: {b.checkpoint_cost:.1%} "
            f"of the run's time at one every {b.checkpoint_every_s:g} s"
            if b.checkpoints_beside_steps
            else "same run: no checkpoint fell within the measured steps (more --steps or a shorter --checkpoint-every)"
        )


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--model", default="resnet18", help="mlp, cnn, resnet18, transformer or package.module:function.")
@click.option(
    "--dataset",
    default="synthetic-images",
    help="digits, synthetic-images, synthetic-tokens, synthetic-tokens-varlen, ...",
)
@click.option("--scheme", default="asgd", type=click.Choice(list(SCHEMES)), help="Consistency scheme.")
@click.option("--workers", default=2, type=click.IntRange(min=1))
@click.option("--shards", default=2, type=click.IntRange(min=1))
@click.option("--batch-size", default=32, type=click.IntRange(min=1))
@click.option("--steps", default=5, type=click.IntRange(min=1), help="Measured steps per worker.")
@click.option("--warmup", default=2, type=click.IntRange(min=0), help="Steps before measuring.")
@click.option("--codec", default="none", help="Gradient codec.")
@device_option("Where the workers and shards compute (auto: CUDA when present).")
@click.option(
    "--transport",
    type=click.Choice(TRANSPORTS),
    default="shm",
    help="Where payloads travel: shm (shared memory), stream (raw TCP data streams, as between hosts), "
    "grpc (in the messages).",
)
@click.option(
    "--checkpoint-every",
    default=0.0,
    type=click.FloatRange(min=0),
    help="Seconds between the shards' checkpoints of the run (0: none); then one more after the run, "
    "timed beside a plain sequential write of as many bytes.",
)
@click.option(
    "--allow-import",
    multiple=True,
    help="A package or module whose model or dataset --model/--dataset may import (repeatable).",
)
@json_option("Write the result here.")
@one_line_errors
def step(
    model: str,
    dataset: str,
    scheme: str,
    workers: int,
    shards: int,
    batch_size: int,
    steps: int,
    warmup: int,
    codec: str,
    device: str,
    transport: str,
    checkpoint_every: float,
    allow_import: tuple[str, ...],
    json_path: Path | None,
) -> None:
    """Time of one training step: compute, encode, push, wait, pull, decode, apply; overlap."""
    try:
        parse_codec(codec)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--codec") from None
    console = Console(stderr=True)
    b = measure_step(
        model, dataset, scheme, workers, shards, batch_size, steps, warmup, codec, device, console, transport,
        checkpoint_every, allow_import,
    )  # fmt: skip
    print_breakdown(b, table_console())
    if json_path:
        write_json(json_path, asdict(b), console)
