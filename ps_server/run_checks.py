"""What a shard checks of a run's requests before it changes anything."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from gradps.channel import MAX_PART_BYTES
from gradps.errors import Invalid, NotFound, RolledBack, Unavailable, one_line
from gradps.optimizer_spec import validate as validate_optimizer
from gradps.placement import PartKey, dtype_name
from gradps.run_spec import MEMBERSHIP_CHANGES_PER_WORKER
from gradps.v1 import run_pb2, shard_pb2, tensor_pb2
from ps_server.run_state import Part, RunState
from ps_server.schemes import RULES

# The most values one part may hold: a part's float32 values within the part size limit.
_MAX_PART_COUNT = MAX_PART_BYTES // 4


def check_open_run(request: shard_pb2.OpenRunRequest) -> None:
    """Invalid when an OpenRun request is unusable; checked before any allocation."""
    if not request.run_id:
        raise Invalid("OpenRun needs a run_id")
    if request.spec.scheme not in RULES:
        raise Invalid(f"unknown scheme {request.spec.scheme!r}; choose one of {', '.join(sorted(RULES))}")
    optimizer = run_pb2.OptimizerSpec()
    optimizer.CopyFrom(request.spec.optimizer)
    optimizer.schedule = optimizer.schedule or "constant"  # as learning_rate reads an unset one
    try:
        validate_optimizer(optimizer)
    except ValueError as e:
        raise Invalid(f"optimizer: {one_line(e)}") from None
    if not 0 <= request.spec.checkpoint_every_seconds < math.inf:  # also false for NaN
        raise Invalid(f"checkpoint_every_seconds must be finite and >= 0, got {request.spec.checkpoint_every_seconds}")
    if not request.workers:
        raise Invalid("a run needs at least one worker")
    if len(set(request.workers)) != len(request.workers):
        raise Invalid(f"worker ids repeat: {list(request.workers)}")
    seen: set[PartKey] = set()
    for p in request.placement.parts:
        if (p.name, p.index) in seen:
            raise Invalid(f"part {p.name}/{p.index} is placed twice")
        seen.add((p.name, p.index))
        if p.count > _MAX_PART_COUNT:
            raise Invalid(f"part {p.name}/{p.index}: {p.count} values, more than the {_MAX_PART_COUNT} a part may hold")


def opened_by(run: RunState, request: shard_pb2.OpenRunRequest) -> bool:
    """Whether `run` is what `request` opens (a retried OpenRun)."""
    return (
        run.spec == request.spec
        and run.placement == request.placement
        and run.shard_index == request.shard_index
        and run.total_steps == request.total_steps
        and run.workers == frozenset(request.workers)
    )


def check_step(run: RunState, step: int) -> None:
    """Invalid for a step past the run's end: steps count from 0 and the last exchange (asgd's
    final push, wagma's final global round) is at step total_steps."""
    if run.total_steps and step > run.total_steps:
        raise Invalid(f"step {step} is beyond the run's {run.total_steps} steps")


def check_epoch(run: RunState, epoch: int) -> None:
    """For a worker's call of restore epoch `epoch` (with `run.cond` held): Unavailable while the
    run waits for its restore (the call is made again), or is restored only to an older epoch;
    RolledBack when the run went back to a checkpoint since the worker's epoch."""
    if run.held:
        raise Unavailable(f"run {run.run_id!r} is being restored on this shard")
    if epoch < run.restore_epoch:
        raise RolledBack(run.run_id, run.restore_epoch, run.restored_step)
    if epoch > run.restore_epoch:
        raise Unavailable(f"run {run.run_id!r} is not yet restored to epoch {epoch} on this shard")


def check_restore(run: RunState, request: shard_pb2.RestoreRunRequest) -> None:
    """Invalid unless a RestoreRun is usable for `run`."""
    if request.WhichOneof("cut") is None:
        raise Invalid("RestoreRun needs a cut: a step to go back to, or keep")
    _members(run, request.workers, request.live_workers, request.membership_epoch, "live workers")
    if request.epoch < run.restore_epoch:
        raise Invalid(f"restore epoch {request.epoch} is older than the run's {run.restore_epoch}")


def check_membership(run: RunState, request: shard_pb2.SetMembershipRequest) -> None:
    """Invalid unless a SetMembership is usable for `run`."""
    _members(run, request.workers, request.live_workers, request.epoch, "workers")


def _members(run: RunState, workers: Sequence[int], live: Iterable[int], epoch: int, what: str) -> None:
    """Invalid unless a membership change naming `workers` (none: they stay), with its `live`
    ones and its membership `epoch`, is usable for `run`."""
    members = frozenset(workers) or run.workers
    if len(members) != len(workers or run.workers):
        raise Invalid(f"worker ids repeat: {list(workers)}")
    if strangers := sorted(set(live) - members):
        raise Invalid(f"{what} {strangers} are not workers of run {run.run_id!r}")
    _check_membership_epoch(epoch, len(members))


def _check_membership_epoch(epoch: int, workers: int) -> None:
    if epoch > MEMBERSHIP_CHANGES_PER_WORKER * workers:
        raise Invalid(
            f"membership epoch {epoch} is beyond the {MEMBERSHIP_CHANGES_PER_WORKER * workers} changes "
            f"a run of {workers} workers can have"
        )


def check_group(run: RunState, ids: Iterable[int]) -> None:
    """Invalid unless every one of a group's `ids` is a worker the run has had (one whose rank
    another took stands for that one, RunState.holders)."""
    if strangers := sorted(set(ids) - run.ranks.keys()):
        raise Invalid(f"members {strangers} are not workers of run {run.run_id!r}")


def check_part(run: RunState, meta: tensor_pb2.TensorPart) -> Part:
    """The run's part that `meta` names, with the dtype and shape it claims checked."""
    name = f"{meta.name}/{meta.index}"
    part = run.parts.get((meta.name, meta.index))
    if part is None:
        raise NotFound(f"unknown tensor part {name} in this shard")
    if meta.dtype != tensor_pb2.DTYPE_FLOAT32:
        raise Invalid(f"part {name}: dtype {dtype_name(meta.dtype)}, expected DTYPE_FLOAT32")
    if meta.offset != part.offset or meta.count != part.count:
        raise Invalid(
            f"part {name}: shape mismatch, got offset {meta.offset} count {meta.count}, "
            f"expected offset {part.offset} count {part.count}"
        )
    return part
