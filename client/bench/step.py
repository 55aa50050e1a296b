"""`gradps bench step`: one training step of a real run, broken down into compute and each part
of the exchange with the shards, and how much of the communication overlapped compute."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import click
from rich.console import Console
from rich.table import Table

from client.bench.options import json_option, write_json
from client.local_cluster import LocalCluster
from client.sdk import Client
from client.usage import one_line_errors
from gpu_worker.ps_client import TRANSPORTS
from gradps.codecs import parse_codec
from gradps.device import device_option
from gradps.v1 import run_pb2
from ps_server.schemes import RULES

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
    # Where payloads travelled (gpu_worker.ps_client.TRANSPORTS).
    transport: str
    params: int
    # Whole step: forward + backward + the exchange with the shards.
    step_s: float
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


def _worker_main(index: int, coordinator: str, warmup: int, device: str, transport: str, results: mp.Queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from gpu_worker.session import WorkerSession
    from gpu_worker.trainer import Trainer
    from gradps.datasets import ShardSampler, load_dataset
    from gradps.evaluation import compute_loss
    from gradps.models import build_model

    torch.set_num_threads(1)
    session = WorkerSession(coordinator, name=f"step-bench-{index}", device=device)
    try:
        assignment = None
        while assignment is None:
            assignment = session.wait_for_assignment(wait_s=5.0)
        spec = assignment.spec
        dataset = load_dataset(spec.dataset, spec.dataset_size, spec.seed)
        torch.manual_seed(spec.seed)
        model = build_model(spec.model, dataset).to(device)
        # GPU work is asynchronous: wait for it where the step is cut into parts.
        synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        sampler = ShardSampler(len(dataset.train_x), assignment.rank, assignment.world, spec.batch_size, spec.seed)
        trainer = Trainer(
            model, session, assignment, spec.steps, evaluate=None, report_every=10**9, transport=transport
        )
        traffic = trainer.client.traffic
        trainer.start()
        model.train()
        records = []
        for step in range(spec.steps):
            # Calls that end within this step count for it: a background exchange (asgd) ends
            # while the next step computes.
            before = dict(vars(traffic))
            began = time.perf_counter()
            idx = sampler.next_batch()
            x, y = dataset.train_x[idx].to(device), dataset.train_y[idx].to(device)
            loss = compute_loss(model, x, y, dataset.task)
            loss.backward()
            synchronize()
            computed = time.perf_counter()
            trainer.step(loss.item(), len(idx))
            synchronize()
            ended = time.perf_counter()
            if step < warmup:
                continue
            d = {k: v - before[k] for k, v in vars(traffic).items() if k.endswith("_s")}
            calls = d["push_s"] + d["pull_s"] + d["average_s"]
            exchange = ended - computed
            records.append(
                {
                    "step_s": ended - began,
                    "compute_s": computed - began,
                    "exchange_s": exchange,
                    "encode_s": d["encode_s"],
                    "push_s": d["push_s"],
                    "pull_s": d["pull_s"],
                    "decode_s": d["decode_s"],
                    "average_s": d["average_s"],
                    "wait_s": max(0.0, calls - d["encode_s"] - d["decode_s"]),
                    "apply_s": max(0.0, exchange - calls),
                    "overlap_s": max(0.0, calls - exchange),
                }
            )
        trainer.finish()
        results.put(("done", index, (sum(p.numel() for p in model.parameters()), records)))
    except Exception as e:
        results.put(("error", index, f"{type(e).__name__}: {e}"))
    finally:
        session.close()


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
) -> StepBreakdown:
    """Train `warmup + steps` steps of a real run on a local cluster and break the steps down."""
    log = console.log if console else (lambda *a, **k: None)
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
    )
    ctx = mp.get_context("spawn")
    with LocalCluster(shards=shards, workers=0, device=device) as cluster:
        results = ctx.Queue()
        processes = [
            ctx.Process(target=_worker_main, args=(i, cluster.address, warmup, device, transport, results), daemon=True)
            for i in range(workers)
        ]
        for p in processes:
            p.start()
        with Client(cluster.address) as client:
            client.wait_for_cluster(shards, workers)
            client.submit(spec)
        log(f"step bench: {model} on {dataset}, {scheme}, {workers} workers, {shards} shards, on {device}, {transport}")
        done: dict[int, tuple[int, list[dict]]] = {}
        deadline = time.monotonic() + 3600
        while len(done) < workers:
            try:
                what, index, value = results.get(timeout=5)
            except queue.Empty:
                if time.monotonic() > deadline or not all(p.is_alive() or p.exitcode == 0 for p in processes):
                    raise RuntimeError("step bench workers failed; see the cluster logs") from None
                continue
            if what == "error":
                raise RuntimeError(f"step bench worker {index}: {value}")
            done[index] = value
        for p in processes:
            p.join(timeout=30)
    per_worker = [
        {k: statistics.median(r[k] for r in records) for k in (*_FIELDS, "overlap_s")} for _, records in done.values()
    ]
    mean = {k: statistics.mean(w[k] for w in per_worker) for k in per_worker[0]}
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
        params=next(iter(done.values()))[0],
        exposed_comm_fraction=exposed / mean["step_s"] if mean["step_s"] else 0.0,
        steps=steps,
        **mean,
    )


def print_breakdown(b: StepBreakdown, console: Console) -> None:
    table = Table(
        "part", "ms / step", "% of step",
        title=f"gradps bench step: {b.model} on {b.dataset}, {b.scheme}, {b.workers} workers, {b.shards} shards, "
        f"batch {b.batch_size}, {b.params / 1e6:.1f} M params, {b.device}, {b.transport} (medians of {b.steps} steps)",
    )  # fmt: skip
    rows = [
        ("step", b.step_s),
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


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--model", default="resnet18", help="mlp, cnn, resnet18, transformer or package.module:function.")
@click.option("--dataset", default="synthetic-images", help="digits, synthetic-images, synthetic-tokens, ...")
@click.option("--scheme", default="asgd", type=click.Choice(list(RULES)), help="Consistency scheme.")
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
@json_option("Write the result here.")
@one_line_errors
def step(
    model, dataset, scheme, workers, shards, batch_size, steps, warmup, codec, device, transport, json_path
) -> None:
    """Time of one training step: compute, encode, push, wait, pull, decode, apply; overlap."""
    try:
        parse_codec(codec)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--codec") from None
    console = Console(stderr=True)
    b = measure_step(
        model, dataset, scheme, workers, shards, batch_size, steps, warmup, codec, device, console, transport
    )
    print_breakdown(b, Console(width=None if sys.stdout.isatty() else 160))
    if json_path:
        write_json(json_path, asdict(b), console)
