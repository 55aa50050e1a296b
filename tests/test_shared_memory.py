"""Shared-memory payloads (gradps/shared_memory.py): segments, and pushes and pulls through them
against real shard processes, including a shard that cannot see the worker's segment and every
kind of bad region a client could name."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch

from gradps import shared_memory
from gradps.channel import open_channel
from gradps.codecs import parse_codec
from gradps.shared_memory import ALIGN, Segment, SegmentError
from gradps.v1 import run_pb2, shard_pb2, shard_pb2_grpc, tensor_pb2
from tests.joined_run import NONE, asgd_steps, join_run, leave


def _own_segments() -> list[str]:
    return sorted(p.name for p in shared_memory.SHM_DIR.glob(f"{shared_memory.name_prefix()}*"))


def test_a_segment_is_shared_by_token_and_checks_its_regions():
    created = Segment.create(1000)
    try:
        opened = Segment.open(created.name, created.token)
        assert opened.size == created.size == ALIGN + 1024
        created.floats(ALIGN, 4).copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        assert opened.floats(ALIGN, 4).tolist() == [1.0, 2.0, 3.0, 4.0]
        opened.region(ALIGN + 64, 3)[:] = b"abc"
        assert bytes(created.region(ALIGN + 64, 3)) == b"abc"
        with pytest.raises(SegmentError, match="token does not match"):
            Segment.open(created.name, bytes(16))
        for offset, length in [(0, 4), (ALIGN + 4, 4), (ALIGN, created.size), (ALIGN, -1)]:
            with pytest.raises(SegmentError, match="not an aligned range"):
                created.region(offset, length)
    finally:
        created.unlink()
    with pytest.raises(SegmentError, match="not on this host"):
        Segment.open(created.name, created.token)
    for name in ["gradps-", "other-1", "gradps-../../etc/passwd", "gradps-" + "x" * 101]:
        with pytest.raises(SegmentError, match="bad segment name"):
            Segment.open(name, created.token)


def test_a_segment_cut_by_its_creator_or_linked_elsewhere_is_refused(tmp_path):
    created = Segment.create(1 << 16)
    try:
        opened = Segment.open(created.name, created.token)
        assert len(opened.region(ALIGN, 1 << 16)) == 1 << 16
        # The creator cuts the file: touching the mapping past the cut would kill this process
        # with SIGBUS, so the region is refused before anything reads or writes it.
        os.truncate(shared_memory.SHM_DIR / created.name, 2 * ALIGN)
        with pytest.raises(SegmentError, match="was cut to"):
            opened.region(ALIGN, 1 << 16)
        assert len(opened.region(ALIGN, ALIGN)) == ALIGN  # what is left stays usable
    finally:
        created.unlink()
    # A link in /dev/shm to a file elsewhere that starts with a known token: not followed.
    victim = tmp_path / "victim.bin"
    victim.write_bytes(created.token + bytes(2 * ALIGN))
    link = shared_memory.SHM_DIR / f"{shared_memory.name_prefix()}link"
    link.symlink_to(victim)
    try:
        with pytest.raises(SegmentError, match="a symbolic link"):
            Segment.open(link.name, created.token)
    finally:
        link.unlink()


def test_segments_left_by_dead_creators_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_memory, "SHM_DIR", tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"{shared_memory.name_prefix(dead.pid)}0123456789abcdef"
    alive = tmp_path / f"{shared_memory.name_prefix(1)}0123456789abcdef"  # init: alive (and not ours)
    # Another PID namespace's (another container's): its pids say nothing here.
    elsewhere = tmp_path / f"gradps-1-{dead.pid}-0123456789abcdef"
    for path in (orphan, alive, elsewhere):
        path.write_bytes(bytes(128))
    segment = Segment.create(64)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, elsewhere.name, segment.name])
    segment.unlink()


def _train(address: str, codec: str, transport: str, steps: int = 3) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Push and pull a few asgd steps; the weights pulled at the end and the shards that got
    payloads through shared memory."""
    torch.manual_seed(0)
    tensors = {"w": torch.randn(300, 301), "b": torch.randn(77)}
    grads = [{n: torch.randn_like(t) for n, t in tensors.items()} for _ in range(steps)]
    spec = run_pb2.RunSpec(
        scheme="asgd", workers=1, steps=100, part_size=64 << 10, optimizer=run_pb2.OptimizerSpec(name="sgd", lr=0.1)
    )
    run_id, sessions, clients, placement = join_run(
        address, spec, tensors, codec=parse_codec(codec), transport=transport
    )
    try:
        assert not _own_segments(), "segments are unlinked as soon as the shard mapped them"
        client = clients[0]
        pulled = asgd_steps(client, tensors, grads)
        assert client.traffic.bytes_pulled == (steps + 1) * sum(4 * t.numel() for t in tensors.values())
        return pulled, client.shared_shards
    finally:
        leave(sessions, clients)


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_shared_payloads_give_the_same_weights_as_inline_ones(shards_only, codec):
    inline, inline_shards = _train(shards_only.address, codec, transport="grpc")
    shared, shared_shards = _train(shards_only.address, codec, transport="shm")
    assert inline_shards == [] and shared_shards == [0, 1, 2]
    for name in inline:
        assert torch.equal(shared[name], inline[name]), name  # bit-exact
    assert not _own_segments()


