"""WAGMA's butterfly group schedule: which ranks average together at each step.

Ranks are written in base S; at step t the group of a rank is every rank that differs from it only
in digit (t mod d), so after d phases every rank's model has reached every other. When P is a
power of S, d = log_S P. Otherwise the butterfly runs over the first m = S^(d-1) ranks (a complete
hypercube, d = ceil(log_S P)) and each remaining rank r joins the group of rank r mod m: every step
still partitions the ranks, and information reaches everyone within d - 1 phases (checked for
P = 1..64 by the tests).
"""

from __future__ import annotations

import math


def default_group_size(world: int) -> int:
    """About sqrt(P), a power of two, at least 2 (1 for a single worker)."""
    if world <= 1:
        return 1
    return max(2, 2 ** round(math.log2(math.sqrt(world))))


def _cube(world: int, group_size: int) -> tuple[int, int]:
    """(m, phases): the size of the complete hypercube the butterfly runs over, and its phases."""
    d, m = 0, 1
    while m * group_size <= world:
        m *= group_size
        d += 1
    return m, max(1, d)


def groups(step: int, world: int, group_size: int) -> list[list[int]]:
    """The partition of ranks 0..P-1 into groups at `step`."""
    if group_size < 1:
        raise ValueError(f"group size must be >= 1, got {group_size}")
    if world <= 1 or group_size == 1:
        return [[r] for r in range(world)]
    group_size = min(group_size, world)
    m, d = _cube(world, group_size)
    stride = group_size ** (step % d)
    by_base: dict[int, list[int]] = {}
    for rank in range(world):
        host = rank % m  # ranks beyond the hypercube ride along with a rank inside it
        digit = (host // stride) % group_size
        by_base.setdefault(host - digit * stride, []).append(rank)
    return sorted(sorted(g) for g in by_base.values())


def group_of(rank: int, step: int, world: int, group_size: int) -> list[int]:
    """The ranks `rank` averages with at `step` (itself included)."""
    return next(g for g in groups(step, world, group_size) if rank in g)
