"""Placement: cut named tensors into parts and assign parts to shards, balanced by bytes."""

from __future__ import annotations

import heapq
import math

from gradps.v1 import shard_pb2, tensor_pb2

DEFAULT_PART_SIZE = 4 * 1024 * 1024

# A part is named by its tensor and its index within the tensor.
PartKey = tuple[str, int]

ITEMSIZE = {
    tensor_pb2.DTYPE_FLOAT32: 4,
    tensor_pb2.DTYPE_FLOAT16: 2,
    tensor_pb2.DTYPE_BFLOAT16: 2,
    tensor_pb2.DTYPE_FLOAT64: 8,
}


def numel(spec: tensor_pb2.TensorSpec) -> int:
    """Number of elements of a tensor."""
    return math.prod(spec.shape)


def cut_parts(spec: tensor_pb2.TensorSpec, part_size: int) -> list[tuple[int, int]]:
    """(offset, count) of each part of a tensor: contiguous slices of at most `part_size` bytes."""
    if spec.dtype not in ITEMSIZE:
        raise ValueError(f"tensor {spec.name!r}: unsupported dtype {spec.dtype}")
    n = numel(spec)
    per_part = max(1, part_size // ITEMSIZE[spec.dtype])
    if n == 0:
        return [(0, 0)]
    return [(offset, min(per_part, n - offset)) for offset in range(0, n, per_part)]


def place(
    tensors: list[tensor_pb2.TensorSpec], shards: list[str], part_size: int, version: int = 1
) -> shard_pb2.Placement:
    """The placement table: every part goes to the least-loaded shard, largest parts first (LPT).

    Greedy longest-processing-time keeps the heaviest shard within one part of the mean, which
    is what bounds a step's transfer time when all shards are driven in parallel.
    """
    if not shards:
        raise ValueError("no shards registered")
    if part_size <= 0:
        raise ValueError("part_size must be positive")
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")
    parts = []
    for spec in tensors:
        for index, (offset, count) in enumerate(cut_parts(spec, part_size)):
            parts.append((count * ITEMSIZE[spec.dtype], spec.name, index, offset, count))
    load = [(0, s) for s in range(len(shards))]
    heapq.heapify(load)
    placed = []
    # Sort by size, then by name for a deterministic table.
    for nbytes, name, index, offset, count in sorted(parts, key=lambda p: (-p[0], p[1], p[2])):
        bytes_on, shard = heapq.heappop(load)
        placed.append(shard_pb2.PartPlacement(name=name, index=index, offset=offset, count=count, shard=shard))
        heapq.heappush(load, (bytes_on + nbytes, shard))
    placed.sort(key=lambda p: (names.index(p.name), p.index))
    return shard_pb2.Placement(version=version, shards=shards, tensors=tensors, parts=placed)


def shard_bytes(placement: shard_pb2.Placement) -> list[int]:
    """Bytes of parameters each shard holds under `placement`."""
    itemsize = {t.name: ITEMSIZE[t.dtype] for t in placement.tensors}
    load = [0] * len(placement.shards)
    for p in placement.parts:
        load[p.shard] += p.count * itemsize[p.name]
    return load