def test_a_shard_that_cannot_open_the_segment_gets_payloads_inline(shards_only, tmp_path, monkeypatch):
    expected, _ = _train(shards_only.address, "none", transport="grpc")
    # The worker's segments go where the shards cannot see them: another host, as far as they know.
    monkeypatch.setattr(shared_memory, "SHM_DIR", tmp_path)
    pulled, shared_shards = _train(shards_only.address, "none", transport="shm")
    assert shared_shards == []
    for name in expected:
        assert torch.equal(pulled[name], expected[name]), name
    assert not list(tmp_path.iterdir())


def test_bad_segments_and_regions_are_rejected_and_change_nothing(shards_only):
    tensors = {"w": torch.randn(1000)}
    spec = run_pb2.RunSpec(scheme="asgd", workers=2, steps=100, optimizer=run_pb2.OptimizerSpec(name="sgd", lr=0.1))
    run_id, sessions, clients, placement = join_run(shards_only.address, spec, tensors, n_workers=2)
    mine, theirs = sessions[0].worker_id, sessions[1].worker_id
    (p,) = placement.parts
    segments = [Segment.create(8192) for _ in range(5)]
    try:
        clients[0].register(tensors)
        with open_channel(placement.shards[p.shard]) as channel:
            stub = shard_pb2_grpc.ShardServiceStub(channel)

            def map_segment(seg: Segment, worker: int = mine, **overrides):
                fields = dict(run_id=run_id, worker_id=worker, segment=seg.name, token=seg.token)
                return stub.MapSegment(shard_pb2.MapSegmentRequest(**{**fields, **overrides}))

            def rejected(call, code: grpc.StatusCode, words: str) -> None:
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == code, err.value.details()
                assert words in err.value.details() and "\n" not in err.value.details()

            seg, other = segments[0], segments[1]
            rejected(lambda: map_segment(seg, run_id="nope"), grpc.StatusCode.NOT_FOUND, "unknown run")
            rejected(lambda: map_segment(seg, segment="../x"), grpc.StatusCode.INVALID_ARGUMENT, "bad segment name")
            rejected(lambda: map_segment(seg, segment="gradps-gone"), grpc.StatusCode.FAILED_PRECONDITION, "not on")
            rejected(lambda: map_segment(seg, token=bytes(16)), grpc.StatusCode.FAILED_PRECONDITION, "token")
            rejected(lambda: map_segment(seg, worker=9999), grpc.StatusCode.FAILED_PRECONDITION, "not a live")
            assert map_segment(seg).size == seg.size
            assert map_segment(other, worker=theirs).size == other.size
            # The client mapped one segment for this worker already: two more fit, a fifth not.
            map_segment(segments[2])
            map_segment(segments[3])
            rejected(lambda: map_segment(segments[4]), grpc.StatusCode.RESOURCE_EXHAUSTED, "already has 4")

            seg.floats(ALIGN, p.count).fill_(1.0)
            other.floats(ALIGN, p.count).fill_(1.0)
            seg.floats(ALIGN + 4096, 4).fill_(float("nan"))

            def push(region: tensor_pb2.SharedRegion, payload: bytes = b"", step: int = 0):
                part = tensor_pb2.TensorPart(
                    name="w", index=0, offset=p.offset, count=p.count, dtype=tensor_pb2.DTYPE_FLOAT32, codec=NONE
                )
                part.payload = payload
                part.shared.CopyFrom(region)
                request = shard_pb2.PushRequest(run_id=run_id, worker_id=mine, step=step)
                request.parts.append(part)
                return stub.Push(iter([request]))

            size = 4 * p.count

            def region(segment: Segment = seg, offset: int = ALIGN, length: int = size):
                return tensor_pb2.SharedRegion(segment=segment.name, offset=offset, length=length)

            invalid, precondition = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
            rejected(lambda: push(region(offset=seg.size - 64)), invalid, "not an aligned range")
            rejected(lambda: push(region(offset=ALIGN + 4)), invalid, "not an aligned range")
            rejected(lambda: push(region(offset=0)), invalid, "not an aligned range")
            rejected(lambda: push(region(length=size - 4)), invalid, "payload is")
            rejected(lambda: push(region(other)), precondition, "not mapped for worker")
            rejected(lambda: push(region(segments[4])), precondition, "not mapped for worker")
            rejected(lambda: push(region(), payload=b"\0" * size), invalid, "a payload and a shared one")
            empty = shard_pb2.PushRequest(run_id=run_id, worker_id=mine, step=0)
            rejected(lambda: stub.Push(iter([empty])), invalid, "a PushRequest without a part")
            seg.floats(ALIGN + 4096, p.count).fill_(0.5)
            seg.floats(ALIGN + 4096, 1).fill_(float("nan"))
            rejected(lambda: push(region(offset=ALIGN + 4096)), invalid, "NaN")

            def pull(into: tensor_pb2.SharedRegion):
                return list(stub.Pull(shard_pb2.PullRequest(run_id=run_id, worker_id=mine, into=into)))

            rejected(lambda: pull(region(offset=seg.size)), invalid, "not an aligned range")
            rejected(lambda: pull(region(other)), precondition, "not mapped for worker")

            # Nothing changed; a good shared push is applied once, and a pull lands in the region.
            pulled = {"w": torch.zeros(1000)}
            clients[0].pull(pulled)
            assert torch.equal(pulled["w"], tensors["w"])
            assert push(region(), step=1).applied and not push(region(), step=1).applied
            (response,) = pull(region(offset=ALIGN + 4096, length=size))
            assert not response.HasField("part")
            (part,) = response.parts
            assert part.shared.offset == ALIGN + 4096 and part.shared.length == size and not part.payload
            assert torch.allclose(seg.floats(ALIGN + 4096, p.count), tensors["w"] - 0.1)
            # A region too small for the part: it comes inline instead (a small part: in `parts`).
            (response,) = pull(region(length=size - 64))
            (part,) = response.parts
            assert not part.HasField("shared") and len(part.payload) == size
            assert np.allclose(np.frombuffer(part.payload, np.float32), tensors["w"].numpy() - 0.1)
    finally:
        for segment in segments:
            segment.unlink()
        leave(sessions, clients)


