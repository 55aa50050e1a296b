"""Following a run: live progress, metrics.jsonl and summary.json in the run folder."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from client.sdk import Client, GradpsError
from client.tensorboard import RunBoard
from gradps import run_figures
from gradps.codec_table import format_codec
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import run_pb2

_ENDED = (cpb.RUN_STATE_COMPLETED, cpb.RUN_STATE_FAILED, cpb.RUN_STATE_STOPPED)


def model_of(spec: run_pb2.RunSpec) -> str:
    """A run's model as listings show it: `spec.model`, or "script:NAME" for a run whose workers are
    `gradps launch`'s script NAME (RunSpec.script), which builds a model of its own."""
    return f"script:{spec.script}" if spec.script else spec.model


def summarize(run: cpb.RunStatus, shards: int) -> dict[str, Any]:
    """The numbers a user compares runs by, from the run's last status (gradps.run_figures)."""
    latest = list(run.latest)
    final = run_figures.final_report(latest)
    wall = (run.finished_at or run.started_at) - run.started_at if run.started_at else 0.0
    rates = run_figures.rates_by_rank(latest)
    return {
        "run_id": run.run_id,
        "state": cpb.RunState.Name(run.state).removeprefix("RUN_STATE_").lower(),
        "message": run.message,
        "scheme": run.spec.scheme,
        "model": model_of(run.spec),
        "dataset": "its own data" if run.spec.script else run.spec.dataset,
        "codec": format_codec(run.spec.codec),
        "workers": run.spec.workers,
        "dead_workers": list(run.dead_workers),
        "shards": shards,
        "steps": run_figures.highest_step(latest),
        "total_steps": run.total_steps,
        "wall_seconds": round(wall, 3),
        "samples_per_second": round(sum(rates.values()), 1),
        "samples_per_second_by_rank": [round(rate, 1) for rate in rates.values()],
        "final_test_accuracy": final.test_accuracy if final is not None else None,
        "final_test_loss": final.test_loss if final is not None else None,
        "final_loss": run_figures.mean_loss(latest),
        "bytes_pushed": sum(m.bytes_pushed for m in latest),
        "bytes_pulled": sum(m.bytes_pulled for m in latest),
        "mean_staleness": run_figures.mean_staleness(latest) or 0.0,
        "max_staleness": max((m.staleness_max for m in latest), default=0),
        "wait_fraction": run_figures.wait_fraction(latest) or 0.0,
        "joins": run.joins,
        "shard_restores": run.restores,
        "rolled_back_steps": run.rolled_back_steps,
    }


