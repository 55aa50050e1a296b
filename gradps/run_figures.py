"""The figures users compare runs by, from the workers' latest reports: one definition each, for
the progress bar, the summary, the comparison tables, TensorBoard, `gradps runs` and the
coordinator's run store alike."""

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


def highest_step(latest: Sequence[cpb.Metrics]) -> int:
    """How far the run got, as listings show it: the furthest step a worker reported."""
    return max((m.step for m in latest), default=0)


def mean_step(latest: Sequence[cpb.Metrics]) -> float:
    return sum(m.step for m in latest) / len(latest) if latest else 0.0


def mean_loss(latest: Sequence[cpb.Metrics]) -> float | None:
    return sum(m.loss for m in latest) / len(latest) if latest else None


def evaluated_on_the_way(report: cpb.Metrics) -> bool:
    """Whether `report` is a point of the run's accuracy curve before its end: rank 0's evaluations
    (the only rank that evaluates before its end: one clock). `final_report` gives its last point."""
    return report.rank == 0 and not report.done and report.test_accuracy >= 0


def final_report(latest: Sequence[cpb.Metrics]) -> cpb.Metrics | None:
    """The done report whose test accuracy is the run's final one: one that evaluated the model
    the run ends with and exports (Metrics.final_model; under asgd and ssp a worker that finished
    before another's last push evaluated a snapshot), rank 0's first among those; rank 0's where
    none did. None before a done report with an evaluation."""
    done = [m for m in latest if m.done and m.test_accuracy >= 0]
    return max(done, key=lambda m: (m.final_model, m.rank == 0), default=None)


def latest_test_accuracy(latest: Sequence[cpb.Metrics]) -> float | None:
    """The run's test accuracy as listings show it: the final report's once there is one, else
    the last evaluation among the reports (rank 0's: the only rank that evaluates before its end);
    None when nothing was evaluated."""
    if (final := final_report(latest)) is not None:
        return final.test_accuracy
    evaluated = [m.test_accuracy for m in latest if m.test_accuracy >= 0]
    return evaluated[-1] if evaluated else None
