"""WAGMA's butterfly group schedule."""

from __future__ import annotations

import pytest

from gpu_worker.schemes.group_schedule import default_group_size, group_of, groups


def _mixing_steps(world: int, size: int) -> int:
    """Steps of the schedule until every rank's information has reached every other rank,
    checking that each step partitions the ranks."""
    knows = [{r} for r in range(world)]
    step = 0
    while not all(k == set(range(world)) for k in knows):
        partition = groups(step, world, size)
        assert sorted(r for g in partition for r in g) == list(range(world)), (world, size, step)
        merged: list[set[int]] = [set() for _ in range(world)]
        for g in partition:
            union = set().union(*(knows[r] for r in g))
            for r in g:
                merged[r] = union
        knows = merged
        step += 1
        assert step <= world, (world, size)
    return step


@pytest.mark.parametrize("world", range(1, 65))
def test_each_step_partitions_and_information_reaches_everyone_within_log_s_p_steps(world):
    for size in sorted({2, 3, 4, default_group_size(world)}):
        bound = 1
        while min(size, world) ** bound < world:
            bound += 1
        assert _mixing_steps(world, size) <= bound, (world, size)  # ceil(log_S P)


def test_mixing_takes_log_s_p_steps_for_powers():
    assert [_mixing_steps(p, s) for p, s in ((4, 2), (8, 2), (16, 4), (9, 3))] == [2, 3, 2, 2]


def test_groups_change_every_step_and_have_size_s_for_powers():
    assert groups(0, 4, 2) == [[0, 1], [2, 3]]
    assert groups(1, 4, 2) == [[0, 2], [1, 3]]
    assert groups(2, 4, 2) == groups(0, 4, 2)
    for step in range(3):
        assert all(len(g) == 4 for g in groups(step, 16, 4))
    assert group_of(3, 1, 4, 2) == [1, 3]


def test_default_group_size_is_about_sqrt_p():
    assert [default_group_size(p) for p in (1, 2, 4, 8, 16, 64)] == [1, 2, 2, 4, 4, 8]


def test_bad_group_size_is_rejected():
    with pytest.raises(ValueError, match="group size"):
        groups(0, 4, 0)