def run_progress(console: Console, disable: bool = False) -> Progress:
    """A progress display of runs that fits 80 columns: scheme, a bar that takes what is left,
    steps done of the total (`?` until the run is placed), loss, test accuracy, samples/s, time
    spent and time left."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=None),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(compact=True),
        console=console,
        disable=disable,
        transient=False,
        expand=True,
    )


def metrics_row(m: cpb.Metrics) -> dict[str, Any]:
    """One line of metrics.jsonl: every field, numbers as numbers, null where not evaluated."""
    row: dict[str, Any] = {}
    for field in m.DESCRIPTOR.fields:
        value = getattr(m, field.name)
        if field.name in ("test_accuracy", "test_loss") and value < 0:
            value = None  # the worker did not evaluate at this report
        elif isinstance(value, bytes):
            value = value.hex()
        row[field.name] = value
    return row


def follow(
    client: Client,
    run_id: str,
    out_dir: Path,
    show_progress: bool = True,
    tensorboard: Path | None = None,
    console: Console | None = None,
    until: float | None = None,
    interrupt_stops: bool = True,
) -> dict[str, Any]:
    """Watch a run to its end, writing metrics.jsonl as events arrive and summary.json at the end;
    with `tensorboard`, its curves as event files there too (client.tensorboard). Progress and
    notices (the run starts, a worker dies) go to `console`, stderr by default. `until`: stop the
    run at its first evaluation on the way with at least this test accuracy; its curve then ends
    there, and its final figures are that evaluation's. An interrupt (Ctrl-C, SIGTERM) stops the
    run, the one this client started; with `interrupt_stops` False the client only leaves it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    board = RunBoard(tensorboard) if tensorboard is not None else None
    console = console or Console(stderr=True)
    shards = len(client.cluster().shards)
    evaluations: list[cpb.Metrics] = []
    run = client.run(run_id).run
    with (
        open(out_dir / "metrics.jsonl", "w") as log,
        run_progress(console, disable=not show_progress) as progress,
    ):
        notices = _Notices(progress.console if show_progress else console, run)
        notices.console.print(f"run {run_id}: {run.spec.scheme}, {_count(run.spec.workers, 'worker')}")
        waiting = f"waiting for {_count(run.spec.workers, 'worker')}" if run.state == cpb.RUN_STATE_PENDING else ""
        task = progress.add_task(run.spec.scheme, total=run.total_steps or None, stats=waiting or "starting")
        accuracy: float | None = None
        reached: cpb.Metrics | None = None  # the evaluation that reached `until`
        try:
            for event in client.watch(run_id):
                run = event.run
                notices.update(run)
                if event.HasField("metrics"):
                    m = event.metrics
                    log.write(json.dumps(metrics_row(m)) + "\n")
                    log.flush()
                    if board is not None:
                        board.add(run, m)
                    if m.test_accuracy >= 0 and reached is None:
                        accuracy = m.test_accuracy
                        evaluations.append(m)
                        if until is not None and run_figures.evaluated_on_the_way(m) and m.test_accuracy >= until:
                            reached = m if _stop_at_target(client, run_id, m, until, notices.console) else None
                _show(progress, task, run, accuracy)
                if run.state in _ENDED:
                    break
        except (KeyboardInterrupt, SystemExit):
            _interrupted(client, run_id, interrupt_stops)
            raise
        finally:
            if board is not None:
                board.close(run.latest)
    summary = summarize(run, shards)
    if reached is not None and run.state == cpb.RUN_STATE_STOPPED:
        # Stopped where it reached the target (not by the race of a run that completed first).
        summary.update(final_test_accuracy=reached.test_accuracy, final_test_loss=reached.test_loss)
        summary["reached_target_at_step"] = reached.step
        summary["accuracy_curve"] = accuracy_curve(evaluations, [])
    else:
        summary["accuracy_curve"] = accuracy_curve(evaluations, run.latest)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def accuracy_curve(evaluations: Sequence[cpb.Metrics], latest: Sequence[cpb.Metrics]) -> list[dict[str, Any]]:
    """The run's test accuracy as it trained: its evaluations on the way, then the final model's,
    once (`run_figures.evaluated_on_the_way`, `run_figures.final_report`): each rank's done report
    evaluates a model, on its own clock, and under asgd and ssp not always the final one."""
    points = [m for m in evaluations if run_figures.evaluated_on_the_way(m)]
    if (final := run_figures.final_report(latest)) is not None:
        points.append(final)
    return [{"elapsed_s": m.elapsed_s, "step": m.step, "test_accuracy": m.test_accuracy} for m in points]


class _Notices:
    """One line above the progress bar when a run starts, when a worker of it dies or a new one
    joins in an empty rank, when it is scaled, and when it went on from its checkpoints after a
    shard restarted."""

    def __init__(self, console: Console, run: cpb.RunStatus) -> None:
        self.console = console
        self.started = run.state != cpb.RUN_STATE_PENDING
        self.dead = set(run.dead_workers)
        self.restores, self.rolled_back = run.restores, run.rolled_back_steps
        self.workers = list(run.workers)
        self.scaled_to = run.scaled_to

    def update(self, run: cpb.RunStatus) -> None:
        if not self.started and run.state == cpb.RUN_STATE_RUNNING:
            self.started = True
            workers = ", ".join(map(str, run.workers))
            self.console.print(f"run {run.run_id} started: {run.spec.scheme} on workers {workers}")
        for worker_id in sorted(set(run.dead_workers) - self.dead):
            self.dead.add(worker_id)
            step = next((m.step for m in run.latest if m.worker_id == worker_id), 0)
            live = len(run.workers) - len(self.dead)
            self.console.print(
                f"[yellow]worker {worker_id} died at step {step} (no heartbeat); {live} of {len(run.workers)} go on"
            )
        for rank, worker_id in enumerate(run.workers):
            if rank < len(self.workers) and self.workers[rank] != worker_id and worker_id not in self.dead:
                step = run_figures.highest_step(run.latest)
                self.console.print(f"[green]worker {worker_id} joined in rank {rank}, near step {step}")
        self.workers = list(run.workers)
        if run.scaled_to != self.scaled_to:
            self.scaled_to = run.scaled_to
            if run.scaled_to:  # 0 before any scaling
                self.console.print(f"run scaled to {run.scaled_to} of its {len(run.workers)} ranks")
        if run.restores > self.restores:
            again = run.rolled_back_steps - self.rolled_back
            self.restores, self.rolled_back = run.restores, run.rolled_back_steps
            redo = f", {_count(again, 'step')} to do again" if again else ""
            self.console.print(f"[yellow]a shard restarted; the run goes on from its checkpoints{redo}")


