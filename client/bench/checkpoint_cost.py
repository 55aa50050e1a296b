"""What the shards' checkpoints cost a run's steps, measured in the same run: the steps that ran
beside a checkpoint against those that did not.

Two runs of one configuration differ here by more than the few percent a checkpoint costs (the
median step moves by up to a fifth between runs on a shared host), so the cost is read from one
run: each shard's checkpoints as it wrote them (ShardService.ListCheckpoints: when each snapshot
was taken and how long until its files were on disk) beside each worker's steps (when each began
and how long it took).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from gradps.channel import open_channel
from gradps.v1 import shard_pb2, shard_pb2_grpc

# A checkpoint's (start, end), Unix seconds.
Window = tuple[float, float]


class CheckpointTimes:
    """Each shard's checkpoints of one run, gathered while it trains: a shard keeps only its last
    few, so they are asked for every half interval (a small call that reads their manifests)."""

    def __init__(self, shards: Sequence[str], run_id: str, every_s: float) -> None:
        self._channels = [open_channel(a) for a in shards]
        self._stubs = [shard_pb2_grpc.ShardServiceStub(c) for c in self._channels]
        self._run_id = run_id
        self._period_s = every_s / 2
        self._next = 0.0
        # (shard index, sequence) -> window.
        self._seen: dict[tuple[int, int], Window] = {}

    def poll(self, now: bool = False) -> None:
        """Ask the shards again if half an interval has passed since the last time (or `now`)."""
        if not now and time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self._period_s
        for index, stub in enumerate(self._stubs):
            try:
                listed = stub.ListCheckpoints(shard_pb2.ListCheckpointsRequest(run_id=self._run_id), timeout=10)
            except grpc.RpcError:
                continue  # the run is not open there yet, or has ended: nothing more to learn
            for c in listed.checkpoints:
                if c.created_unix and c.seconds:
                    self._seen[(index, c.sequence)] = (c.created_unix, c.created_unix + c.seconds)

    def windows(self) -> list[list[Window]]:
        """Each shard's checkpoint windows seen so far, oldest first."""
        by_shard: list[list[Window]] = [[] for _ in self._stubs]
        for (index, _), window in sorted(self._seen.items()):
            by_shard[index].append(window)
        return by_shard

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


@dataclass(frozen=True)
class CheckpointCost:
    """Seconds a worker's steps lose to one checkpoint of every shard, and that as a fraction of
    the run's time at one checkpoint every interval."""

    lost_s: float
    fraction: float
    # Checkpoints per shard within the measured steps, and the steps that met one (all workers).
    checkpoints: float
    steps_beside: int


def checkpoint_cost(
    workers: Sequence[Sequence[dict]], shards: Sequence[Sequence[Window]], every_s: float
) -> CheckpointCost | None:
    """The cost of the checkpoints `shards` wrote to the steps of `workers` (records with
    `began_unix` and `step_s`), at one every `every_s` seconds; None when no checkpoint fell
    within the steps or every step met one.

    A step meets a checkpoint when it overlaps the checkpoint's window or ends within one median
    step after it (an asynchronous scheme's exchange of a step ends during the next). What the
    steps that met one took beyond the median of those that met none, summed per worker and
    divided by the checkpoints per shard in the measured time, is what one checkpoint of every
    shard costs that worker; the mean over the workers, over `every_s`, is the fraction of the
    run's time a checkpoint every `every_s` takes. Counting every step near a checkpoint (not
    only those it slowed) makes this an upper bound: slow steps are likelier to meet one."""
    windows = [w for shard in shards for w in shard]
    all_steps = [r for records in workers for r in records]
    if not windows or not all_steps:
        return None
    begin = min(r["began_unix"] for r in all_steps)
    end = max(r["began_unix"] + r["step_s"] for r in all_steps)
    per_shard = statistics.mean(sum(1 for s, e in shard if s < end and e > begin) for shard in shards)
    if per_shard == 0:
        return None
    after = statistics.median(r["step_s"] for r in all_steps)
    lost: list[float] = []
    beside = 0
    for records in workers:
        met = [_meets(r, windows, after) for r in records]
        near = [r["step_s"] for r, m in zip(records, met, strict=True) if m]
        clear = [r["step_s"] for r, m in zip(records, met, strict=True) if not m]
        if not clear:
            return None
        usual = statistics.median(clear)
        lost.append(sum(t - usual for t in near) / per_shard)
        beside += len(near)
    lost_s = statistics.mean(lost)
    return CheckpointCost(lost_s, lost_s / every_s, per_shard, beside)


def _meets(record: dict, windows: Sequence[Window], after: float) -> bool:
    """Whether the step of `record` overlaps a window or ends within `after` seconds of one."""
    began = record["began_unix"]
    ended = began + record["step_s"]
    return any(began < e + after and ended > s for s, e in windows)
