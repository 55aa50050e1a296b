"""The figures users compare runs by, from the workers' latest reports: one definition each, for
the progress bar, the summary, the comparison tables and TensorBoard alike."""

from __future__ import annotations

from collections.abc import Sequence

from gradps.v1 import coordinator_pb2 as cpb


def samples_per_second(latest: Sequence[cpb.Metrics]) -> float:
    """The sum of each worker's own rate (its samples over its own elapsed time): a straggler that
    finishes last does not hide the others' speed."""
    return sum(rates_by_rank(latest).values())


def rates_by_rank(latest: Sequence[cpb.Metrics]) -> dict[int, float]:
    """Each rank's samples/s: shows a straggler, and whether the others waited for it."""
    return {m.rank: m.samples / m.elapsed_s for m in sorted(latest, key=lambda m: m.rank) if m.elapsed_s > 0}


def mean_staleness(latest: Sequence[cpb.Metrics]) -> float | None:
    """Versions a pushed gradient was behind, on average over every push; None before any push."""
    pushes = sum(m.pushes for m in latest)
    return sum(m.staleness_sum for m in latest) / pushes if pushes else None


def wait_fraction(latest: Sequence[cpb.Metrics]) -> float | None:
    """The share of the workers' time spent blocked in exchanges with the shards (pulls, pushes,
    rounds); None before any report."""
    busy = sum(m.elapsed_s for m in latest)
    return sum(m.wait_s for m in latest) / busy if busy > 0 else None


def mean_step(latest: Sequence[cpb.Metrics]) -> float:
    return sum(m.step for m in latest) / len(latest) if latest else 0.0


def mean_loss(latest: Sequence[cpb.Metrics]) -> float | None:
    return sum(m.loss for m in latest) / len(latest) if latest else None