def _show(progress: Progress, task: TaskID, run: cpb.RunStatus, accuracy: float | None) -> None:
    latest = list(run.latest)
    if latest:
        loss, rate = run_figures.mean_loss(latest), run_figures.samples_per_second(latest)
        acc = f"{accuracy:.3f}" if accuracy is not None else "-"
        progress.update(
            task,
            total=run.total_steps or None,
            completed=run_figures.mean_step(latest),
            stats=f"loss {loss:.3f} acc {acc} {_rate(rate)}",
        )
    elif run.state == cpb.RUN_STATE_RUNNING:
        progress.update(task, total=run.total_steps or None, stats="starting")


def _rate(samples_per_second: float) -> str:
    if samples_per_second >= 10_000:
        return f"{samples_per_second / 1000:.0f}k/s"
    if samples_per_second >= 1000:
        return f"{samples_per_second / 1000:.1f}k/s"
    return f"{samples_per_second:.0f}/s"


def _stop_at_target(client: Client, run_id: str, reached: cpb.Metrics, target: float, console: Console) -> bool:
    """Stop a run whose evaluation `reached` the target: the rest of it is not trained. False
    where the coordinator refused (a run that ended meanwhile, its last step near, is left as it
    ended) or did not answer (the next evaluation tries again)."""
    why = f"reached {target * 100:g}% test accuracy at step {reached.step} ({reached.elapsed_s:.1f} s)"
    try:
        client.stop(run_id, f"stopped: {why}")
    except GradpsError:
        return False
    console.print(f"run {run_id} {why}: stopped")
    return True


def _interrupted(client: Client, run_id: str, stops: bool) -> None:
    """The user interrupted (Ctrl-C, SIGTERM: see client.usage) while following a run. `stops`:
    the run is this client's, stop it, as a run nobody follows would go on holding the cluster's
    workers; else leave it going on."""
    console = Console(stderr=True)
    if not stops:
        console.print(f"left run {run_id}, which goes on (gradps stop {run_id} stops it)")
        return
    try:
        client.stop(run_id)
        console.print(f"stopped run {run_id}")
    except GradpsError as e:
        console.print(f"run {run_id} may still be running: {e}")


def print_summary(summary: dict[str, Any], console: Console | None = None) -> None:
    """What a user reads of a run: its outcome (a failed run's reason), what ran, how fast, how
    well, in human units, leaving out what does not apply (staleness of a sync run, accuracy never
    evaluated). summary.json keeps every figure."""
    from rich.table import Table

    s = summary
    table = Table(title=f"run {s['run_id']}: {s['state']}", show_header=False, box=None, padding=(0, 2))
    row = table.add_row
    if s["message"]:
        row("reason" if s["state"] != "completed" else "note", s["message"])
    row("run", f"{s['scheme']}, {s['model']} on {s['dataset']}, codec {s['codec']}")
    joined = f"; {s['joins']} joined" if s.get("joins") else ""
    dead = (
        f" ({len(s['dead_workers'])} died: {', '.join(map(str, s['dead_workers']))}{joined})"
        if s["dead_workers"]
        else ""
    )
    row("cluster", f"{_count(s['workers'], 'worker')}{dead}, {_count(s['shards'], 'shard')}")
    row("steps", f"{s['steps']:,} of {s['total_steps']:,}" if s["total_steps"] else f"{s['steps']:,}")
    if s.get("shard_restores"):
        again = f", {s['rolled_back_steps']:,} steps done again" if s["rolled_back_steps"] else ""
        row("restarts", f"{_count(s['shard_restores'], 'shard restart')}{again}")
    if s["steps"]:
        row("time", f"{s['wall_seconds']:.1f} s")
        rates = s["samples_per_second_by_rank"]
        by_rank = f" (by rank: {', '.join(f'{r:,.0f}' for r in rates)})" if len(rates) > 1 else ""
        row("samples/s", f"{s['samples_per_second']:,.0f}{by_rank}")
    if s["final_test_accuracy"] is not None:
        row("test accuracy", f"{s['final_test_accuracy']:.4f} (loss {s['final_test_loss']:.4f})")
    if s["final_loss"] is not None:
        row("training loss", f"{s['final_loss']:.4f}")
    if s["bytes_pushed"] or s["bytes_pulled"]:
        row("traffic", f"{_bytes(s['bytes_pushed'])} pushed, {_bytes(s['bytes_pulled'])} pulled")
    if s["max_staleness"]:
        row("staleness", f"{s['mean_staleness']:.2f} versions on average, at most {s['max_staleness']}")
    if s["wait_fraction"]:
        row("waiting", f"{s['wait_fraction']:.0%} of the time, in exchanges with the shards")
    (console or Console()).print(table)


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n} B"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"
