"""WAGMA's butterfly group schedule."""

from __future__ import annotations

import pytest

from gpu_worker.schemes.group_schedule import default_group_size, group_of, groups, phases


@pytest.mark.parametrize("world", range(1, 65))
def test_each_step_partitions_and_information_reaches_everyone(world):
    for size in sorted({2, 3, 4, default_group_size(world)}):
        knows = [{r} for r in range(world)]
        for step in range(phases(world, size)):
            partition = groups(step, world, size)
            assert sorted(r for g in partition for r in g) == list(range(world)), (world, size, step)
            merged = [set() for _ in range(world)]
            for g in partition:
                union = set().union(*(knows[r] for r in g))
                for r in g:
                    merged[r] = union
            knows = merged
        assert all(k == set(range(world)) for k in knows), (world, size)


def test_phases_is_log_of_world():
    assert phases(4, 2) == 2 and phases(8, 2) == 3 and phases(16, 4) == 2 and phases(9, 3) == 2
    assert phases(6, 2) <= 3 and phases(5, 2) <= 3  # never more than ceil(log_S P)


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
