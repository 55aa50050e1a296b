"""`gradps compare --repeats N`: the whole comparison N times, each scheme's figures as medians
and ranges, "vs ddp" from each repeat's own DDP run."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from client.cli import cli
from client.compare import RATIO, combine_repeats


def _run(repeat: int, seconds: float | None, steps: int | None, ratio: float | None, state: str = "completed") -> dict:
    curve = [{"elapsed_s": seconds or 9.0, "step": steps or 90, "test_accuracy": 0.96 if seconds else 0.5}]
    return {
        "scheme": "asgd",
        "repeat": repeat,
        "time_to_target_s": seconds,
        "steps_to_target": steps,
        RATIO: ratio,
        "final_test_accuracy": 0.95 + repeat / 1000,
        "samples_per_second": 1000.0 * repeat,
        "wait_fraction": 0.5,
        "wall_seconds": 10.0,
        "bytes_pushed": 100,
        "mean_staleness": float(repeat),
        "max_staleness": repeat * 2,
        "state": state,
        "samples_per_second_by_rank": [repeat],
        "accuracy_curve": curve,
    }


def test_repeats_combine_as_medians_where_a_run_that_never_reached_the_target_counts_as_slowest() -> None:
    runs = [_run(1, 3.0, 120, 1.2), _run(2, None, None, None), _run(3, 2.0, 100, 0.8)]
    (row,) = combine_repeats([[run] for run in runs])
    # Sorted: 2.0, 3.0, never: the median is repeat 1's, not the mean of the two that got there.
    assert row["time_to_target_s"] == 3.0 and row["steps_to_target"] == 120 and row[RATIO] == 1.2
    assert row["time_to_target_s_range"] == [2.0, 3.0] and row["steps_to_target_range"] == [100, 120]
    assert row[f"{RATIO}_range"] == [0.8, 1.2]
    assert row["reached"] == 2 and row["repeats"] == 3
    assert row["accuracy_curve"] is runs[0]["accuracy_curve"] and row["samples_per_second_by_rank"] == [1]
    assert row["samples_per_second"] == 2000.0 and row["final_test_accuracy"] == 0.952
    assert row["mean_staleness"] == 2.0 and row["max_staleness"] == 6
    assert row["runs"] == runs and row["state"] == "completed"
    # Two of three never reached it: the median is "never", the range still the one that did.
    runs = [_run(1, None, None, None), _run(2, 2.5, 110, 1.0), _run(3, None, None, None, "failed")]
    (row,) = combine_repeats([[run] for run in runs])
    assert row["time_to_target_s"] is None and row[RATIO] is None and row["reached"] == 1
    assert row["time_to_target_s_range"] == [2.5, 2.5] and row["state"] == "mixed"
    # One repeat: its rows as they are.
    only = [_run(1, 3.0, 120, 1.2)]
    assert combine_repeats([only]) is only


@pytest.mark.slow
def test_compare_repeats_the_whole_comparison_and_shows_medians_and_ranges(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    args = ["compare", "--baseline", "ddp", "--schemes", "asgd", "--workers", "2", "--shards", "1", "--device", "cpu"]
    args += ["--steps", "40", "--eval-every", "20", "--target-accuracy", "0.5", "--repeats", "2", "--no-progress"]
    result = CliRunner().invoke(cli, [*args, "--out", str(out)], env={"GRADPS_COORDINATOR": None})
    assert result.exit_code == 0, result.output
    assert "medians of 2 repeats" in result.output and "reached" in result.output
    written = json.loads((out / "compare.json").read_text())
    assert written["repeats"] == 2
    rows: dict[str, dict[str, Any]] = {r["scheme"]: r for r in written["schemes"]}
    assert list(rows) == ["asgd", "ddp"]
    for name, row in rows.items():
        runs = row["runs"]
        assert [run["repeat"] for run in runs] == [1, 2] and row["repeats"] == 2
        for run in runs:  # each repeat's runs in OUT/<repeat>/
            assert json.loads((out / str(run["repeat"]) / name / "summary.json").read_text())["scheme"] == name
        times = [run["time_to_target_s"] for run in runs]
        if None not in times:
            assert row["time_to_target_s"] == statistics.median(times)
            assert row["time_to_target_s_range"] == [min(times), max(times)]
    asgd_runs = rows["asgd"]["runs"]
    assert asgd_runs[0]["run_id"] != asgd_runs[1]["run_id"]
    # "vs ddp" is each repeat's time over that repeat's own DDP run.
    for run, ddp in zip(asgd_runs, rows["ddp"]["runs"], strict=True):
        if run["time_to_target_s"] is not None:
            assert run[RATIO] == round(run["time_to_target_s"] / ddp["time_to_target_s"], 3)
    with open(out / "compare.csv") as f:
        lines = list(csv.DictReader(f))
    assert [(line["scheme"], line["repeat"]) for line in lines] == [(s, r) for s in ("asgd", "ddp") for r in "12"]
    assert (out / "compare.png").stat().st_size > 0
