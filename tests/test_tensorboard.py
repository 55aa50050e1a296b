"""`gradps train --tensorboard DIR` writes a run's curves as TensorBoard event files, read back here
with TensorBoard's own event reader and checked against the run's metrics.jsonl and summary.json;
metrics.jsonl carries numbers as numbers and null where a worker did not evaluate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


@pytest.mark.slow
def test_a_local_run_writes_its_curves_for_tensorboard(tmp_path: Path) -> None:
    out, board = tmp_path / "run", tmp_path / "tb"
    args = ["train", "--local", "--scheme", "asgd", "--workers", "2", "--steps", "60", "--eval-every", "20"]
    args += ["--no-progress", "--out", str(out), "--tensorboard", str(board)]
    env = {k: v for k, v in os.environ.items() if k != "GRADPS_COORDINATOR"}
    done = subprocess.run(
        [sys.executable, "-m", "client.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    (run_dir,) = board.iterdir()  # one TensorBoard run, named by the gradps run
    assert run_dir.name == summary["run_id"]
    events = EventAccumulator(str(run_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "test_accuracy", "test_loss", "samples_per_second", "staleness", "wait_fraction"} <= tags

    # Test accuracy: the run's accuracy curve, as the summary has it: rank 0's evaluations on the
    # way, each at its step with its value, then the final model's once (asgd: a rank that finished
    # before the other's last push evaluated a snapshot, left out).
    on_the_way = sorted(
        (r["step"], r["test_accuracy"])
        for r in rows
        if r["rank"] == 0 and not r["done"] and r["test_accuracy"] is not None
    )
    curve = [(p["step"], p["test_accuracy"]) for p in summary["accuracy_curve"]]
    assert curve[:-1] == on_the_way and curve[-1][1] == summary["final_test_accuracy"]
    points = sorted((e.step, e.value) for e in events.Scalars("test_accuracy"))
    assert [s for s, _ in points] == [s for s, _ in curve]
    assert [v for _, v in points] == pytest.approx([v for _, v in curve], rel=1e-6)
    # Loss and throughput follow the run to its last step; samples/s are positive, wait a fraction.
    assert max(e.step for e in events.Scalars("loss")) == summary["steps"]
    assert all(e.value > 0 for e in events.Scalars("samples_per_second"))
    assert all(0 <= e.value <= 1 for e in events.Scalars("wait_fraction"))

    # metrics.jsonl: numbers as numbers; null, not -1, where a report carried no evaluation.
    assert all(isinstance(r["step"], int) and isinstance(r["bytes_pushed"], int) for r in rows)
    assert any(r["test_accuracy"] is None for r in rows) and all(
        r["test_accuracy"] is None or 0 <= r["test_accuracy"] <= 1 for r in rows
    )
