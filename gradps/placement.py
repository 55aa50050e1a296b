"""Placement: cut named tensors into parts and assign parts to shards, balanced by bytes."""

from __future__ import annotations

import heapq
import math

from gradps.channel import MAX_MESSAGE_BYTES
from gradps.v1 import shard_pb2, tensor_pb2

# gRPC's standard receive limit, which every stock client has unless it raises it.
STOCK_MESSAGE_BYTES = 4 * 1024 * 1024
# Bytes per part when a run does not say (RunSpec.part_size): a part and its message's header
# (at most a few hundred bytes) fit a stock client's receive limit, so a worker in any language
# pulls and exports with default settings; gradps's own channels take up to MAX_MESSAGE_BYTES.
DEFAULT_PART_SIZE = STOCK_MESSAGE_BYTES - 64 * 1024

# A part is named by its tensor and its index within the tensor.
PartKey = tuple[str, int]

ITEMSIZE = {
    tensor_pb2.DTYPE_FLOAT32: 4,
    tensor_pb2.DTYPE_FLOAT16: 2,
    tensor_pb2.DTYPE_BFLOAT16: 2,
    tensor_pb2.DTYPE_FLOAT64: 8,
}
# Parameters travel and live as float32: shards hold every part as float32 and workers describe
# their tensors as such (gradps/parameter_client.py, tensor_specs); a placement has no other dtype.
PARAMETER_DTYPE = tensor_pb2.DTYPE_FLOAT32

# Elements of one tensor (4 TiB of float32): more than any model's tensor, and every offset and
# count stays far inside torch's int64 sizes. Each dimension is bounded likewise, so that a zero
# dimension cannot hide one that no tensor can have.
MAX_TENSOR_ELEMENTS = 2**40
# Parts of one placement table. The table is built in Python under the run's placement lock
# (about a second for this many parts) and travels whole in one message (GetPlacementResponse,
# OpenRunRequest); at the default 4 MiB part size it is 1 TiB of parameters, and a larger
# part_size holds more.
MAX_PARTS = 2**18
# Serialised bytes of a placement table: it must fit one gRPC message beside the rest of an
# OpenRunRequest (a spec of a few hundred bytes).
MAX_PLACEMENT_BYTES = MAX_MESSAGE_BYTES - (1 << 20)
# Most bytes a PartPlacement takes besides its tensor's name: five tagged varints and its length.
_PART_OVERHEAD_BYTES = 48


def numel(spec: tensor_pb2.TensorSpec) -> int:
    """Number of elements of a tensor."""
    return math.prod(spec.shape)


def cut_parts(spec: tensor_pb2.TensorSpec, part_size: int) -> list[tuple[int, int]]:
    """(offset, count) of each part of a tensor: contiguous slices of at most `part_size` bytes."""
    if spec.dtype not in ITEMSIZE:
        raise ValueError(f"tensor {_shown(spec.name)}: unsupported dtype {spec.dtype}")
    n = numel(spec)
    per_part = max(1, part_size // ITEMSIZE[spec.dtype])
    if n == 0:
        return [(0, 0)]
    return [(offset, min(per_part, n - offset)) for offset in range(0, n, per_part)]


def check_tensors(tensors: list[tensor_pb2.TensorSpec], part_size: int) -> None:
    """Raise ValueError with a one-line message unless `tensors` can be placed: at least one,
    named, unique names, float32, shapes and part count within the limits above.

    Cheap (no part is cut), so a request is refused before any work in proportion to its shape.
    """
    if part_size <= 0:
        raise ValueError("part_size must be positive")
    if not tensors:
        raise ValueError("no tensors: a model needs at least one")
    seen: set[str] = set()
    parts = 0
    table_bytes = 0
    for spec in tensors:
        if not spec.name:
            raise ValueError("a tensor has an empty name")
        shown = _shown(spec.name)
        if spec.name in seen:
            raise ValueError(f"tensor names must be unique; {shown} appears twice")
        seen.add(spec.name)
        if spec.dtype != PARAMETER_DTYPE:
            raise ValueError(f"tensor {shown}: dtype {dtype_name(spec.dtype)}; parameters are DTYPE_FLOAT32")
        if any(d > MAX_TENSOR_ELEMENTS for d in spec.shape) or numel(spec) > MAX_TENSOR_ELEMENTS:
            raise ValueError(f"tensor {shown}: more than 2^40 elements")
        count = max(1, -(-numel(spec) // max(1, part_size // ITEMSIZE[spec.dtype])))
        parts += count
        if parts > MAX_PARTS:
            raise ValueError(f"more than {MAX_PARTS} parts at part_size {part_size}; submit the run with a larger one")
        table_bytes += spec.ByteSize() + count * (len(spec.name.encode()) + _PART_OVERHEAD_BYTES)
        if table_bytes > MAX_PLACEMENT_BYTES:
            raise ValueError(f"the placement table would exceed {MAX_PLACEMENT_BYTES} bytes (shorter names?)")


def place(tensors: list[tensor_pb2.TensorSpec], shards: list[str], part_size: int) -> shard_pb2.Placement:
    """The placement table: every part goes to the least-loaded shard, largest parts first (LPT).

    Greedy longest-processing-time keeps the heaviest shard within one part of the mean, which
    is what bounds a step's transfer time when all shards are driven in parallel. A run uses only
    as many shards as the model would have parts if it were one flat tensor, ceil(bytes /
    part_size): every shard a worker exchanges with costs it a call per step (about a millisecond
    of CPU at each end), more than a small model's share of the transfer saves (a 69 KB MLP on
    4 workers reached 95% in 1.24x DDP's time on one shard, 2.3x on two). The table still lists
    every shard; one without parts takes no calls. Lower part_size to spread a small model.
    ValueError (see `check_tensors`) for tensors that cannot be placed.
    """
    if not shards:
        raise ValueError("no shards registered")
    check_tensors(tensors, part_size)
    parts = []
    for spec in tensors:
        for index, (offset, count) in enumerate(cut_parts(spec, part_size)):
            parts.append((count * ITEMSIZE[spec.dtype], spec.name, index, offset, count))
    total = sum(p[0] for p in parts)
    used = max(1, min(len(shards), -(-total // part_size)))
    load = [(0, s) for s in range(used)]
    heapq.heapify(load)
    placed = []
    # Sort by size, then by name for a deterministic table.
    for nbytes, name, index, offset, count in sorted(parts, key=lambda p: (-p[0], p[1], p[2])):
        bytes_on, shard = heapq.heappop(load)
        placed.append(shard_pb2.PartPlacement(name=name, index=index, offset=offset, count=count, shard=shard))
        heapq.heappush(load, (bytes_on + nbytes, shard))
    order = {t.name: i for i, t in enumerate(tensors)}
    placed.sort(key=lambda p: (order[p.name], p.index))
    # A run's table is made once and never changes, so it is always version 1.
    return shard_pb2.Placement(version=1, shards=shards, tensors=tensors, parts=placed)


def _shown(name: str) -> str:
    """A tensor name for a one-line message: quoted, and cut short."""
    return repr(name if len(name) <= 80 else name[:80] + "...")


def dtype_name(dtype: int) -> str:
    """The DType enum's name for `dtype`, or the number when it has none (a message must not fail
    on the value it reports)."""
    return tensor_pb2.DType.Name(dtype) if dtype in tensor_pb2.DType.values() else str(dtype)
