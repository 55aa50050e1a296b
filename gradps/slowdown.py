"""Emulated uneven workers (`--straggler RANK:FACTOR`, `--jitter`): the same slowdown for a
gradps worker and for a rank of the torch DDP baseline, so that the two compare fairly."""

from __future__ import annotations

import random
import time

from gradps.v1 import run_pb2


class Slowdown:
    """Emulated uneven workers: a straggler rank's steps take FACTOR times as long, and with
    probability `jitter` any step takes twice as long (like WAGMA's uneven sample lengths)."""

    def __init__(self, spec: run_pb2.RunSpec, rank: int) -> None:
        self.factor = spec.straggler_factor if spec.straggler_factor > 1 and spec.straggler_rank == rank else 1.0
        self.jitter = spec.jitter
        self._rng = random.Random(spec.seed * 1000 + rank)

    def after(self, step_seconds: float) -> None:
        """Sleep after a step that took `step_seconds`, as long as this rank's slowdown asks."""
        extra = (self.factor - 1.0) * step_seconds
        if self.jitter and self._rng.random() < self.jitter:
            extra += step_seconds
        if extra > 0:
            time.sleep(extra)
