"""A worker's connection to every shard of a run: pull weights, push gradients, average with a
group, each shard driven by its own thread over its ShardLink."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from gradps.codecs import CodecError, ErrorFeedback, decode_part, encode_part, is_plain, plain_payload
from gradps.codecs.base import require_finite
from gradps.cuts import Cuts
from gradps.placement import ITEMSIZE, PartKey
from gradps.shard_link import ShardLink
from gradps.shared_memory import nbytes
from gradps.transport import TRANSPORTS
from gradps.transport.base import Buffer, Inbound
from gradps.transport.data_stream import DataStreamRoute
from gradps.transport.framing import Item
from gradps.transport.shared_memory import SharedMemoryRoute
from gradps.v1 import run_pb2, shard_pb2, tensor_pb2

_LOGGER = logging.getLogger("gradps.worker")
T = TypeVar("T")

__all__ = ["ParameterClient", "Traffic", "copy_part_into", "tensor_specs"]


@dataclass
class Traffic:
    """What a worker's transfers cost so far."""

    bytes_pushed: int = 0
    bytes_pulled: int = 0
    pushes: int = 0
    staleness_sum: float = 0.0
    staleness_max: int = 0
    # Seconds inside push, pull and group-average calls (waiting on the servers and the wire).
    wait_s: float = 0.0
    # Of which: encoding gradients and decoding weights (summed over the shards' threads, so they
    # may overlap each other and the wire), and wall time of push and pull calls.
    encode_s: float = 0.0
    decode_s: float = 0.0
    push_s: float = 0.0
    pull_s: float = 0.0
    # Wall time of wagma's group_average calls (deposit and average).
    average_s: float = 0.0


def tensor_specs(tensors: dict[str, torch.Tensor]) -> list[tensor_pb2.TensorSpec]:
    """The wire description of named float32 tensors, in the given order."""
    return [
        tensor_pb2.TensorSpec(name=name, shape=list(t.shape), dtype=tensor_pb2.DTYPE_FLOAT32)
        for name, t in tensors.items()
    ]


