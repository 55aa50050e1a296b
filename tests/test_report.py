"""What `gradps train` and `gradps compare` show while a run trains (client/report.py): a progress
line that fits an 80-column terminal with the step count, the time spent and left; a notice when a
worker dies; a summary in human units that leaves out what does not apply and gives a failed run's
reason."""

import io
import re
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from client.local_cluster import LocalCluster
from client.report import accuracy_curve, follow, print_summary, run_progress, summarize
from client.sdk import Client
from gradps import run_figures
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import run_pb2


def _render(total: float | None, completed: float) -> str:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, no_color=True, width=160)
    with run_progress(console) as progress:
        task = progress.add_task("sync r-1", total=total, stats="waiting")
        progress.update(task, completed=completed)
    return out.getvalue()


def test_a_run_not_yet_placed_shows_an_unknown_total():
    # The total is 0 (unknown) until the run is placed: the display must not fail on it.
    assert " 0/? waiting" in _render(None, 0)


def test_steps_are_shown_as_done_of_total():
    assert " 37/400 waiting" in _render(400, 37.5)


def _run(state: int, steps: int, message: str = "") -> cpb.RunStatus:
    run = cpb.RunStatus(run_id="20261201-000000-abcd", state=state, message=message, total_steps=600)
    run.spec.CopyFrom(run_pb2.RunSpec(scheme="sync-backup1", model="mlp", dataset="digits", workers=4))
    run.workers.extend([0, 1, 2, 3])
    run.started_at, run.finished_at = 100.0, 112.5
    for rank in range(4 if steps else 0):
        run.latest.add(
            worker_id=rank, rank=rank, step=steps, loss=0.1234, samples=32 * steps, elapsed_s=4.0 + rank,
            bytes_pushed=3 << 20, bytes_pulled=5 << 20, wait_s=1.0, test_accuracy=-1.0,
        )  # fmt: skip
    return run


def test_the_progress_line_fits_80_columns_with_steps_time_and_eta() -> None:
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=True, color_system=None)
    with run_progress(console) as progress:
        task = progress.add_task("sync-backup1", total=600, stats="")
        progress.update(task, completed=432, stats="loss 0.123 acc 0.950 12k/s")
        progress.refresh()
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # the terminal's control codes
    lines = [line for line in screen.replace("\r", "\n").split("\n") if "432/600" in line]
    assert lines, out.getvalue()
    for line in lines:
        assert len(line.rstrip()) <= 80, line
        assert "sync-backup1" in line and "loss 0.123 acc 0.950 12k/s" in line and "eta" in line, line
        assert ":" in line.split("432/600")[1], line  # the clock


def test_the_summary_reads_in_human_units_and_a_failed_run_gives_its_reason() -> None:
    out = io.StringIO()
    print_summary(summarize(_run(cpb.RUN_STATE_COMPLETED, 600), 2), Console(file=out, width=80))
    text = out.getvalue()
    assert "12.5 s" in text and "12.0 MiB pushed, 20.0 MiB pulled" in text
    assert "staleness" not in text and "test accuracy" not in text  # never pushed stale, never evaluated
    assert "by rank: 4,800, 3,840, 3,200, 2,743" in text
    assert max(len(line) for line in text.splitlines()) <= 80

    out = io.StringIO()
    failed = _run(cpb.RUN_STATE_FAILED, 0, message="worker 1: dataset 'nope' is not one of digits, ...")
    print_summary(summarize(failed, 2), Console(file=out, width=80))
    text = out.getvalue()
    assert "failed" in text and "reason" in text and "dataset 'nope'" in text
    assert "samples/s" not in text and "traffic" not in text and "0.0000" not in text


def _done(rank: int, accuracy: float, final_model: bool = False) -> cpb.Metrics:
    return cpb.Metrics(worker_id=rank + 7, rank=rank, done=True, test_accuracy=accuracy, final_model=final_model)


