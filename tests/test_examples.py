"""The examples run as documented."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_own_training_loop_example_trains(tmp_path):
    # As its docstring says: `gradps launch` starts a local cluster and the script as its 2 workers.
    out = tmp_path / "run"
    command = ["launch", "--workers", "2", "--epochs", "10", "--no-progress", "--out", str(out)]
    r = subprocess.run(
        [sys.executable, "-m", "client.cli", *command, str(ROOT / "examples" / "own_training_loop.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state"] == "completed"
    assert summary["final_test_accuracy"] >= 0.95
    assert (out / "model.pt").exists()
