"""The torch DDP baseline of `gradps compare --baseline ddp`: the run a user already has.

`--workers` ranks of torch DistributedDataParallel on loopback (gloo on CPU, nccl on CUDA) train
what a gradps run trains: the same model, data, per-rank split (`ShardSampler`), optimizer and
learning-rate schedule (`ScheduledOptimizer`), batch size, seed, steps, evaluation cadence and
slowdown emulation, timed as a gradps worker times itself (from the start of training; loading
the data and building the model excluded). The result is a summary in the shape `follow` gives
for a gradps run, so it becomes one more row of the comparison.

The parent (`run_ddp`) hosts the rendezvous store on a free port and starts each rank as a
process (`python -m client.ddp_baseline`), as the local cluster starts every service; on an
emulated network (`gradps compare --link`), rank r on host r, where a colocated cluster has worker r.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import click
import torch
from google.protobuf.json_format import MessageToJson, Parse
from rich.console import Console

from client.sdk import GradpsError
from client.stopping import terminate
from gradps.datasets import Dataset, ShardSampler, load_dataset
from gradps.evaluation import compute_loss, evaluate
from gradps.models import build_model
from gradps.netem import EmulatedNetwork
from gradps.optimizer import ScheduledOptimizer
from gradps.run_spec import total_steps, with_defaults
from gradps.slowdown import Slowdown
from gradps.v1 import run_pb2

# The row's name in the comparison.
SCHEME = "ddp"
# A rank that waits this long in the rendezvous or in one collective (a peer died) gives up.
_COLLECTIVE_TIMEOUT = timedelta(minutes=2)
_POLL_S = 0.2


class BaselineFailed(GradpsError):
    """A DDP rank exited with an error; the message names it and its log."""


def run_ddp(
    spec: run_pb2.RunSpec,
    device: str,
    out_dir: Path,
    log_dir: Path,
    show_progress: bool = True,
    network: EmulatedNetwork | None = None,
    until: float | None = None,
) -> dict[str, Any]:
    """Train `spec` with torch DDP on `spec.workers` local processes; its summary (as `follow`'s).

    Writes spec.json, each rank's rank<R>.json and summary.json to `out_dir`, the ranks' logs to
    `log_dir`. `device` is "cpu" or "cuda" (resolved). `network`: rank r on its host r (this
    process must be on host 0, which holds the rendezvous store). `until`: every rank stops at
    rank 0's first evaluation on the way with at least this test accuracy (as `follow` stops a run).
    """
    import torch.distributed as dist

    spec = with_defaults(spec)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    spec_path = out_dir / "spec.json"
    spec_path.write_text(MessageToJson(spec, preserving_proto_field_name=True) + "\n")
    world = spec.workers
    # Port 0: the store takes a free port and the ranks are told which, so no port can be taken
    # between choosing and binding it.
    host = network.address(0) if network else "127.0.0.1"
    store = dist.TCPStore(host, 0, None, True, timeout=_COLLECTIVE_TIMEOUT, wait_for_workers=False)
    what = f"ddp: {world} ranks, {backend_for(device, world)} on {device}"
    with Console(stderr=True).status(what) if show_progress else contextlib.nullcontext():
        procs = [
            _start_rank(rank, world, f"{host}:{store.port}", spec_path, device, out_dir, log_dir, network, until)
            for rank in range(world)
        ]
        try:
            _wait(procs, log_dir)
        finally:
            terminate(procs, grace_s=5.0)
    del store
    ranks = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world)]
    summary = summarize(spec, ranks, backend_for(device, world), device)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def backend_for(device: str, world: int) -> str:
    """nccl when every rank can have a GPU of its own (nccl refuses two ranks on one), else gloo."""
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    return "nccl" if cuda and torch.cuda.device_count() >= world else "gloo"


def summarize(spec: run_pb2.RunSpec, ranks: list[dict[str, Any]], backend: str, device: str) -> dict[str, Any]:
    """The numbers `client.report.summarize` gives for a gradps run, from the ranks' results."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    first = ranks[0]
    rates = [r["samples"] / r["elapsed_s"] if r["elapsed_s"] > 0 else 0.0 for r in ranks]
    return {
        "run_id": None,
        # Stopped: at the target, as a gradps run `follow` stopped there.
        "state": "stopped" if first["steps"] < first["total_steps"] else "completed",
        "scheme": SCHEME,
        "backend": backend,
        "device": device,
        "model": spec.model,
        "dataset": spec.dataset,
        "workers": spec.workers,
        "steps": first["steps"],
        "total_steps": first["total_steps"],
        # From the first rank entering the run (building its model, joining the group) to the last
        # one done, as a gradps run's wall time runs from its assignment to its last worker's report.
        "wall_seconds": round(max(r["finished_at"] for r in ranks) - min(r["entered_at"] for r in ranks), 3),
        "samples_per_second": round(sum(rates), 1),
        "samples_per_second_by_rank": [round(rate, 1) for rate in rates],
        "final_test_accuracy": first["final_test_accuracy"],
        "final_test_loss": first["final_test_loss"],
        "final_loss": sum(r["loss"] for r in ranks) / len(ranks),
        # DDP's all-reduce travels inside torch: no pushes to count, and every step is in step.
        "bytes_pushed": None,
        "mean_staleness": 0.0,
        "max_staleness": 0,
        "wait_fraction": None,
        "accuracy_curve": first["accuracy_curve"],
    }


def _start_rank(
    rank: int,
    world: int,
    store: str,
    spec_path: Path,
    device: str,
    out_dir: Path,
    log_dir: Path,
    network: EmulatedNetwork | None,
    until: float | None,
) -> subprocess.Popen:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # as the local cluster's workers
    # gloo and nccl would otherwise pick the interface of the host name: on an emulated host, its
    # link (whatever the user's environment says: no other interface exists there).
    interface = "eth0" if network else _loopback_interface()
    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if network:
            env[key] = "eth0"
        elif interface:
            env.setdefault(key, interface)
    args = [f"--rank={rank}", f"--world={world}", f"--store={store}", f"--spec={spec_path}", f"--device={device}"]
    args += [f"--until={until!r}"] if until is not None else []
    argv = [sys.executable, "-m", "client.ddp_baseline", *args, f"--out={out_dir}"]
    if network:
        argv = network.command(rank % network.hosts, argv)
    log = open(log_dir / f"ddp-rank{rank}.log", "w")
    try:
        return subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    finally:
        log.close()  # the child holds its own descriptor


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    return next((name for name in names if name.startswith("lo")), None)


def _wait(procs: list[subprocess.Popen], log_dir: Path) -> None:
    """Until every rank has exited; the first that fails fails the baseline (the finally of the
    caller stops the others, which would wait for it in their next collective)."""
    while True:
        codes = [proc.poll() for proc in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                log = log_dir / f"ddp-rank{rank}.log"
                lines = log.read_text(errors="replace").strip().splitlines() or ["(no output)"]
                raise BaselineFailed(f"ddp rank {rank} exited with {code}: {lines[-1]} (log: {log})")
        if all(code == 0 for code in codes):
            return
        time.sleep(_POLL_S)


def rank_device(device: str, rank: int, backend: str) -> torch.device:
    """Rank r's GPU under nccl; with gloo every rank computes on `device` itself."""
    if backend == "nccl":
        return torch.device("cuda", rank)
    return torch.device(device)


def train_rank(
    spec: run_pb2.RunSpec, rank: int, world: int, store_at: str, device: str, until: float | None = None
) -> dict[str, Any]:
    """One rank's whole run: join the process group, train (to the end, or `until` rank 0 evaluates
    at least that test accuracy on the way), leave; this rank's results."""
    import torch.distributed as dist

    # A gradps worker keeps the datasets it loaded in memory from run to run: load before the clock.
    dataset = load_dataset(spec.dataset, spec.dataset_size, spec.seed)
    entered_at = time.time()
    backend = backend_for(device, world)
    where = rank_device(device, rank, backend)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    host, port = store_at.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), None, False, timeout=_COLLECTIVE_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=_COLLECTIVE_TIMEOUT)
    try:
        result = _train(spec, dataset, rank, world, where, until)
        # Every rank leaves the group together: a rank that tore down its connections while rank 0
        # still evaluated was aborted now and then by gloo ("terminate called without an active
        # exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()
    result.update(rank=rank, entered_at=entered_at, finished_at=time.time())
    return result