def test_the_final_accuracy_is_the_final_models_and_rank_0s_where_no_report_holds_it() -> None:
    # asgd: rank 0 finished first and evaluated a snapshot; rank 1 pulled after every last push.
    snapshot, final = _done(0, 0.80), _done(1, 0.95, final_model=True)
    assert run_figures.final_report([snapshot, final]) is final
    assert run_figures.latest_test_accuracy([snapshot, final]) == 0.95
    # sync: every replica holds the final model, rank 0's stands for them.
    assert run_figures.final_report([_done(1, 0.91, True), _done(0, 0.9, True)]).rank == 0
    # No report says it holds the final model (an old worker): rank 0's, as before.
    assert run_figures.latest_test_accuracy([_done(1, 0.7), _done(0, 0.8)]) == 0.8
    # Running: only rank 0 evaluates, its latest evaluation is the run's.
    running = [cpb.Metrics(rank=0, test_accuracy=0.5), cpb.Metrics(rank=1, test_accuracy=-1.0)]
    assert run_figures.final_report(running) is None and run_figures.latest_test_accuracy(running) == 0.5
    assert run_figures.latest_test_accuracy([cpb.Metrics(rank=0, test_accuracy=-1.0)]) is None
    # The summary and `gradps runs` read the same report.
    status = cpb.RunStatus(run_id="r", state=cpb.RUN_STATE_COMPLETED, latest=[snapshot, final])
    assert summarize(status, 2)["final_test_accuracy"] == 0.95


def test_the_accuracy_curve_is_rank_0s_evaluations_then_the_final_models_once() -> None:
    def evaluated(rank: int, step: int, elapsed_s: float, accuracy: float, **done: bool) -> cpb.Metrics:
        return cpb.Metrics(rank=rank, step=step, elapsed_s=elapsed_s, test_accuracy=accuracy, **done)

    on_the_way = [evaluated(0, 20, 0.2, 0.5), evaluated(0, 40, 0.4, 0.7)]
    # wagma: rank 1 (which started earlier) reports done first, on its own clock; both hold the
    # final model, whose point rank 0's report gives, once, after its evaluations.
    rank_1 = evaluated(1, 60, 0.9, 0.8, done=True, final_model=True)
    rank_0 = evaluated(0, 60, 0.6, 0.8, done=True, final_model=True)
    curve = accuracy_curve([*on_the_way, rank_1, rank_0], [rank_0, rank_1])
    assert [(p["step"], p["elapsed_s"]) for p in curve] == [(20, 0.2), (40, 0.4), (60, 0.6)]
    # asgd: rank 0 evaluated a snapshot at its end; rank 1's report holds the final model.
    snapshot = evaluated(0, 60, 0.6, 0.9, done=True)
    final = evaluated(1, 60, 0.7, 0.85, done=True, final_model=True)
    curve = accuracy_curve([*on_the_way, snapshot, final], [snapshot, final])
    assert [p["test_accuracy"] for p in curve] == [0.5, 0.7, 0.85]
    # A run that failed before any done report: the evaluations on the way.
    assert len(accuracy_curve(on_the_way, [on_the_way[-1]])) == 2


@pytest.mark.slow
def test_a_worker_that_dies_mid_run_is_announced(tmp_path: Path) -> None:
    out = io.StringIO()
    console = Console(file=out, width=80)
    spec = run_pb2.RunSpec(scheme="asgd", workers=3, batch_size=32, steps=100000, eval_every=0)
    with LocalCluster(shards=1, workers=3, heartbeat_timeout_s=1.0) as cluster, Client(cluster.address) as client:
        run_id = client.submit(spec)

        def kill_one_then_stop() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not any(m.step for m in client.run(run_id).run.latest):
                time.sleep(0.2)
            cluster.workers[2].kill()
            while time.monotonic() < deadline and not client.run(run_id).run.dead_workers:
                time.sleep(0.2)
            time.sleep(1.0)
            client.stop(run_id)

        killer = threading.Thread(target=kill_one_then_stop, daemon=True)
        killer.start()
        summary = follow(client, run_id, tmp_path, show_progress=False, console=console)
        killer.join(timeout=10)
    text = out.getvalue()
    (dead,) = summary["dead_workers"]
    assert f"worker {dead} died at step" in text and "(no heartbeat); 2 of 3 go on" in text, text