def test_a_group_average_through_shared_memory(shards_only):
    """wagma's deposit and average through the worker's segment, and bad regions rejected."""
    tensors = {"w": torch.randn(1000)}
    spec = run_pb2.RunSpec(scheme="wagma", workers=2, steps=100)
    run_id, sessions, clients, placement = join_run(shards_only.address, spec, tensors, n_workers=2)
    mine, theirs = sessions[0].worker_id, sessions[1].worker_id
    (p,) = placement.parts
    seg, other = Segment.create(16384), Segment.create(16384)
    size = 4 * p.count
    try:
        clients[0].register(tensors)
        with open_channel(placement.shards[p.shard]) as channel:
            stub = shard_pb2_grpc.ShardServiceStub(channel)
            for segment, worker in ((seg, mine), (other, theirs)):
                stub.MapSegment(
                    shard_pb2.MapSegmentRequest(
                        run_id=run_id, worker_id=worker, segment=segment.name, token=segment.token
                    )
                )
            seg.floats(ALIGN, p.count).copy_(tensors["w"])

            def region(segment: Segment = seg, offset: int = ALIGN, length: int = size):
                return tensor_pb2.SharedRegion(segment=segment.name, offset=offset, length=length)

            def average(deposit: tensor_pb2.SharedRegion, into: tensor_pb2.SharedRegion, step: int = 1):
                part = tensor_pb2.TensorPart(
                    name="w", index=0, offset=p.offset, count=p.count, dtype=tensor_pb2.DTYPE_FLOAT32, codec=NONE
                )
                part.shared.CopyFrom(deposit)
                request = shard_pb2.GroupAverageRequest(run_id=run_id, worker_id=mine, step=step, members=[mine])
                request.parts.append(part)
                request.into.CopyFrom(into)
                return list(stub.GroupAverage(iter([request])))

            def rejected(call, code: grpc.StatusCode, words: str) -> None:
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == code, err.value.details()
                assert words in err.value.details() and "\n" not in err.value.details()

            into = region(offset=ALIGN + 8192)
            invalid, precondition = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
            rejected(lambda: average(region(), region(other, offset=ALIGN + 8192)), precondition, "not mapped for")
            rejected(lambda: average(region(), region(offset=seg.size)), invalid, "not an aligned range")
            rejected(lambda: average(region(other), into), precondition, "not mapped for worker")
            rejected(lambda: average(region(offset=ALIGN + 4), into), invalid, "not an aligned range")
            seg.floats(ALIGN + 4096, p.count).copy_(tensors["w"])
            seg.floats(ALIGN + 4096, 1).fill_(float("nan"))
            rejected(lambda: average(region(offset=ALIGN + 4096), into), invalid, "NaN")
            # The average of one member's deposit is the deposit, written into its region.
            (response,) = average(region(), into)
            (part,) = response.parts
            assert part.shared.offset == ALIGN + 8192 and part.shared.length == size and not part.payload
            assert part.version == 1
            assert torch.equal(seg.floats(ALIGN + 8192, p.count), tensors["w"])
    finally:
        seg.unlink()
        other.unlink()
        leave(sessions, clients)
