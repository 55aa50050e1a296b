"""`gradps compare`: every scheme on the same cluster, data, seed and model, side by side."""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Column, Table

from client.ddp_baseline import SCHEME as BASELINE
from client.ddp_baseline import run_ddp
from client.report import follow
from client.sdk import Client
from client.terminal import table_console
from gradps.netem import EmulatedNetwork
from gradps.v1 import run_pb2

COLUMNS = (
    "scheme",
    "time_to_target_s",
    "steps_to_target",
    "final_test_accuracy",
    "samples_per_second",
    "mean_staleness",
    "max_staleness",
    "wait_fraction",
    "wall_seconds",
    "bytes_pushed",
    "run_id",
)
# Time to target over the DDP baseline's: a column only where the baseline ran.
RATIO = "time_vs_ddp"


def to_target(curve: list[dict[str, Any]], target: float) -> tuple[float | None, int | None]:
    """Elapsed seconds and steps at the first evaluation reaching `target`; None when never."""
    for point in curve:
        if point["test_accuracy"] >= target:
            return round(point["elapsed_s"], 3), point["step"]
    return None, None


def row_of(summary: dict[str, Any], target: float) -> dict[str, Any]:
    """A run's row of the comparison, from its summary (`follow`'s, or the DDP baseline's)."""
    seconds, steps = to_target(summary["accuracy_curve"], target)
    row = {"scheme": summary["scheme"], "time_to_target_s": seconds, "steps_to_target": steps}
    row.update({k: summary[k] for k in COLUMNS if k in summary and k not in row})
    row["state"] = summary["state"]
    row["samples_per_second_by_rank"] = summary["samples_per_second_by_rank"]
    row["accuracy_curve"] = summary["accuracy_curve"]
    return row


# A row's name and its run's spec; the name is the scheme's, or the variant's (e.g. "sync-backup1").
Entry = tuple[str, run_pb2.RunSpec]


def with_backup_row(entries: list[Entry], straggler: bool) -> list[Entry]:
    """Plain sync, and beside it sync with backup workers: b from `--backup-workers`, or 1 under a
    straggler, where it is the classic fix users reach for (Chen et al. 2016). Nothing to add
    without sync, with one worker, or with neither a straggler nor b."""
    out: list[Entry] = []
    for name, spec in entries:
        backup = spec.scheme_params.backup_workers or (1 if straggler else 0)
        if name != "sync" or not backup or spec.workers <= backup:
            out.append((name, spec))
            continue
        plain, backed = run_pb2.RunSpec(), run_pb2.RunSpec()
        plain.CopyFrom(spec)
        plain.scheme_params.backup_workers = 0
        backed.CopyFrom(spec)
        backed.scheme_params.backup_workers = backup
        out += [(name, plain), (f"sync-backup{backup}", backed)]
    return out


def run_comparison(
    address: str,
    entries: list[Entry],
    target: float,
    out_dir: Path,
    show_progress: bool = True,
    tensorboard: Path | None = None,
    until: float | None = None,
) -> list[dict[str, Any]]:
    """Run each entry in turn on the cluster at `address`; one row each, under its name (and, with
    `tensorboard`, one TensorBoard run each, tensorboard/<name>). `until`: each run stops at its
    first evaluation of at least this test accuracy (`follow`)."""
    rows = []
    with Client(address) as client:
        for name, spec in entries:
            run_id = client.submit(spec)
            board = tensorboard / name if tensorboard is not None else None
            summary = follow(client, run_id, out_dir / name, show_progress, board, until=until)
            row = row_of(summary, target)
            row["scheme"] = name
            rows.append(row)
    return rows


def run_baseline(
    spec: run_pb2.RunSpec,
    device: str,
    target: float,
    out_dir: Path,
    show_progress: bool = True,
    network: EmulatedNetwork | None = None,
    until: float | None = None,
) -> dict[str, Any]:
    """The torch DDP baseline of `spec` on this machine (client.ddp_baseline), each rank on a host
    of `network` where given; its row. `until`: it stops at its first evaluation of at least this
    test accuracy (`run_ddp`)."""
    summary = run_ddp(spec, device, out_dir / BASELINE, out_dir / "logs", show_progress, network, until)
    return row_of(summary, target)


def add_baseline_ratios(rows: list[dict[str, Any]], baseline: dict[str, Any]) -> None:
    """`time_vs_ddp` in every row: its time to target over the baseline's (None if either never
    reached it). Below 1: faster than DDP."""
    reference = baseline["time_to_target_s"]
    for row in rows:
        seconds = row["time_to_target_s"]
        row[RATIO] = round(seconds / reference, 3) if seconds is not None and reference else None


