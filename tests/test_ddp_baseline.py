"""The torch DDP baseline of `gradps compare --baseline ddp`: real gloo ranks as processes on
loopback, and the compare command with it, end to end."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from client.cli import cli
from client.compare import COLUMNS, RATIO, row_of, with_backup_row
from client.ddp_baseline import BaselineFailed, run_ddp
from client.sdk import run_spec
from gradps.slowdown import Slowdown

CURVE_KEYS = {"elapsed_s", "step", "test_accuracy"}


def test_ddp_baseline_trains_digits_on_two_gloo_ranks(tmp_path: Path) -> None:
    spec = run_spec("sync", workers=2, steps=150, eval_every=25)
    summary = run_ddp(spec, "cpu", tmp_path / "ddp", tmp_path / "logs", show_progress=False)
    assert summary["backend"] == "gloo" and summary["steps"] == 150
    # Chance is 0.1 on the ten digits.
    assert summary["final_test_accuracy"] >= 0.8, summary
    row = row_of(summary, target=0.5)
    assert set(COLUMNS) <= set(row), set(COLUMNS) - set(row)
    assert row["scheme"] == "ddp" and row["state"] == "completed"
    assert row["mean_staleness"] == 0 and row["max_staleness"] == 0
    assert row["time_to_target_s"] is not None and row["steps_to_target"] is not None
    assert row["samples_per_second"] > 0 and len(row["samples_per_second_by_rank"]) == 2
    assert 0 < row["time_to_target_s"] < row["wall_seconds"]
    curve = row["accuracy_curve"]
    assert [p["step"] for p in curve] == [25, 50, 75, 100, 125, 150]
    assert all(set(p) == CURVE_KEYS for p in curve)
    assert curve[-1]["test_accuracy"] > curve[0]["test_accuracy"]
    assert json.loads((tmp_path / "ddp" / "summary.json").read_text())["scheme"] == "ddp"


def test_a_failing_rank_fails_the_baseline_in_one_line(tmp_path: Path) -> None:
    spec = run_spec("sync", workers=2, steps=5, model="no_such_module:model")
    with pytest.raises(BaselineFailed, match="cannot build model 'no_such_module:model'"):
        run_ddp(spec, "cpu", tmp_path / "ddp", tmp_path / "logs", show_progress=False)


def test_slowdown_slows_only_the_straggler_rank() -> None:
    spec = run_spec("sync", workers=2, straggler_rank=1, straggler_factor=3.0)
    assert Slowdown(spec, 1).factor == 3.0
    assert Slowdown(spec, 0).factor == 1.0


def test_compare_adds_sync_with_backup_workers_under_a_straggler_or_when_asked() -> None:
    def entries(straggler: bool, backup: int = 0, workers: int = 4, schemes=("sync", "asgd")):
        specs = [(s, run_spec(s, workers=workers, backup_workers=backup)) for s in schemes]
        rows = with_backup_row(specs, straggler)
        return [(name, spec.scheme_params.backup_workers if spec.scheme == "sync" else 0) for name, spec in rows]

    assert entries(straggler=False) == [("sync", 0), ("asgd", 0)]
    assert entries(straggler=True) == [("sync", 0), ("sync-backup1", 1), ("asgd", 0)]
    assert entries(straggler=False, backup=2) == [("sync", 0), ("sync-backup2", 2), ("asgd", 0)]
    assert entries(straggler=True, workers=1) == [("sync", 0), ("asgd", 0)]
    assert entries(straggler=True, schemes=("asgd",)) == [("asgd", 0)]


@pytest.mark.slow
def test_compare_with_the_ddp_baseline_writes_both_rows_and_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    args = ["compare", "--baseline", "ddp", "--schemes", "sync", "--workers", "2", "--shards", "1"]
    args += ["--device", "cpu", "--steps", "60", "--eval-every", "20", "--target-accuracy", "0.5"]
    args += ["--straggler", "1:1.5"]  # so sync runs with a backup worker too
    args += ["--no-progress", "--out", str(out)]
    result = CliRunner().invoke(cli, args, env={"GRADPS_COORDINATOR": None})
    assert result.exit_code == 0, result.output
    assert "vs" in result.output and "ddp" in result.output
    rows = {r["scheme"]: r for r in json.loads((out / "compare.json").read_text())["schemes"]}
    assert set(rows) == {"sync", "sync-backup1", "ddp"}
    assert rows["sync-backup1"]["state"] == "completed" and (out / "sync-backup1" / "summary.json").exists()
    sync, ddp = rows["sync"], rows["ddp"]
    assert ddp[RATIO] == 1.0 and sync[RATIO] is not None
    assert sync[RATIO] == round(sync["time_to_target_s"] / ddp["time_to_target_s"], 3)
    assert all(set(p) == CURVE_KEYS for p in ddp["accuracy_curve"])
    # sync is DDP's algorithm: same model, data split, optimizer and seed, so the same accuracy
    # at every evaluation (up to the order of the floating-point sums).
    assert sync["steps_to_target"] == ddp["steps_to_target"]
    by_step = {p["step"]: p["test_accuracy"] for p in sync["accuracy_curve"]}
    assert [p["step"] for p in ddp["accuracy_curve"]] == sorted(by_step)
    for point in ddp["accuracy_curve"]:
        assert abs(point["test_accuracy"] - by_step[point["step"]]) <= 0.02, (point, sync["accuracy_curve"])
    with open(out / "compare.csv") as f:
        table = list(csv.DictReader(f))
    assert RATIO in table[0] and [r["scheme"] for r in table] == ["sync", "sync-backup1", "ddp"]
    assert (out / "compare.png").stat().st_size > 0


@pytest.mark.slow
def test_compare_until_target_stops_every_run_and_the_baseline_at_its_first_evaluation_reaching_it(
    tmp_path: Path,
) -> None:
    out = tmp_path / "cmp"
    args = ["compare", "--baseline", "ddp", "--schemes", "sync,asgd", "--workers", "2", "--shards", "1"]
    args += ["--device", "cpu", "--steps", "400", "--eval-every", "10", "--target-accuracy", "0.8"]
    args += ["--until-target", "--no-progress", "--out", str(out)]
    result = CliRunner().invoke(cli, args, env={"GRADPS_COORDINATOR": None})
    assert result.exit_code == 0, result.output
    rows = {r["scheme"]: r for r in json.loads((out / "compare.json").read_text())["schemes"]}
    assert list(rows) == ["sync", "asgd", "ddp"]
    for name, row in rows.items():
        summary = json.loads((out / name / "summary.json").read_text())
        curve, reached = row["accuracy_curve"], row["steps_to_target"]
        # Stopped where it first reached the target, long before its 400 steps: that evaluation
        # ends its curve and is its final accuracy.
        assert row["state"] == "stopped" and reached is not None and reached < 200, (name, curve)
        assert all(p["test_accuracy"] < 0.8 for p in curve[:-1]) and curve[-1]["step"] == reached, (name, curve)
        assert row["final_test_accuracy"] == curve[-1]["test_accuracy"] >= 0.8
        assert row["time_to_target_s"] == round(curve[-1]["elapsed_s"], 3)
        assert summary["steps"] < summary["total_steps"] == 400, (name, summary["steps"])
        if name == "ddp":
            assert summary["steps"] == reached  # every rank left at that evaluation
        else:  # each run says why it stopped
            assert summary["message"] == (
                f"stopped: reached 80% test accuracy at step {reached} ({curve[-1]['elapsed_s']:.1f} s)"
            )
            assert f"run {row['run_id']} reached 80% test accuracy at step {reached}" in result.output
