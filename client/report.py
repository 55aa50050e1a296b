"""Following a run: live progress, metrics.jsonl and summary.json in the run folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from client.sdk import Client, GradpsError
from gradps.codecs import format_codec
from gradps.v1 import coordinator_pb2 as cpb

_ENDED = (cpb.RUN_STATE_COMPLETED, cpb.RUN_STATE_FAILED, cpb.RUN_STATE_STOPPED)


def summarize(run: cpb.RunStatus, final: cpb.Metrics | None, shards: int) -> dict[str, Any]:
    """The numbers a user compares runs by, from the run's last status."""
    latest = list(run.latest)
    wall = (run.finished_at or run.started_at) - run.started_at if run.started_at else 0.0
    pushes = sum(m.pushes for m in latest)
    rates = [m.samples / m.elapsed_s if m.elapsed_s > 0 else 0.0 for m in sorted(latest, key=lambda m: m.rank)]
    busy = sum(m.elapsed_s for m in latest)
    return {
        "run_id": run.run_id,
        "state": cpb.RunState.Name(run.state).removeprefix("RUN_STATE_").lower(),
        "message": run.message,
        "scheme": run.spec.scheme,
        "model": run.spec.model,
        "dataset": run.spec.dataset,
        "codec": format_codec(run.spec.codec),
        "workers": run.spec.workers,
        "dead_workers": list(run.dead_workers),
        "shards": shards,
        "steps": max((m.step for m in latest), default=0),
        "total_steps": run.total_steps,
        "wall_seconds": round(wall, 3),
        # Sum of each worker's own rate: a straggler that finishes last does not hide the others'.
        "samples_per_second": round(sum(rates), 1),
        # Each rank's own rate, by rank: shows a straggler, and whether the others waited for it.
        "samples_per_second_by_rank": [round(rate, 1) for rate in rates],
        "final_test_accuracy": final.test_accuracy if final is not None else None,
        "final_test_loss": final.test_loss if final is not None else None,
        "final_loss": sum(m.loss for m in latest) / len(latest) if latest else None,
        "bytes_pushed": sum(m.bytes_pushed for m in latest),
        "bytes_pulled": sum(m.bytes_pulled for m in latest),
        "mean_staleness": sum(m.staleness_sum for m in latest) / pushes if pushes else 0.0,
        "max_staleness": max((m.staleness_max for m in latest), default=0),
        "wait_fraction": sum(m.wait_s for m in latest) / busy if busy > 0 else 0.0,
    }


def run_progress(console: Console, disable: bool = False) -> Progress:
    """A progress display of runs: steps done of the total (shown as `?` until the run is placed)."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("step"),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
        console=console,
        disable=disable,
        transient=False,
    )


def follow(client: Client, run_id: str, out_dir: Path, show_progress: bool = True) -> dict[str, Any]:
    """Watch a run to its end, writing metrics.jsonl as events arrive and summary.json at the end."""
    out_dir.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    shards = len(client.cluster().shards)
    final: cpb.Metrics | None = None
    curve: list[dict[str, Any]] = []
    run = client.run(run_id).run
    with (
        open(out_dir / "metrics.jsonl", "w") as log,
        run_progress(console, disable=not show_progress) as progress,
    ):
        waiting = f"waiting for {run.spec.workers} workers" if run.state == cpb.RUN_STATE_PENDING else "starting"
        task = progress.add_task(f"{run.spec.scheme} {run_id}", total=run.total_steps or None, stats=waiting)
        accuracy = float("nan")
        try:
            for event in client.watch(run_id):
                run = event.run
                if event.HasField("metrics"):
                    m = event.metrics
                    row = MessageToDict(m, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                    if m.test_accuracy >= 0:
                        accuracy = m.test_accuracy
                        curve.append({"elapsed_s": m.elapsed_s, "step": m.step, "test_accuracy": m.test_accuracy})
                    if m.done and m.test_accuracy >= 0:
                        final = m
                latest = list(run.latest)
                if latest:
                    elapsed = max(m.elapsed_s for m in latest)
                    rate = sum(m.samples for m in latest) / elapsed if elapsed > 0 else 0.0
                    loss = sum(m.loss for m in latest) / len(latest)
                    progress.update(
                        task,
                        total=run.total_steps or None,
                        completed=sum(m.step for m in latest) / len(latest),
                        stats=f"loss {loss:.4f}  test acc {accuracy:.4f}  {rate:,.0f} samples/s",
                    )
                elif run.state == cpb.RUN_STATE_RUNNING:
                    progress.update(task, total=run.total_steps or None, stats="starting")
                if run.state in _ENDED:
                    break
        except (KeyboardInterrupt, SystemExit):
            _stop_interrupted(client, run_id)
            raise
    summary = summarize(run, final, shards)
    summary["accuracy_curve"] = curve
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _stop_interrupted(client: Client, run_id: str) -> None:
    """The user interrupted (Ctrl-C, SIGTERM: see client.usage) while following a run: stop it, as
    a run nobody follows would go on holding the cluster's workers."""
    console = Console(stderr=True)
    try:
        client.stop(run_id)
        console.print(f"stopped run {run_id}")
    except GradpsError as e:
        console.print(f"run {run_id} may still be running: {e}")


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    """A two-column table of a run's summary."""
    from rich.table import Table

    table = Table(title=f"run {summary['run_id']} — {summary['state']}", show_header=False)
    for key, value in summary.items():
        if key in ("run_id", "accuracy_curve"):
            continue
        if isinstance(value, float):
            value = f"{value:,.4f}"
        elif isinstance(value, int) and key.startswith("bytes"):
            value = f"{value:,}"
        table.add_row(key, str(value))
    (console or Console()).print(table)
