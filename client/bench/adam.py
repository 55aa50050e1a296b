"""`gradps bench adam`: the shard's optimizer update of N parameters, in GB/s of memory traffic,
beside the device's memory bandwidth (a copy and an add over as much memory) in the same run.

Adam must read the parameters, the gradient and both moments and write the parameters and both
moments: 28 bytes per float32 parameter; that minimum divided by the time is the figure reported.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.console import Console
from rich.table import Table

from client.bench.display import ProgressLine
from client.bench.options import json_option, write_json
from client.terminal import table_console
from client.usage import one_line_errors
from gradps.device import device_option

if TYPE_CHECKING:
    import torch

    from gradps.optimizer import ScheduledOptimizer
    from gradps.v1 import run_pb2

MiB = 1 << 20
# Bytes an update must move per float32 parameter: reads + writes.
_TRAFFIC = {"adam": 28, "adamw": 28, "sgd": 12}
# Bytes the bench holds per parameter at once: values and gradients, plus the optimizer's state.
_HELD = {"adam": 16, "adamw": 16, "sgd": 8}


@dataclass
class AdamRow:
    """One way of applying the update to all parts."""

    # "shard": what a shard does with a push of every part (ShardOptimizer.apply: one fused or
    # foreach step over all of them); "per-part": one optimizer per part, stepped part after part
    # (what shards did before; the reference that shows the per-step overhead).
    path: str
    optimizer: str
    device: str
    params: int
    part_mib: float
    kernels: str
    seconds: float
    gbps: float
    # The device's memory bandwidth in this run: the better of a copy and an in-place add over
    # as many floats as there are parameters (reads + writes counted).
    copy_gbps: float
    ratio_vs_copy: float


def _check_fits(n_params: int, optimizer: str, device_name: str) -> None:
    """A usage error, before anything is allocated, when the bench cannot fit in free memory."""
    import torch

    device = torch.device(device_name)
    free: int | None
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        with open("/proc/meminfo") as f:
            free = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    need = _HELD[optimizer] * n_params
    if free is not None and need > free:
        raise click.BadParameter(
            f"{n_params:,} parameters need {need / 2**30:.1f} GiB; {free / 2**30:.1f} GiB free on {device}",
            param_hint="'--params'",
        )


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], object], device: torch.device, steps: int) -> float:
    fn()  # warm-up (and lazy state allocation)
    _sync(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _stream_gbps(n: int, device: torch.device, steps: int) -> float:
    """Memory bandwidth the device shows in this run: the better of a copy b <- a (8 bytes per
    float) and an in-place add a += b (12 bytes; in place like an optimizer's update, so no write
    allocation of fresh lines), over `n` floats."""
    import torch

    a = torch.empty(n, device=device).uniform_()
    b = a.clone()
    copy_s = _time(lambda: b.copy_(a), device, steps)
    add_s = _time(lambda: a.add_(b, alpha=1e-9), device, steps)
    return max(8 * n / copy_s, 12 * n / add_s) / 1e9


def _step_each(optimizers: list[ScheduledOptimizer]) -> None:
    for optimizer in optimizers:
        optimizer.step()


def measure_adam(
    n_params: int,
    part_mib: float,
    device_name: str,
    optimizer: str,
    steps: int,
    paths: list[str],
    console: Console | None = None,
) -> list[AdamRow]:
    """Time the update of `n_params` float32 parameters cut into parts of `part_mib` (the progress
    line on `console`)."""
    import torch

    from gradps.v1 import run_pb2

    device = torch.device(device_name)
    part_count = max(1, int(part_mib * MiB) // 4)
    counts = [min(part_count, n_params - o) for o in range(0, n_params, part_count)]
    spec = run_pb2.OptimizerSpec(name=optimizer, lr=1e-3)
    with ProgressLine(console, 1 + len(paths), f"copy and add of {n_params:,} floats on {device}") as progress:
        copy_gbps = _stream_gbps(n_params, device, steps)
        progress.done()
        rows = []
        for path in paths:
            progress.measuring(f"{path}: {optimizer} update of {len(counts)} parts on {device}")
            rows.append(_measure_path(path, counts, spec, device, steps, part_mib, copy_gbps))
            progress.done()
    return rows


def _measure_path(
    path: str,
    counts: list[int],
    spec: run_pb2.OptimizerSpec,
    device: torch.device,
    steps: int,
    part_mib: float,
    copy_gbps: float,
) -> AdamRow:
    """One way of applying the update (AdamRow.path) to parts of `counts` parameters, timed; its
    tensors are freed on return, before the next path allocates its own."""
    import torch

    from gradps.optimizer import ScheduledOptimizer, ShardOptimizer, kernels

    values = {("bench", i): torch.randn(c, device=device) for i, c in enumerate(counts)}
    grads = [(key, torch.randn(v.numel(), device=device) * 1e-3, 1.0) for key, v in values.items()]
    if path == "shard":
        shard = ShardOptimizer(values, spec, total_steps=10**6)
        update = functools.partial(shard.apply, grads)
        used = kernels(list(shard.params.values()))
    else:
        params = [torch.nn.Parameter(v, requires_grad=False) for v in values.values()]
        for param, (_, grad, _) in zip(params, grads, strict=True):
            param.grad = grad
        update = functools.partial(_step_each, [ScheduledOptimizer([p], spec, 10**6) for p in params])
        used = kernels(params)
    seconds = _time(update, device, steps)
    n_params = sum(counts)
    gbps = _TRAFFIC[spec.name] * n_params / seconds / 1e9
    return AdamRow(
        path=path,
        optimizer=spec.name,
        device=str(device),
        params=n_params,
        part_mib=part_mib,
        kernels=next(iter(used)),
        seconds=seconds,
        gbps=gbps,
        copy_gbps=copy_gbps,
        ratio_vs_copy=gbps / copy_gbps,
    )


def print_rows(rows: list[AdamRow], console: Console) -> None:
    table = Table(
        "path", "optimizer", "device", "params", "part MiB", "kernels", "ms", "GB/s", "copy/add GB/s", "vs copy/add",
        title="gradps bench adam: the shard's update, bytes it must move / time",
    )  # fmt: skip
    for r in rows:
        table.add_row(
            r.path,
            r.optimizer,
            r.device,
            f"{r.params / 1e6:.0f} M",
            f"{r.part_mib:g}",
            r.kernels,
            f"{r.seconds * 1e3:.1f}",
            f"{r.gbps:.1f}",
            f"{r.copy_gbps:.1f}",
            f"{r.ratio_vs_copy:.0%}",
        )
    console.print(table)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--params", "n_params", default=100_000_000, type=click.IntRange(min=1), help="Parameters.")
@click.option("--part-size", "part_mib", default=4.0, type=click.FloatRange(min=0.001), help="Part size, MiB.")
@device_option("Where the update runs (auto: CUDA when present).")
@click.option("--optimizer", default="adam", type=click.Choice(sorted(_TRAFFIC)))
@click.option("--steps", default=5, type=click.IntRange(min=1), help="Timed updates (median reported).")
@json_option()
@one_line_errors
def adam(n_params: int, part_mib: float, device: str, optimizer: str, steps: int, json_path: Path | None) -> None:
    """The shard's optimizer update in GB/s of memory traffic, beside a copy of the same memory."""
    _check_fits(n_params, optimizer, device)
    console = Console(stderr=True)
    rows = measure_adam(n_params, part_mib, device, optimizer, steps, ["shard", "per-part"], console)
    print_rows(rows, table_console())
    if json_path:
        write_json(json_path, [asdict(r) for r in rows], console)
