"""`gradps compare`: every scheme on the same cluster, data, seed and model, side by side."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Column, Table

from client.report import follow
from client.sdk import Client
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


def to_target(curve: list[dict[str, Any]], target: float) -> tuple[float | None, int | None]:
    """Elapsed seconds and steps at the first evaluation reaching `target`; None when never."""
    for point in curve:
        if point["test_accuracy"] >= target:
            return round(point["elapsed_s"], 3), point["step"]
    return None, None


def run_comparison(
    address: str, specs: list[run_pb2.RunSpec], target: float, out_dir: Path, show_progress: bool = True
) -> list[dict[str, Any]]:
    """Run each spec in turn on the cluster at `address`; one row per scheme."""
    rows = []
    with Client(address) as client:
        for spec in specs:
            run_id = client.submit(spec)
            summary = follow(client, run_id, out_dir / spec.scheme, show_progress=show_progress)
            seconds, steps = to_target(summary["accuracy_curve"], target)
            row = {"scheme": spec.scheme, "time_to_target_s": seconds, "steps_to_target": steps}
            row.update({k: summary[k] for k in COLUMNS if k in summary and k not in row})
            row["state"] = summary["state"]
            row["samples_per_second_by_rank"] = summary["samples_per_second_by_rank"]
            row["accuracy_curve"] = summary["accuracy_curve"]
            rows.append(row)
    return rows


def write_outputs(rows: list[dict[str, Any]], target: float, out_dir: Path, title: str) -> None:
    """compare.json, compare.csv and compare.png (test accuracy against wall time and steps)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compare.json").write_text(
        json.dumps({"target_accuracy": target, "title": title, "schemes": rows}, indent=2) + "\n"
    )
    with open(out_dir / "compare.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for row in rows:
        curve = row["accuracy_curve"]
        by_time.plot([p["elapsed_s"] for p in curve], [p["test_accuracy"] for p in curve], label=row["scheme"])
        by_step.plot([p["step"] for p in curve], [p["test_accuracy"] for p in curve], label=row["scheme"])
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
    def number(header: str) -> Column:
        return Column(header, justify="right", no_wrap=True)

    table = Table(
        Column("scheme", no_wrap=True),
        number(f"to {target:.0%}\n(s)"),
        number(f"steps\nto {target:.0%}"),
        number("final\nacc"),
        number("samples/s"),
        number("staleness\nmean/max"),
        number("wait"),
        title="gradps compare",
    )
    for r in rows:
        table.add_row(
            r["scheme"],
            f"{r['time_to_target_s']:.2f}" if r["time_to_target_s"] is not None else "never",
            str(r["steps_to_target"]) if r["steps_to_target"] is not None else "-",
            f"{r['final_test_accuracy']:.4f}" if r.get("final_test_accuracy") is not None else r["state"],
            f"{r['samples_per_second']:,.0f}",
            f"{r['mean_staleness']:.2f} / {r['max_staleness']}",
            f"{r['wait_fraction']:.0%}",
        )
    (console or Console()).print(table)
