"""One worker of `gradps bench step`: join, train the assigned run, time each step's parts.

    python -m gpu_worker.step_bench --coordinator ADDR --index I --warmup W --out FILE

It runs as its own process (the client never imports worker code) and writes its result, or its
error, to FILE as JSON: {"params": N, "records": [{field: seconds, "began_unix": when}, ...]}, or
{"error": "..."} and exit status 1.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import click
import torch

from gpu_worker.trainer import Trainer
from gradps.datasets import ShardSampler, load_dataset
from gradps.evaluation import compute_loss
from gradps.models import build_model
from gradps.transport import TRANSPORTS
from gradps.worker_session import Assignment, WorkerSession


def _record(before: dict[str, float], after: dict[str, float], began: float, computed: float, ended: float) -> dict:
    """One step's parts, in seconds, from its times and the traffic counters before and after it
    (the calls that ended within it)."""
    d = {k: v - before[k] for k, v in after.items() if k.endswith("_s")}
    calls = d["push_s"] + d["pull_s"] + d["average_s"]
    exchange = ended - computed
    return {
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


def _train(session: WorkerSession, assignment: Assignment, warmup: int, device: str, transport: str) -> dict:
    """Train the assigned run; the model's size and the records of the steps after `warmup`."""
    spec = assignment.spec
    dataset = load_dataset(spec.dataset, spec.dataset_size, spec.seed)
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, dataset).to(device)
    # GPU work is asynchronous: wait for it where the step is cut into parts.
    synchronize: Callable[[], None] = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sampler = ShardSampler(len(dataset.train_x), assignment.rank, assignment.world, spec.batch_size, spec.seed)
    trainer = Trainer(model, session, assignment, spec.steps, evaluate=None, report_every=10**9, transport=transport)
    traffic = trainer.client.traffic
    trainer.start()
    model.train()
    records = []
    for step in range(spec.steps):
        # Calls that end within this step count for it: a background exchange (asgd) ends
        # while the next step computes.
        before = dict(vars(traffic))
        began, began_unix = time.perf_counter(), time.time()
        idx = sampler.next_batch()
        x, y = dataset.train_x[idx].to(device), dataset.train_y[idx].to(device)
        loss = compute_loss(model, x, y, dataset.task)
        loss.backward()
        synchronize()
        computed = time.perf_counter()
        trainer.step(loss.item(), len(idx))
        synchronize()
        if step >= warmup:
            record = _record(before, dict(vars(traffic)), began, computed, time.perf_counter())
            records.append({**record, "began_unix": began_unix})  # placed beside the checkpoints
    trainer.finish()
    return {"params": sum(p.numel() for p in model.parameters()), "records": records}


@click.command()
@click.option("--coordinator", required=True)
@click.option("--index", type=int, required=True, help="This worker's number in the bench (its name).")
@click.option("--warmup", type=int, default=0, help="Steps before measuring.")
@click.option("--device", default="cpu")
@click.option("--transport", type=click.Choice(TRANSPORTS), default="shm")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True)
def main(coordinator: str, index: int, warmup: int, device: str, transport: str, out: Path) -> None:
    torch.set_num_threads(1)
    session = WorkerSession(coordinator, name=f"step-bench-{index}", device=device)
    try:
        assignment = None
        while assignment is None:
            assignment = session.wait_for_assignment(wait_s=5.0)
        out.write_text(json.dumps(_train(session, assignment, warmup, device, transport)))
    except Exception as e:  # the bench reports it and fails
        out.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        raise SystemExit(1) from None
    finally:
        session.close()


if __name__ == "__main__":
    main()
