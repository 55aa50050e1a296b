"""Placement: parts balanced by bytes over as many shards as the model's bytes are worth."""

from __future__ import annotations

import pytest

from gradps.placement import place
from gradps.v1 import tensor_pb2

_F32 = tensor_pb2.DTYPE_FLOAT32
_SHARDS = ["s0", "s1", "s2"]


def _specs(**shapes: list[int]) -> list[tensor_pb2.TensorSpec]:
    return [tensor_pb2.TensorSpec(name=n, shape=s, dtype=_F32) for n, s in shapes.items()]


def test_a_model_smaller_than_a_part_lives_on_one_shard_and_the_table_lists_them_all():
    placement = place(_specs(w=[128, 64], b=[64], v=[10, 64]), _SHARDS, 1 << 20)
    assert list(placement.shards) == _SHARDS
    assert {p.shard for p in placement.parts} == {0}


@pytest.mark.parametrize(("part_size", "used"), [(4096 * 4, 2), (4096 * 4 - 1, 3), (1 << 30, 1), (64, 3)])
def test_shards_used_are_the_parts_the_model_would_have_as_one_tensor(part_size, used):
    # 8,192 float32 = 32 KiB in three tensors; ceil(32 KiB / part_size) shards, at most three.
    placement = place(_specs(a=[4096], b=[2048], c=[2048]), _SHARDS, part_size)
    assert len({p.shard for p in placement.parts}) == used


def test_parts_spread_by_bytes_when_the_model_is_worth_every_shard():
    placement = place(_specs(big=[3 * 262_144 + 5], w=[262_144], b=[17]), _SHARDS, 1 << 20)
    load = [sum(4 * p.count for p in placement.parts if p.shard == s) for s in range(3)]
    largest = max(4 * p.count for p in placement.parts)
    assert all(b > 0 for b in load) and max(load) - min(load) <= largest, load
