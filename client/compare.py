"""`gradps compare`: every scheme on the same cluster, data, seed and model, side by side."""

from __future__ import annotations

import csv
import json
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
) -> list[dict[str, Any]]:
    """Run each entry in turn on the cluster at `address`; one row each, under its name (and, with
    `tensorboard`, one TensorBoard run each, tensorboard/<name>)."""
    rows = []
    with Client(address) as client:
        for name, spec in entries:
            run_id = client.submit(spec)
            board = tensorboard / name if tensorboard is not None else None
            summary = follow(client, run_id, out_dir / name, show_progress=show_progress, tensorboard=board)
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
) -> dict[str, Any]:
    """The torch DDP baseline of `spec` on this machine (client.ddp_baseline), each rank on a host
    of `network` where given; its row."""
    summary = run_ddp(spec, device, out_dir / BASELINE, out_dir / "logs", show_progress, network)
    return row_of(summary, target)


def add_baseline_ratios(rows: list[dict[str, Any]], baseline: dict[str, Any]) -> None:
    """`time_vs_ddp` in every row: its time to target over the baseline's (None if either never
    reached it). Below 1: faster than DDP."""
    reference = baseline["time_to_target_s"]
    for row in rows:
        seconds = row["time_to_target_s"]
        row[RATIO] = round(seconds / reference, 3) if seconds is not None and reference else None


def write_outputs(rows: list[dict[str, Any]], target: float, out_dir: Path, title: str) -> None:
    """compare.json, compare.csv and compare.png (test accuracy against wall time and steps)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compare.json").write_text(
        json.dumps({"target_accuracy": target, "title": title, "schemes": rows}, indent=2) + "\n"
    )
    with open(out_dir / "compare.csv", "w", newline="") as f:
        fieldnames = list(COLUMNS)
        if any(RATIO in row for row in rows):
            fieldnames.insert(fieldnames.index("time_to_target_s") + 1, RATIO)
        writer = csv.DictWriter(f, fieldnames=fieldnames, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for row in rows:
        curve = row["accuracy_curve"]
        # The baseline stands out: black and dashed.
        style = {"color": "black", "linestyle": "--"} if row["scheme"] == BASELINE else {}
        accuracy = [p["test_accuracy"] for p in curve]
        by_time.plot([p["elapsed_s"] for p in curve], accuracy, label=row["scheme"], **style)
        by_step.plot([p["step"] for p in curve], accuracy, label=row["scheme"], **style)
    for ax, xlabel in ((by_time, "wall time (s)"), (by_step, "step")):
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    by_time.set_ylabel("test accuracy")
    by_step.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_dir / "compare.png", dpi=120)
    plt.close(fig)


def print_table(rows: list[dict[str, Any]], target: float, console: Console | None = None) -> None:
    """The comparison as a table; with a "vs ddp" column (time to target over DDP's) where the
    baseline ran."""

    def number(header: str) -> Column:
        return Column(header, justify="right", no_wrap=True)

    ratios = any(RATIO in r for r in rows)
    table = Table(
        Column("scheme", no_wrap=True),
        number(f"to {target:.0%}\n(s)"),
        *([number("vs\nddp")] if ratios else []),
        number(f"steps\nto {target:.0%}"),
        number("final\nacc"),
        number("samples/s"),
        number("staleness\nmean/max"),
        number("wait"),
        title="gradps compare",
    )
    for r in rows:
        cells = [
            r["scheme"],
            _cell(r["time_to_target_s"], "{:.2f}", "never"),
            *([_cell(r.get(RATIO), "{:.2f}x")] if ratios else []),
            _cell(r["steps_to_target"], "{}"),
            _cell(r.get("final_test_accuracy"), "{:.4f}", r["state"]),
            f"{r['samples_per_second']:,.0f}",
            f"{r['mean_staleness']:.2f} / {r['max_staleness']}",
            _cell(r.get("wait_fraction"), "{:.0%}"),
        ]
        table.add_row(*cells)
    (console or table_console()).print(table)


def _cell(value: Any, form: str, missing: str = "-") -> str:
    return missing if value is None else form.format(value)
