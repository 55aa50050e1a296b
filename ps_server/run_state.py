"""What a shard holds for one run: its parts, their versions and optimizer state, its members."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from gradps.data_stream import DataStream
from gradps.optimizer import ShardOptimizer
from gradps.placement import PartKey
from gradps.serving import ParkCondition
from gradps.shared_memory import Segment
from gradps.v1 import run_pb2, shard_pb2

# A worker's latest applied pushes a shard remembers: a push is made again before the worker's
# next one (ShardLink retries inline), so a few are plenty.
REMEMBERED_PUSHES = 16


@dataclass
class Part:
    """One part of a tensor, owned by this shard."""

    # Tensor name and part index.
    key: PartKey
    # First element in the flattened tensor, and element count.
    offset: int
    count: int
    # The weights: flat float32 on the shard's device, updated in place by the run's optimizer.
    values: torch.Tensor
    # Updates applied so far.
    version: int = 0
    # False until a worker uploaded initial values.
    initialised: bool = False


@dataclass
class Push:
    """One validated, decoded push: a gradient for some of this shard's parts."""

    worker_id: int
    step: int
    grads: dict[PartKey, torch.Tensor]
    # Version each part's gradient was computed on.
    versions: dict[PartKey, int]


# How a waiting handler waits: wait(ready, timeout_s) is True once ready() is, False after timeout_s;
# it raises Cancelled or TimedOut when the call goes first, Ended when the run does
# (ps_server/waiting.py).
Wait = Callable[[Callable[[], bool], float], bool]


