"""The same-run cost of checkpoints that `gradps bench step` reports, from steps and windows."""

import pytest

from client.bench.checkpoint_cost import checkpoint_cost


def _steps(times: list[float], start: float = 100.0) -> list[dict]:
    """Steps one after another from `start`, taking `times` seconds each."""
    records, at = [], start
    for t in times:
        records.append({"began_unix": at, "step_s": t})
        at += t
    return records


def test_the_steps_beside_a_checkpoint_are_measured_against_those_that_met_none():
    slowed = _steps([1.0] * 5 + [1.4, 1.2] + [1.0] * 13)  # steps 5 and 6: 105.0-107.6
    steady = _steps([1.0] * 20)
    cost = checkpoint_cost([slowed, steady], [[(105.2, 105.5)]], every_s=10)
    assert cost is not None
    # Worker one: step 5 overlaps the window, step 6 begins within one median step after it,
    # so both meet it (0.4 + 0.2 s); worker two's steps 5 and 6 meet it and lost nothing.
    assert cost.lost_s == pytest.approx((0.6 + 0.0) / 2)
    assert cost.fraction == pytest.approx(0.03)
    assert (cost.checkpoints, cost.steps_beside) == (1, 4)


def test_each_shard_checkpoint_counts_once_and_windows_outside_the_steps_not_at_all():
    slowed = _steps([1.0] * 4 + [2.0] + [1.0] * 10 + [2.0] + [1.0] * 4)  # steps 4 and 15
    windows = [
        [(104.5, 104.7), (116.0, 116.3), (500.0, 501.0)],  # shard 0: two within the steps, one after
        [(104.6, 104.9), (116.1, 116.4)],  # shard 1 at about the same times
    ]
    cost = checkpoint_cost([slowed], windows, every_s=10)
    assert cost is not None
    assert cost.checkpoints == 2  # per shard, not four
    # Only the slow steps meet a checkpoint (the steps after them begin over a median step after its
    # end): 1 s lost at each of the two checkpoints.
    assert cost.lost_s == pytest.approx(2.0 / 2)
    assert cost.steps_beside == 2
    assert cost.fraction == pytest.approx(0.1)


def test_no_figure_without_a_checkpoint_among_the_steps_or_a_step_that_met_none():
    steps = _steps([1.0] * 10)
    assert checkpoint_cost([steps], [[(10.0, 11.0)]], every_s=10) is None
    assert checkpoint_cost([steps], [[]], every_s=10) is None
    assert checkpoint_cost([steps], [[(99.0, 111.0)]], every_s=10) is None