class ParameterClient:
    """Pulls and pushes the parts of one run; each shard is driven by its own thread."""

    def __init__(
        self,
        placement: shard_pb2.Placement,
        run_id: str,
        worker_id: int,
        codec: tensor_pb2.CodecParams,
        pull_codec: tensor_pb2.CodecParams,
        timeout_s: float = 120.0,
        transport: str = "shm",
        local_shards: Collection[int] | None = None,
        cuts: Cuts | None = None,
        abandoned: Callable[[], bool] = lambda: False,
    ) -> None:
        """`transport`: one of TRANSPORTS (gradps/transport/). `local_shards`: where "shm" may try
        shared memory (None: every shard; those on another host refuse the segment).
        `gradps bench transport` names them to place each shard on an emulated host of its own.
        `cuts`: the run's checkpoint cuts (gradps/cuts.py; None: none). `abandoned()`: whether the
        run was stopped, after which a shard that does not answer is no longer waited for."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r}: expected one of {', '.join(TRANSPORTS)}")
        for t in placement.tensors:
            if ITEMSIZE.get(t.dtype) != 4:
                raise ValueError(f"tensor {t.name}: only float32 tensors are served")
        self.placement = placement
        self.run_id = run_id
        self.worker_id = worker_id
        self.codec = codec
        self.pull_codec = pull_codec
        self.timeout_s = timeout_s
        self.traffic = Traffic()
        # The run's restore epoch this worker is at (ShardService.RestoreRun): after a shard of the
        # run restarted and the run went back to a checkpoint, calls raise gradps.errors.RolledBack
        # until the worker goes back and sets the epoch it was told.
        self.restore_epoch = 0
        # Error feedback residuals live as long as this placement does, each sent whole in the
        # push before a cut.
        self.feedback = ErrorFeedback()
        self.cuts = cuts or Cuts(run_pb2.RunSpec(), declares=False)
        self.versions: dict[PartKey, int] = {}
        # Whether every shard answered the last pull with the run's final weights (asgd, ssp:
        # PullResponse.final_weights): the replica then holds the model the run ends with.
        self.pulled_final_weights = False
        self._parts: list[list[shard_pb2.PartPlacement]] = [[] for _ in placement.shards]
        for p in placement.parts:
            self._parts[p.shard].append(p)
        self.links = [
            ShardLink(i, address, run_id, worker_id, [p.count for p in self._parts[i]], timeout_s, abandoned)
            for i, address in enumerate(placement.shards)
        ]
        # The shards this worker exchanges with: those that own parts.
        self._owners = [s for s, parts in enumerate(self._parts) if parts]
        for s in self._owners:
            self.links[s].set_up(transport, local_shards is None or s in local_shards)
        n = max(1, len(placement.shards))
        self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="shard")
        # Pushes get their own threads: a scheme may push while a pull waits on the shards.
        self._push_pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="push")
        self._pinned = False
        _LOGGER.info(
            "run %s: payloads to shards %s through shared memory, to %s on data streams, to %s inline",
            run_id,
            self.shared_shards,
            self.streamed_shards,
            [s for s in self._owners if not self.links[s].route.open],
        )

    @property
    def shared_shards(self) -> list[int]:
        """Shards whose payloads go through shared memory."""
        return [s for s, link in enumerate(self.links) if isinstance(link.route, SharedMemoryRoute)]

    @property
    def streamed_shards(self) -> list[int]:
        """Shards whose payloads go through a data stream (that is still open)."""
        return [s for s, link in enumerate(self.links) if isinstance(link.route, DataStreamRoute) and link.route.open]

    def go_back(self, epoch: int) -> None:
        """The run went back to a cut, at restore epoch `epoch`: calls carry the epoch, and no
        residual is carried on (there was none at the cut)."""
        self.restore_epoch = epoch
        self.feedback = ErrorFeedback()

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._push_pool.shutdown(wait=False)
        for link in self.links:
            link.close()

    def _each_shard(self, fn: Callable[[ShardLink], T], pool: ThreadPoolExecutor | None = None) -> list[T]:
        """fn(link) for every shard that owns parts, in parallel; in this thread when one does (a
        small model is placed on one shard)."""
        if len(self._owners) == 1:
            return [fn(self.links[self._owners[0]])]
        return list((pool or self._pool).map(lambda s: fn(self.links[s]), self._owners))

    def register(self, tensors: dict[str, torch.Tensor], overwrite: bool = False, replica_step: int = 0) -> None:
        """Upload initial values; the first worker's upload wins on each shard. With `overwrite`,
        replace the shards' copy (schemes whose model lives on the workers publish it this way);
        with `replica_step` too, hand the replica in as it was at the start of that step."""
        flat = {name: t.detach().reshape(-1).float().cpu() for name, t in tensors.items()}
        header = shard_pb2.RegisterTensorsRequest(run_id=self.run_id, overwrite=overwrite, replica_step=replica_step)
        if replica_step:
            header.restore_epoch = self.restore_epoch
        self._each_shard(lambda link: link.register(header, self._values(link.index, flat)))

    def pull(self, into: dict[str, torch.Tensor], min_version: int = 0, clock: int = 0) -> None:
        """Copy the current global values into `into` (tensors written in place), once every part
        has at least `min_version` (sync) and the slowest worker is within bound of `clock` (ssp)."""
        request = shard_pb2.PullRequest(min_version=min_version, clock=clock, codec=self.pull_codec)
        self._fetch_into(into, request)

    def pull_gradient(self, step: int, into: dict[str, torch.Tensor]) -> None:
        """pseudosync: copy the reduced global gradient of `step` into `into` (waits for it)."""
        self._fetch_into(into, shard_pb2.PullRequest(gradient=True, gradient_step=step))

    def _fetch_into(self, into: dict[str, torch.Tensor], request: shard_pb2.PullRequest) -> None:
        request.run_id, request.worker_id = self.run_id, self.worker_id
        request.restore_epoch = self.restore_epoch
        request.wait_ms = int(self.timeout_s * 1000)
        flat = {name: t.data.view(-1) for name, t in into.items()}
        self._pin_segments(flat.values())
        start = time.perf_counter()
        weights = not request.gradient  # a weight's version is what the next push was computed on
        take = self._taker(flat, record_versions=weights)
        answers = self._each_shard(lambda link: link.pull(request, take))
        for _, head in answers:
            self.cuts.learn(head.cut_step)
        self.pulled_final_weights = all(head.final_weights for _, head in answers)
        self.traffic.bytes_pulled += sum(received for received, _ in answers)
        elapsed = time.perf_counter() - start
        self.traffic.pull_s += elapsed
        self.traffic.wait_s += elapsed

    def push(self, grads: dict[str, torch.Tensor], step: int) -> int:
        """Push one gradient (compressed with the run's codec); returns the max staleness."""
        header = shard_pb2.PushRequest(
            run_id=self.run_id,
            worker_id=self.worker_id,
            step=step,
            restore_epoch=self.restore_epoch,
            cut_step=self.cuts.declaration(step),
        )
        return self._push(grads, step, lambda link, items: (link.push(header, items), 0))

    def push_pull(
        self,
        grads: dict[str, torch.Tensor],
        step: int,
        into: dict[str, torch.Tensor],
        min_version: int = 0,
        clock: int = 0,
    ) -> int:
        """Push one gradient, then copy the global values into `into` once the pull may be
        answered (as `pull` waits: `min_version` for sync, the step this push completes; `clock`
        for ssp), in one call per shard; returns the max staleness."""
        wait_ms = int(self.timeout_s * 1000)
        pull = shard_pb2.PullRequest(min_version=min_version, clock=clock, codec=self.pull_codec, wait_ms=wait_ms)
        header = shard_pb2.PushPullRequest(
            run_id=self.run_id,
            worker_id=self.worker_id,
            step=step,
            pull=pull,
            restore_epoch=self.restore_epoch,
            cut_step=self.cuts.declaration(step),
        )
        flat = {name: t.data.view(-1) for name, t in into.items()}
        self._pin_segments(flat.values())
        take = self._taker(flat, record_versions=True)
        return self._push(grads, step, lambda link, items: link.push_pull(header, items, take))

    def _push(
        self,
        grads: dict[str, torch.Tensor],
        step: int,
        call: Callable[[ShardLink, _Replay], tuple[shard_pb2.PushResponse, int]],
    ) -> int:
        """`call(link, encoded parts)` for every shard in parallel: (its push response, bytes pulled)."""
        # The push before a cut carries the residuals whole: a checkpoint there holds them.
        whole = self.cuts.is_cut(step + 1)
        # On the gradients' device: a lossless part goes from there into shared memory in one copy.
        flat = {name: g.detach().reshape(-1).float() for name, g in grads.items()}
        self._pin_segments(flat.values())
        start = time.perf_counter()

        def send(link: ShardLink) -> tuple[int, int, int]:
            # Encoded while earlier parts are on the wire (a call of many messages: gRPC consumes
            # them from its own thread), and kept: a retry frames them again without encoding
            # again, which would apply the error feedback twice.
            encoded = _Replay(self._encoded(link.index, flat, whole))
            response, pulled = call(link, encoded)
            self.cuts.learn(response.cut_step, response.cut_asked)
            return response.staleness, encoded.bytes, pulled

        results = self._each_shard(send, pool=self._push_pool)
        staleness = max((s for s, _, _ in results), default=0)
        self.traffic.bytes_pushed += sum(n for _, n, _ in results)
        self.traffic.bytes_pulled += sum(n for _, _, n in results)
        self.traffic.pushes += 1
        self.traffic.staleness_sum += staleness
        self.traffic.staleness_max = max(self.traffic.staleness_max, staleness)
        elapsed = time.perf_counter() - start
        self.traffic.push_s += elapsed
        self.traffic.wait_s += elapsed
        return staleness

    def group_average(
        self, values: dict[str, torch.Tensor], step: int, members: list[int], is_global: bool, consensus: bool = False
    ) -> tuple[dict[str, torch.Tensor], int]:
        """wagma: deposit `values` for the round (step, members); returns the round's average and
        the highest step any worker has deposited (a late worker skips to it). With `consensus`,
        nothing is deposited: the average of every live worker's latest deposit."""
        flat = {name: t.detach().reshape(-1).float() for name, t in values.items()}
        average = {name: torch.empty_like(t) for name, t in values.items()}
        out = {name: t.view(-1) for name, t in average.items()}
        self._pin_segments(flat.values())
        start = time.perf_counter()
        header = shard_pb2.GroupAverageRequest(
            run_id=self.run_id,
            worker_id=self.worker_id,
            step=step,
            members=members,
            is_global=is_global,
            consensus=consensus,
            restore_epoch=self.restore_epoch,
        )
        frontier = [0]

        def take(meta: tensor_pb2.TensorPart, inbound: Inbound, data: Buffer) -> int:
            frontier[0] = max(frontier[0], meta.version)
            return taker(meta, inbound, data)

        taker = self._taker(out, record_versions=False)
        received = self._each_shard(lambda link: link.exchange(header, self._values(link.index, flat), take))
        self.traffic.bytes_pushed += sum(4 * p.count for s in self._owners for p in self._parts[s])
        self.traffic.bytes_pulled += sum(received)
        elapsed = time.perf_counter() - start
        self.traffic.average_s += elapsed
        self.traffic.wait_s += elapsed
        return average, frontier[0]

    def _values(self, shard: int, flat: dict[str, torch.Tensor]) -> Iterator[Item]:
        """The shard's parts of `flat` as they are (codec none): initial values, a deposit."""
        for p in self._parts[shard]:
            yield self._meta(p, _NONE), flat[p.name][p.offset : p.offset + p.count]

    def _encoded(
        self, shard: int, flat: dict[str, torch.Tensor], whole: bool = False
    ) -> Iterator[tuple[tensor_pb2.TensorPart, object]]:
        """The shard's parts of the gradient `flat`, encoded with the run's codec (timed); with
        `whole`, each with its error-feedback residual added, as it is (codec none)."""
        for p in self._parts[shard]:
            began = time.perf_counter()
            values = flat[p.name][p.offset : p.offset + p.count]
            payload: torch.Tensor | bytes
            codec = self.codec
            if whole and not is_plain(codec):
                # The gradient and the residual as they are, the residual left empty.
                codec = _NONE
                payload, lz4 = self.feedback.drain((p.name, p.index), values.cpu()), False
                require_finite(payload, "none: values to encode")
            elif is_plain(self.codec) and values.is_contiguous():
                # Lossless: the values themselves (on their device), copied once, into the segment
                # or the message, after the check the codec makes.
                require_finite(values, "none: values to encode")
                payload, lz4 = values, False
            else:
                payload, lz4 = encode_part(values.cpu(), self.codec, feedback=self.feedback, key=(p.name, p.index))
            meta = self._meta(p, codec)
            meta.lz4 = lz4
            self.traffic.encode_s += time.perf_counter() - began
            yield meta, payload

    def _taker(
        self, flat: dict[str, torch.Tensor], record_versions: bool
    ) -> Callable[[tensor_pb2.TensorPart, Inbound, Buffer], int]:
        """How a received part lands in its slice of `flat`: read straight into the tensor where
        the route can (a stream, codec none, on the CPU), else decoded from its payload."""

        def take(meta: tensor_pb2.TensorPart, inbound: Inbound, data: Buffer) -> int:
            began = time.perf_counter()
            target = flat[meta.name][meta.offset : meta.offset + meta.count]
            direct = target.device.type == "cpu" and target.is_contiguous() and plain_payload(meta)
            payload = inbound.payload(meta, data, target.numpy().data.cast("B") if direct else None)
            if payload is not None:
                copy_part_into(target, meta, payload)
            if record_versions:
                self.versions[(meta.name, meta.index)] = meta.version
            self.traffic.decode_s += time.perf_counter() - began
            return meta.streamed or nbytes(payload or b"")

        return take

    def _meta(self, p: shard_pb2.PartPlacement, codec: tensor_pb2.CodecParams) -> tensor_pb2.TensorPart:
        """A part's metadata. Fields are set in place: a nested `part=TensorPart(...)` argument
        costs about 1 ms per MiB of payload, field assignment a plain copy."""
        meta = tensor_pb2.TensorPart()
        meta.name, meta.index, meta.offset, meta.count = p.name, p.index, p.offset, p.count
        meta.dtype = tensor_pb2.DTYPE_FLOAT32
        meta.codec.CopyFrom(codec)
        meta.version = self.versions.get((p.name, p.index), 0)
        return meta

    def _pin_segments(self, tensors: Iterable[torch.Tensor]) -> None:
        """Page-lock the shared segments for CUDA once GPU tensors use them (Segment.pin): a
        worker that trains on the CPU never makes a CUDA context for it."""
        if not self._pinned and any(t.is_cuda for t in tensors):
            self._pinned = True
            for link in self.links:
                if isinstance(link.route, SharedMemoryRoute):
                    link.route.segment.pin()


_NONE = tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_NONE)


class _Replay:
    """An iterable that runs `items` once and gives the same items again to every later pass
    (a push made again sends what it encoded the first time)."""

    def __init__(self, items: Iterator[tuple[tensor_pb2.TensorPart, object]]) -> None:
        self._items = items
        self._seen: list[tuple[tensor_pb2.TensorPart, object]] = []
        self.bytes = 0

    def __iter__(self) -> Iterator[tuple[tensor_pb2.TensorPart, object]]:
        yield from list(self._seen)
        for item in self._items:
            self._seen.append(item)
            self.bytes += nbytes(item[1])  # type: ignore[arg-type]
            yield item


def copy_part_into(target: torch.Tensor, part: tensor_pb2.TensorPart, payload: Buffer) -> None:
    """Decode a pulled (or exported) part straight into its slice of the model: one copy for `none`."""
    if plain_payload(part):
        if len(payload) != 4 * part.count:
            raise CodecError(f"none: payload is {len(payload)} bytes, expected {4 * part.count}")
        if part.count:
            target.copy_(torch.frombuffer(payload, dtype=torch.float32, count=part.count))
        return
    target.copy_(decode_part(payload, part.lz4, part.codec, part.count, torch.device("cpu")))
