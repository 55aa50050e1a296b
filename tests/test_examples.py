"""The examples run as documented."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_own_training_loop_example_trains():
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "own_training_loop.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", r.stdout).group(1))
    assert accuracy >= 0.9