@dataclass
class RunState:
    """A run on one shard. `cond` guards everything; readers wait on it for new versions."""

    run_id: str
    spec: run_pb2.RunSpec
    placement: shard_pb2.Placement
    shard_index: int
    device: torch.device
    total_steps: int
    parts: dict[PartKey, Part]
    # Updates the parts' values; its state (momentum, moments) is the run's optimizer state.
    optimizer: ShardOptimizer
    # Every worker of the run (OpenRun); the live ones are a subset.
    workers: frozenset[int]
    live_workers: set[int]
    membership_epoch: int = 0
    cond: ParkCondition = field(default_factory=ParkCondition)
    # Per worker, the steps of its latest applied pushes (REMEMBERED_PUSHES of them) and each
    # one's staleness: a push made again is answered as it was and applied once.
    applied: dict[int, dict[int, int]] = field(default_factory=dict)
    pushes: int = 0
    bytes_pushed: int = 0
    bytes_pulled: int = 0
    # Shared-memory segments mapped for workers on this host, by (worker id, segment name).
    segments: dict[tuple[int, str], Segment] = field(default_factory=dict)
    # Data streams of workers on other hosts, by (worker id, stream id).
    streams: dict[tuple[int, int], DataStream] = field(default_factory=dict)
    closed: bool = False
    # The run ended (EndRun: stopped, failed or completed): nothing waits on it or updates it any
    # more, and its parts stay readable until it is closed.
    ended: bool = False
    # Restores after a shard of the run restarted (ShardService.RestoreRun), and the step the
    # latest went back to: a worker call of an older epoch is told to go back there.
    restore_epoch: int = 0
    restored_step: int = 0
    # Taken back from a checkpoint at start-up: no worker call is served until RestoreRun.
    held: bool = False
    # Every worker the run has had, with its rank. One that joined took the rank of one the run
    # lost, and a group that names the lost one (as the earlier workers' groups still do) means
    # the one that holds its rank now.
    ranks: dict[int, int] = field(default_factory=dict)
    # sync, pseudosync: the latest cut its rank 0 declared (PushRequest.cut_step), and whether a
    # checkpoint was asked for since (CheckpointRun): the answers to rank 0 ask it to declare one.
    cut_step: int = 0
    cut_asked: bool = False

    @classmethod
    def open(
        cls,
        request: shard_pb2.OpenRunRequest,
        device: torch.device,
        updates_per_step: float = 1.0,
        optimizer: run_pb2.OptimizerSpec | None = None,
    ) -> RunState:
        """Allocate zeroed parts for every part the placement gives this shard; `optimizer`: what
        the scheme applies (ShardRule.optimizer; the run's when None)."""
        parts = {}
        for p in request.placement.parts:
            if p.shard == request.shard_index:
                values = torch.zeros(p.count, dtype=torch.float32, device=device)
                parts[(p.name, p.index)] = Part((p.name, p.index), p.offset, p.count, values)
        return cls(
            run_id=request.run_id,
            spec=request.spec,
            placement=request.placement,
            shard_index=request.shard_index,
            device=device,
            total_steps=request.total_steps,
            parts=parts,
            # The schedule runs over the updates each part will get (ShardRule.updates_per_step).
            optimizer=ShardOptimizer(
                {key: part.values for key, part in parts.items()},
                request.spec.optimizer if optimizer is None else optimizer,
                round(request.total_steps * updates_per_step),
            ),
            workers=frozenset(request.workers),
            live_workers=set(request.workers),
            ranks={w: r for r, w in enumerate(request.workers)},
        )

    def set_workers(self, workers: Sequence[int]) -> None:
        """The run's workers, in rank order, after some joined or the run was resumed."""
        self.workers = frozenset(workers)
        self.ranks.update((w, r) for r, w in enumerate(workers))

    def holders(self, ids: Iterable[int]) -> frozenset[int]:
        """The workers that hold the ranks of `ids` (workers the run has had) now."""
        now = {self.ranks[w]: w for w in self.workers}
        return frozenset(now.get(self.ranks[i], i) for i in ids)

    def set_live_workers(self, live: set[int]) -> None:
        """The members changed: forget the segments of workers that left (their memory is freed
        once the worker's own mapping goes too) and close their data streams."""
        self.live_workers = live
        self.segments = {key: s for key, s in self.segments.items() if key[0] in live}
        for key in [key for key in self.streams if key[0] not in live]:
            self.streams.pop(key).close()

    def open_streams(self, worker: int) -> int:
        """Data streams `worker` holds open (those closed at either end are forgotten here)."""
        self.streams = {key: s for key, s in self.streams.items() if not s.gone()}
        return sum(1 for w, _ in self.streams if w == worker)

    def end(self) -> None:
        """The run is over: calls waiting on it end now (see ShardServicer's waits), not at their
        timeout, which would keep its workers from their next run."""
        self.ended = True
        self.cond.notify_all()

    def superseded(self, epoch: int, step: int) -> None:
        """A restore replaced this state (its successor took its segments and streams): calls
        waiting on it, and those that come with it, are told to go back to `step`."""
        self.restore_epoch, self.restored_step = epoch, step
        self.segments, self.streams = {}, {}
        self.cond.notify_all()

    def close(self) -> None:
        """The run ends on this shard: its data streams close, its segments go with the state."""
        self.closed = True
        self.cond.notify_all()  # waiting pulls and rounds end now, not at their timeout
        self.segments = {}
        for stream in self.streams.values():
            stream.close()
        self.streams = {}

    def earlier_push(self, worker_id: int, step: int) -> tuple[bool, int] | None:
        """What a push of `step` by `worker_id` got before, if it is not to be applied now:
        (True, its staleness) when it was applied, (False, 0) when the worker has pushed a later
        step since (dropped); None when it is new."""
        applied = self.applied.get(worker_id, {})
        if step in applied:
            return True, applied[step]
        if applied and step < max(applied):
            return False, 0
        return None

    def record_push(self, worker_id: int, step: int, nbytes: int, staleness: int) -> None:
        """A push was applied, whole: its step is remembered (one made again is answered
        `applied = true`, with this staleness, and not applied again)."""
        applied = self.applied.setdefault(worker_id, {})
        applied[step] = staleness
        if len(applied) > REMEMBERED_PUSHES:
            del applied[min(applied)]
        self.pushes += 1
        self.bytes_pushed += nbytes
        self.cond.notify_all()

    def initialise(self, values: list[tuple[Part, torch.Tensor]], overwrite: bool) -> int:
        """Set parts' initial values (the first upload wins, unless `overwrite`); how many were set."""
        initialised = 0
        for part, tensor in values:
            if overwrite or not part.initialised:
                part.values.copy_(tensor)
                part.initialised = True
                initialised += 1
        self.cond.notify_all()
        return initialised

    def param_bytes(self) -> int:
        return sum(p.count * 4 for p in self.parts.values())
