"""A worker's connection to every shard of a run: pull weights, push gradients, in parallel."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from gradps.channel import open_channel
from gradps.codecs import ErrorFeedback, decode_part, encode_part
from gradps.placement import ITEMSIZE, PartKey
from gradps.v1 import shard_pb2, shard_pb2_grpc, tensor_pb2

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass
class Traffic:
    """What a worker's transfers cost so far."""

    bytes_pushed: int = 0
    bytes_pulled: int = 0
    pushes: int = 0
    staleness_sum: float = 0.0
    staleness_max: int = 0
    # Seconds inside pull/push calls (waiting on the servers and the wire).
    wait_s: float = 0.0


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
    ) -> None:
        self.placement = placement
        self.run_id = run_id
        self.worker_id = worker_id
        self.codec = codec
        self.pull_codec = pull_codec
        self.timeout_s = timeout_s
        self.traffic = Traffic()
        # Error feedback residuals live as long as this placement does.
        self.feedback = ErrorFeedback()
        self.versions: dict[PartKey, int] = {}
        self._channels = [open_channel(address) for address in placement.shards]
        self._stubs = [shard_pb2_grpc.ShardServiceStub(c) for c in self._channels]
        self._parts_by_shard: list[list[shard_pb2.PartPlacement]] = [[] for _ in placement.shards]
        for p in placement.parts:
            self._parts_by_shard[p.shard].append(p)
        for t in placement.tensors:
            if ITEMSIZE.get(t.dtype) != 4:
                raise ValueError(f"tensor {t.name}: only float32 tensors are served")
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(placement.shards)), thread_name_prefix="shard")

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for channel in self._channels:
            channel.close()

    def _each_shard(self, fn) -> list:
        """Run fn(shard_index) for every shard that owns parts, in parallel."""
        shards = [s for s, parts in enumerate(self._parts_by_shard) if parts]
        return list(self._pool.map(fn, shards))

    def register(self, tensors: dict[str, torch.Tensor]) -> None:
        """Upload initial values; the first worker's upload wins on each shard."""
        flat = {name: t.detach().reshape(-1).float().cpu() for name, t in tensors.items()}

        def upload(shard: int) -> None:
            def requests() -> Iterator[shard_pb2.RegisterTensorsRequest]:
                for p in self._parts_by_shard[shard]:
                    values = flat[p.name][p.offset : p.offset + p.count]
                    yield shard_pb2.RegisterTensorsRequest(
                        run_id=self.run_id, part=self._part_message(p, values.numpy().tobytes(), False)
                    )

            self._stubs[shard].RegisterTensors(requests(), timeout=self.timeout_s)

        self._each_shard(upload)

    def pull(self, into: dict[str, torch.Tensor], min_version: int = 0) -> None:
        """Copy the current global values into `into` (tensors written in place)."""
        flat = {name: t.data.view(-1) for name, t in into.items()}
        start = time.perf_counter()

        def fetch(shard: int) -> int:
            request = shard_pb2.PullRequest(
                run_id=self.run_id,
                worker_id=self.worker_id,
                min_version=min_version,
                wait_ms=int(self.timeout_s * 1000),
                codec=self.pull_codec,
            )
            nbytes = 0
            for response in self._stubs[shard].Pull(request, timeout=self.timeout_s + 5):
                part = response.part
                values = decode_part(part.payload, part.lz4, part.codec, part.count, torch.device("cpu"))
                target = flat[part.name][part.offset : part.offset + part.count]
                target.copy_(values)
                self.versions[(part.name, part.index)] = part.version
                nbytes += len(part.payload)
            return nbytes

        self.traffic.bytes_pulled += sum(self._each_shard(fetch))
        self.traffic.wait_s += time.perf_counter() - start

    def push(self, grads: dict[str, torch.Tensor], step: int) -> int:
        """Push one gradient (compressed with the run's codec); returns the max staleness."""
        flat = {name: g.detach().reshape(-1).float().cpu() for name, g in grads.items()}
        start = time.perf_counter()

        def send(shard: int) -> tuple[int, int]:
            messages = []
            for p in self._parts_by_shard[shard]:
                payload, lz4 = encode_part(
                    flat[p.name][p.offset : p.offset + p.count],
                    self.codec,
                    feedback=self.feedback,
                    key=(p.name, p.index),
                )
                messages.append(
                    shard_pb2.PushRequest(
                        run_id=self.run_id,
                        worker_id=self.worker_id,
                        step=step,
                        part=self._part_message(p, payload, lz4, codec=self.codec),
                    )
                )
            # Pushes are idempotent per (worker, step): retrying after a timeout is safe.
            for attempt in range(3):
                try:
                    response = self._stubs[shard].Push(iter(messages), timeout=self.timeout_s)
                    return response.staleness, sum(len(m.part.payload) for m in messages)
                except grpc.RpcError as e:
                    if e.code() not in _RETRYABLE or attempt == 2:
                        raise
                    time.sleep(0.2 * (attempt + 1))
            raise AssertionError("unreachable")

        results = self._each_shard(send)
        staleness = max((s for s, _ in results), default=0)
        self.traffic.bytes_pushed += sum(n for _, n in results)
        self.traffic.pushes += 1
        self.traffic.staleness_sum += staleness
        self.traffic.staleness_max = max(self.traffic.staleness_max, staleness)
        self.traffic.wait_s += time.perf_counter() - start
        return staleness

    def _part_message(
        self,
        p: shard_pb2.PartPlacement,
        payload: bytes,
        lz4: bool,
        codec: tensor_pb2.CodecParams | None = None,
    ) -> tensor_pb2.TensorPart:
        return tensor_pb2.TensorPart(
            name=p.name,
            index=p.index,
            offset=p.offset,
            count=p.count,
            dtype=tensor_pb2.DTYPE_FLOAT32,
            codec=codec or tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_NONE),
            payload=payload,
            version=self.versions.get((p.name, p.index), 0),
            lz4=lz4,
        )