def combine_repeats(repeated: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per scheme from its run in each repeat (`--repeats`): the median of each figure,
    where a run that never reached the target counts as the slowest (so the median is "never"
    when half of the runs or more never reached it); the range of the runs that reached it; how
    many did; the curve of the median run; every run's own row under "runs". A single repeat's
    rows are its runs' own."""
    if len(repeated) == 1:
        return repeated[0]
    by_scheme = [{row["scheme"]: row for row in rows} for rows in repeated]
    return [_combined([rows[first["scheme"]] for rows in by_scheme]) for first in repeated[0]]


def _combined(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def slowest_if_never(key: str) -> list[float]:
        return [math.inf if run.get(key) is None else run[key] for run in runs]

    def median_of(key: str) -> float | None:
        value = statistics.median(slowest_if_never(key))
        return None if math.isinf(value) else value

    def range_of(key: str) -> list[float] | None:
        reached = [run[key] for run in runs if run.get(key) is not None]
        return [min(reached), max(reached)] if reached else None

    # The median run: its curve is the one drawn, its ranks' rates the ones shown.
    times = slowest_if_never("time_to_target_s")
    middle = runs[sorted(range(len(runs)), key=times.__getitem__)[(len(runs) - 1) // 2]]
    row: dict[str, Any] = {"scheme": runs[0]["scheme"], "repeats": len(runs)}
    for key in ("time_to_target_s", "steps_to_target", *([RATIO] if RATIO in runs[0] else [])):
        row[key] = median_of(key)
        row[f"{key}_range"] = range_of(key)
    row["reached"] = sum(run["time_to_target_s"] is not None for run in runs)
    for key in ("final_test_accuracy", "samples_per_second", "wait_fraction", "wall_seconds", "bytes_pushed"):
        values = [run[key] for run in runs if run.get(key) is not None]
        row[key] = statistics.median(values) if values else None
    row["mean_staleness"] = statistics.fmean(run["mean_staleness"] for run in runs)
    row["max_staleness"] = max(run["max_staleness"] for run in runs)
    states = {run["state"] for run in runs}
    row["state"] = states.pop() if len(states) == 1 else "mixed"
    row["samples_per_second_by_rank"] = middle["samples_per_second_by_rank"]
    row["accuracy_curve"] = middle["accuracy_curve"]
    row["runs"] = runs
    return row


def write_outputs(rows: list[dict[str, Any]], target: float, out_dir: Path, title: str) -> None:
    """compare.json (a row per scheme, `combine_repeats`'), compare.csv (a line per run) and
    compare.png (test accuracy against wall time and steps; with several repeats, the median run of
    each scheme bold, the others faint)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    repeats = max(row.get("repeats", 1) for row in rows)
    (out_dir / "compare.json").write_text(
        json.dumps({"target_accuracy": target, "title": title, "repeats": repeats, "schemes": rows}, indent=2) + "\n"
    )
    with open(out_dir / "compare.csv", "w", newline="") as f:
        fieldnames = ["scheme", "repeat", *COLUMNS[1:]]
        if any(RATIO in row for row in rows):
            fieldnames.insert(fieldnames.index("time_to_target_s") + 1, RATIO)
        writer = csv.DictWriter(f, fieldnames=fieldnames, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(run for row in rows for run in row.get("runs", [row]))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for row in rows:
        # The baseline stands out: black and dashed.
        style = {"color": "black", "linestyle": "--"} if row["scheme"] == BASELINE else {}
        for ax, x in ((by_time, "elapsed_s"), (by_step, "step")):
            curve = row["accuracy_curve"]
            (line,) = ax.plot([p[x] for p in curve], [p["test_accuracy"] for p in curve], label=row["scheme"], **style)
            for run in row.get("runs", []):
                if run["accuracy_curve"] is not curve:
                    points = run["accuracy_curve"]
                    faint = {"color": line.get_color(), "linestyle": line.get_linestyle(), "alpha": 0.35}
                    ax.plot([p[x] for p in points], [p["test_accuracy"] for p in points], linewidth=0.8, **faint)
    for ax, xlabel in ((by_time, "wall time (s)"), (by_step, "step")):
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    by_time.set_ylabel("test accuracy")
    by_step.legend(loc="lower right")
    fig.suptitle(title + (f"; {repeats} repeats, each scheme's median run bold" if repeats > 1 else ""))
    fig.tight_layout()
    fig.savefig(out_dir / "compare.png", dpi=120)
    plt.close(fig)


def print_table(rows: list[dict[str, Any]], target: float, console: Console | None = None) -> None:
    """The comparison as a table; with a "vs ddp" column (time to target over DDP's) where the
    baseline ran; with several repeats, medians, the range of the runs that reached the target
    and how many did."""

    def number(header: str) -> Column:
        return Column(header, justify="right", no_wrap=True)

    ratios = any(RATIO in r for r in rows)
    repeats = max(r.get("repeats", 1) for r in rows)
    table = Table(
        Column("scheme", no_wrap=True),
        number(f"to {target:.0%}\n(s)"),
        *([number("vs\nddp")] if ratios else []),
        number(f"steps\nto {target:.0%}"),
        *([number("reached")] if repeats > 1 else []),
        number("final\nacc"),
        number("samples/s"),
        number("staleness\nmean/max"),
        number("wait"),
        title="gradps compare" + (f", medians of {repeats} repeats" if repeats > 1 else ""),
    )
    for r in rows:
        cells = [
            r["scheme"],
            _spread(r, "time_to_target_s", "{:.2f}", "never"),
            *([_spread(r, RATIO, "{:.2f}x")] if ratios else []),
            _spread(r, "steps_to_target", "{:.0f}"),
            *([f"{r['reached']} of {r['repeats']}"] if repeats > 1 else []),
            _cell(r.get("final_test_accuracy"), "{:.4f}", r["state"]),
            f"{r['samples_per_second']:,.0f}",
            f"{r['mean_staleness']:.2f} / {r['max_staleness']}",
            _cell(r.get("wait_fraction"), "{:.0%}"),
        ]
        table.add_row(*cells)
    (console or table_console()).print(table)


def _cell(value: Any, form: str, missing: str = "-") -> str:
    return missing if value is None else form.format(value)


def _spread(row: dict[str, Any], key: str, form: str, missing: str = "-") -> str:
    """A figure, and after several repeats the range of the runs' figures beside it."""
    cell = _cell(row.get(key), form, missing)
    if (span := row.get(f"{key}_range")) is None or span[0] == span[1]:
        return cell
    return f"{cell} ({form.format(span[0]).rstrip('x')}-{form.format(span[1])})"