def _train(
    spec: run_pb2.RunSpec, dataset: Dataset, rank: int, world: int, device: torch.device, until: float | None
) -> dict[str, Any]:
    """The loop of gpu_worker.service.train with DDP's all-reduce in place of the scheme."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(spec.seed)  # every rank starts from the same weights, as every gradps replica
    model = build_model(spec.model, dataset).to(device)
    steps = total_steps(spec, world, len(dataset.train_x))
    sampler = ShardSampler(len(dataset.train_x), rank, world, spec.batch_size, spec.seed)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = ScheduledOptimizer(list(ddp.parameters()), spec.optimizer, steps)
    slowdown = Slowdown(spec, rank)
    curve: list[dict[str, Any]] = []
    samples, loss_sum = 0, 0.0
    # Whether rank 0's evaluation reached `until`, broadcast to every rank (nccl's on the GPU).
    reached = torch.zeros(1, dtype=torch.int32, device=device if dist.get_backend() == "nccl" else "cpu")
    model.train()
    dist.barrier()  # the clock starts when every rank is ready, as the schemes' start after start-up
    started = time.perf_counter()
    done = steps
    for step in range(1, steps + 1):
        began = time.perf_counter()
        idx = sampler.next_batch()
        x, y = dataset.train_x[idx].to(device), dataset.train_y[idx].to(device)
        loss = compute_loss(ddp, x, y, dataset.task)
        loss.backward()  # DDP averages the gradients over the ranks here
        optimizer.step()
        optimizer.opt.zero_grad(set_to_none=True)
        samples += len(idx)
        loss_sum += loss.item()  # a gradps worker reads its loss every step too
        evaluation = spec.eval_every > 0 and step % spec.eval_every == 0 and step < steps
        if evaluation and rank == 0:
            point, test_loss = _point(model, dataset, step, time.perf_counter() - started)
            curve.append(point)
            reached.fill_(int(until is not None and point["test_accuracy"] >= until))
        slowdown.after(time.perf_counter() - began)
        if evaluation and until is not None:
            dist.broadcast(reached, src=0)
            if reached.item():
                done = step
                break
    elapsed = time.perf_counter() - started
    result: dict[str, Any] = {"steps": done, "total_steps": steps, "samples": samples, "elapsed_s": elapsed}
    result["loss"] = loss_sum / done
    if rank == 0 and done < steps:  # stopped at the target: its evaluation is the final one
        result.update(final_test_accuracy=point["test_accuracy"], final_test_loss=test_loss)
    elif rank == 0:  # the final evaluation, as a gradps run's rank 0 makes at its end
        test_loss, test_accuracy = evaluate(model, dataset)
        curve.append({"elapsed_s": elapsed, "step": steps, "test_accuracy": test_accuracy})
        result.update(final_test_accuracy=test_accuracy, final_test_loss=test_loss)
    result["accuracy_curve"] = curve
    return result


def _point(model: torch.nn.Module, dataset: Dataset, step: int, elapsed_s: float) -> tuple[dict[str, Any], float]:
    """One point of the accuracy curve, timed before the evaluation as a gradps worker times it,
    and the test loss. It evaluates the model itself, not its DDP wrapper, whose forward would
    wait for the others."""
    test_loss, test_accuracy = evaluate(model, dataset)
    return {"elapsed_s": elapsed_s, "step": step, "test_accuracy": test_accuracy}, test_loss


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--rank", required=True, type=click.IntRange(min=0))
@click.option("--world", required=True, type=click.IntRange(min=1))
@click.option("--store", "store_at", required=True, help="The parent's rendezvous store, HOST:PORT.")
@click.option("--spec", "spec_path", required=True, type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("--device", required=True, help="cpu or cuda (resolved by the parent).")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--until", type=float, default=None, help="Stop at rank 0's first evaluation of this test accuracy.")
def main(rank: int, world: int, store_at: str, spec_path: Path, device: str, out: Path, until: float | None) -> None:
    """One rank of the DDP baseline (started by `run_ddp`): writes OUT/rank<RANK>.json."""
    torch.set_num_threads(1)  # as a gradps worker (gradps-worker --threads 1)
    spec = Parse(spec_path.read_text(), run_pb2.RunSpec())
    result = train_rank(spec, rank, world, store_at, device, until)
    written = out / f"rank{rank}.json"
    temp = written.with_suffix(".tmp")
    temp.write_text(json.dumps(result) + "\n")
    temp.replace(written)
    # The result is on disk: leave without the interpreter's teardown, in which gloo's threads
    # still abort a rank now and then ("terminate called without an active exception") even
    # after the process group was destroyed, failing a baseline that had finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
