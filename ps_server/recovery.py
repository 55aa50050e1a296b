"""How a run goes on after one of its shards restarted (the coordinator's side; the shard's is
ShardService.ListCheckpoints and RestoreRun).

A restarted shard takes its runs back from their newest complete checkpoints and serves none of
them until told from where to go on. The schemes whose versions count steps (sync, pseudosync:
`Scheme.common_cut`) need every shard at one step: the newest step every shard of the run has a
checkpoint of is the cut; every shard goes back to it under a new restore epoch, and the
workers, told so by their next call, go back to it too. The other schemes tolerate shards at
different versions (their updates are asynchronous): the restarted shard goes on from its own
newest checkpoint and no other shard or worker goes back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from gradps.channel import open_channel
from gradps.v1 import shard_pb2, shard_pb2_grpc

_LOGGER = logging.getLogger("gradps.coordinator")
# How long a shard may take to answer a recovery's calls (it may still be starting, and its
# name may still resolve to the address it had before).
_ANSWER_S = 60.0
_NOT_UP = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass(frozen=True)
class Restart:
    """A run with a shard that restarted, as the coordinator knows it."""

    run_id: str
    # The shards the placement gives parts to (one with none has no state to go back with).
    shards: tuple[str, ...]
    restarted: str
    common_cut: bool
    # The run's restore epoch so far.
    restore_epoch: int
    live_workers: tuple[int, ...]
    membership_epoch: int
    # Every worker by rank (a checkpoint may predate one that joined).
    workers: tuple[int, ...]


@dataclass(frozen=True)
class Outcome:
    """Where the run went on from: `step` at `restore_epoch`; None when the shard had not lost
    the run (the coordinator restarted, not the shard). `error`: why the run cannot go on."""

    step: int | None = None
    restore_epoch: int = 0
    error: str = ""
    # The furthest step any shard of the run had reached (the steps after `step` are done again).
    reached: int = 0


def recover(restart: Restart) -> Outcome:
    """Bring the run's shards to a consistent cut (see the module's docstring)."""
    if restart.restarted not in restart.shards:
        return Outcome()
    try:
        listed = _call(restart.restarted, "ListCheckpoints", shard_pb2.ListCheckpointsRequest(run_id=restart.run_id))
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND:
            return Outcome(
                error=f"shard {restart.restarted} restarted without the run's state: give the shards "
                "a --state-dir and the run --checkpoint-every to survive a shard's restart"
            )
        return Outcome(error=f"shard {restart.restarted} restarted and then failed: {_reason(e)}")
    if not listed.restored:
        return Outcome()
    if not restart.common_cut:
        request = _restore(restart, restart.restore_epoch)
        request.keep = True
        try:
            answer = _call(restart.restarted, "RestoreRun", request)
        except grpc.RpcError as e:
            return Outcome(error=f"shard {restart.restarted} could not go on: {_reason(e)}")
        return Outcome(answer.step, restart.restore_epoch)
    return _go_back_together(restart, listed)


def _go_back_together(restart: Restart, listed: shard_pb2.ListCheckpointsResponse) -> Outcome:
    """Every shard of the run back to the newest step each has a checkpoint of, at a new epoch."""
    request = _restore(restart, restart.restore_epoch + 1)
    # The restarted shard last: a worker it tells to go back finds the others gone back already.
    order = sorted(restart.shards, key=lambda a: a == restart.restarted)
    return _to_common_step(request, order, {restart.restarted: listed}, f"(shard {restart.restarted} restarted)")


def go_back(request: shard_pb2.RestoreRunRequest, shards: tuple[str, ...], why: str) -> Outcome:
    """Every shard of the run back to the newest step checkpointed on all of them, at the epoch
    after `request.epoch`, with the request's membership: a failed or stopped run taken up by
    new workers (`request.workers`), or a running one whose workers take one replica up again
    (a new worker enters). `why` ends the message when there is no such step."""
    request.epoch += 1
    return _to_common_step(request, list(shards), {}, why)


def _to_common_step(
    request: shard_pb2.RestoreRunRequest,
    shards: list[str],
    listed: dict[str, shard_pb2.ListCheckpointsResponse],
    why: str,
) -> Outcome:
    """`request` (its epoch and membership) with the newest step that every one of `shards` has
    a checkpoint of, sent to them in turn; `listed`: the listings already made, by shard."""
    try:
        listings = [listed[a] if a in listed else _listing(a, request.run_id) for a in shards]
    except grpc.RpcError as e:
        return Outcome(error=f"a shard of the run could not list its checkpoints: {_reason(e)}")
    common = set.intersection(*(set(_steps(listing)) for listing in listings))
    if not common:
        return Outcome(error=f"no step has a checkpoint on every shard of the run {why}")
    request.step = max(common)
    for address in shards:
        try:
            _call(address, "RestoreRun", request)
        except grpc.RpcError as e:
            return Outcome(error=f"shard {address} could not go back to step {request.step}: {_reason(e)}")
    return Outcome(request.step, request.epoch, reached=max(listing.step for listing in listings))


def _listing(address: str, run_id: str) -> shard_pb2.ListCheckpointsResponse:
    return _call(address, "ListCheckpoints", shard_pb2.ListCheckpointsRequest(run_id=run_id))


def _restore(restart: Restart, epoch: int) -> shard_pb2.RestoreRunRequest:
    return shard_pb2.RestoreRunRequest(
        run_id=restart.run_id,
        epoch=epoch,
        live_workers=restart.live_workers,
        membership_epoch=restart.membership_epoch,
        workers=restart.workers,
    )


def _steps(listed: shard_pb2.ListCheckpointsResponse) -> list[int]:
    return [c.step for c in listed.checkpoints]


def _call(address: str, method: str, request: Message) -> Any:
    """`method` on the shard at `address`, made again while the shard is not up yet or does not
    answer (every call here may be made twice). Each try opens a channel of its own: a cached one
    may still be backing off from the shard's death, or hold the address the shard's name had
    before it restarted."""
    deadline = time.monotonic() + _ANSWER_S
    while True:
        with open_channel(address) as channel:
            stub = shard_pb2_grpc.ShardServiceStub(channel)
            try:
                return getattr(stub, method)(request, timeout=10, wait_for_ready=True)
            except grpc.RpcError as e:
                if e.code() not in _NOT_UP or time.monotonic() > deadline:
                    raise
        time.sleep(0.5)


def _reason(e: grpc.RpcError) -> str:
    return f"{e.code().name}: {e.details()}"
