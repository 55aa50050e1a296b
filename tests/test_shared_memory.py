"""Shared-memory payloads (gradps/shared_memory.py): sealed segments, and pushes and pulls through
them against real shard processes, including a shard that cannot see the worker's segment, every
kind of bad segment or region a client could name, and a client that cuts its segment."""

from __future__ import annotations

import ctypes
import fcntl
import gc
import os
import stat
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
import torch

from gradps.channel import open_channel
from gradps.codec_table import parse_codec
from gradps.shared_memory import ALIGN, Segment, SegmentError, pid_namespace
from gradps.transport import shared_memory as shared_route
from gradps.v1 import run_pb2, shard_pb2, shard_pb2_grpc, tensor_pb2
from tests.joined_run import NONE, asgd_steps, join_run, leave


def _own_descriptors() -> list[str]:
    """This process's descriptors of gradps segments: a worker's mapping holds one (Python's
    mmap keeps a copy of the descriptor it maps), and the one the shard opened the segment
    through is closed once the shard answered."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed since
            continue
        if target.startswith("/memfd:gradps-"):
            names.append(target)
    return sorted(names)


def _open(segment: Segment, token: bytes | None = None, **where) -> Segment:
    """`segment` opened as a shard opens it, through this process's descriptor of it."""
    fields = {"pid": os.getpid(), "fd": segment.descriptor(), "namespace": pid_namespace(), **where}
    return Segment.open(segment.name, segment.token if token is None else token, **fields)


def hand_made_memfd(size: int, token: bytes, seals: int = 0, mode: int = 0o600, sealable: bool = True) -> int:
    """A memfd of `size` bytes that starts with `token`, as a client other than gradps' might
    make it: `seals` added, `mode`."""
    fd = os.memfd_create("gradps-hand-made", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealable else 0))
    os.ftruncate(fd, size)
    os.pwrite(fd, token, 0)
    os.fchmod(fd, mode)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def map_request(run: str, worker: int, created: Segment, **overrides) -> shard_pb2.MapSegmentRequest:
    """The MapSegment request of a worker (this process) for segment `created`, with `overrides`."""
    fields = dict(
        run_id=run,
        worker_id=worker,
        segment=created.name,
        token=created.token,
        pid=os.getpid(),
        fd=created.descriptor(),
        pid_namespace=pid_namespace(),
    )
    return shard_pb2.MapSegmentRequest(**{**fields, **overrides})


def test_a_segment_is_shared_by_token_and_checks_its_regions():
    created = Segment.create(1000)
    try:
        opened = _open(created)
        assert opened.size == created.size == ALIGN + 1024
        created.floats(ALIGN, 4).copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        assert opened.floats(ALIGN, 4).tolist() == [1.0, 2.0, 3.0, 4.0]
        opened.region(ALIGN + 64, 3)[:] = b"abc"
        assert bytes(created.region(ALIGN + 64, 3)) == b"abc"
        with pytest.raises(SegmentError, match="token does not match"):
            _open(created, token=bytes(16))
        for offset, length in [(0, 4), (ALIGN + 4, 4), (ALIGN, created.size), (ALIGN, -1)]:
            with pytest.raises(SegmentError, match="not an aligned range"):
                created.region(offset, length)
    finally:
        created.release()
    assert created.floats(ALIGN, 4).tolist() == [1.0, 2.0, 3.0, 4.0]  # the mapping outlives the descriptor
    with pytest.raises(SegmentError, match="no descriptor here"):
        created.descriptor()
    for name in ["gradps-", "other-1", "gradps-../../etc/passwd", "gradps-" + "x" * 101]:
        with pytest.raises(SegmentError, match="bad segment name"):
            Segment.open(name, created.token, os.getpid(), 0, pid_namespace())


def test_only_a_sealed_memfd_of_this_user_is_mapped(tmp_path):
    """What a shard refuses to map, before it touches a byte: anything whose pages could be cut
    from under its mapping, or that is not a private segment of its own user."""
    token = bytes(range(16))
    size = 4 * ALIGN

    def refused(fd: int, words: str, **where) -> None:
        with pytest.raises(SegmentError, match=words):
            Segment.open("gradps-x", token, **{"pid": os.getpid(), "fd": fd, "namespace": pid_namespace(), **where})

    shrink, grow = fcntl.F_SEAL_SHRINK, fcntl.F_SEAL_GROW
    opened: list[int] = []
    try:
        opened.append(unsealed := hand_made_memfd(size, token))
        refused(unsealed, r"not sealed against shrinking \(F_SEAL_SHRINK\)")
        opened.append(grow_only := hand_made_memfd(size, token, seals=grow))
        refused(grow_only, "not sealed against shrinking")
        opened.append(unsealable := hand_made_memfd(size, token, sealable=False))
        refused(unsealable, "not sealed against shrinking")
        opened.append(open_to_all := hand_made_memfd(size, token, seals=shrink, mode=0o644))
        refused(open_to_all, "is not 600 and this user's")
        opened.append(too_small := hand_made_memfd(ALIGN // 2, token, seals=shrink))
        refused(too_small, "too small")
        # Sealed against shrinking is enough: then no one can cut a page.
        opened.append(shrink_only := hand_made_memfd(size, token, seals=shrink))
        assert Segment.open("gradps-x", token, os.getpid(), shrink_only, pid_namespace()).size == size
        disk = tmp_path / "segment"
        disk.write_bytes(token + bytes(size))
        disk.chmod(0o600)
        opened.append(on_disk := os.open(disk, os.O_RDWR))
        refused(on_disk, "is not a memfd")
        read_end, write_end = os.pipe()
        opened += [read_end, write_end]
        refused(read_end, "not a regular file")
        refused(unsealed, "another PID namespace", namespace=pid_namespace() + 1)
        refused(2**31 - 1, "no such process or descriptor")
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        refused(shrink_only, "no such process or descriptor", pid=dead.pid)
    finally:
        for fd in opened:
            os.close(fd)


def test_a_created_segment_can_neither_shrink_nor_grow():
    segment = Segment.create(1 << 16)
    try:
        fd = segment.descriptor()
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
        # Through its own descriptor, a fresh one, or any size: the seals are the file's.
        again = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            for target, length in [(fd, 0), (again, 0), (fd, ALIGN), (again, segment.size + ALIGN)]:
                with pytest.raises(PermissionError):
                    os.ftruncate(target, length)
            with pytest.raises(PermissionError):  # nor can the seals be changed
                fcntl.fcntl(again, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        finally:
            os.close(again)
        assert os.fstat(fd).st_size == segment.size
    finally:
        segment.release()


def _train(address: str, codec: str, transport: str, steps: int = 3) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Push and pull a few asgd steps; the weights pulled at the end and the shards that got
    payloads through shared memory."""
    torch.manual_seed(0)
    tensors = {"w": torch.randn(300, 301), "b": torch.randn(77)}
    grads = [{n: torch.randn_like(t) for n, t in tensors.items()} for _ in range(steps)]
    spec = run_pb2.RunSpec(
        scheme="asgd", workers=1, steps=100, part_size=64 << 10, optimizer=run_pb2.OptimizerSpec(name="sgd", lr=0.1)
    )
    gc.collect()  # an earlier test's segments, unreachable but not yet collected, close now, not below
    before = len(_own_descriptors())
    run_id, sessions, clients, placement = join_run(
        address, spec, tensors, codec=parse_codec(codec), transport=transport
    )
    try:
        client = clients[0]
        mapped = len(_own_descriptors()) - before
        assert mapped == len(client.shared_shards), "a descriptor per segment, its mapping's"
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


def test_a_shard_that_cannot_open_the_segment_gets_payloads_inline(shards_only, monkeypatch):
    expected, _ = _train(shards_only.address, "none", transport="grpc")
    # The worker says it runs in another PID namespace (another container): its pid means nothing
    # to the shards, which refuse to open a descriptor by it.
    monkeypatch.setattr(shared_route, "pid_namespace", lambda: pid_namespace() + 1)
    pulled, shared_shards = _train(shards_only.address, "none", transport="shm")
    assert shared_shards == []
    for name in expected:
        assert torch.equal(pulled[name], expected[name]), name


def test_pushes_and_pulls_through_shared_memory_start_no_thread(shards_only, monkeypatch):
    # Each call is one message each way, made and read by the calling thread: a thread started
    # per call (grpcio's for a streamed request, or for a channel whose call began) costs more
    # than the round trip on a busy host.
    tensors = {f"t{i}": torch.randn(3000) for i in range(4)}
    spec = run_pb2.RunSpec(
        scheme="asgd", workers=1, steps=100, part_size=4096, optimizer=run_pb2.OptimizerSpec(name="sgd", lr=0.1)
    )
    run_id, sessions, clients, placement = join_run(shards_only.address, spec, tensors)
    client = clients[0]
    started: list[str] = []
    start = threading.Thread.start

    def counted(thread: threading.Thread) -> None:
        started.append(thread.name)
        start(thread)

    try:
        assert len({p.shard for p in placement.parts}) > 1 and len(client.shared_shards) > 1
        client.register(tensors)
        pulled = {n: torch.zeros_like(t) for n, t in tensors.items()}
        grad = {n: torch.ones_like(t) for n, t in tensors.items()}
        for step in range(2):  # the client's pools start their threads
            client.push_pull(grad, step, pulled)
            client.pull(pulled)
        monkeypatch.setattr(threading.Thread, "start", counted)
        for step in range(2, 12, 2):
            client.push_pull(grad, step, pulled)
            client.push(grad, step + 1)
            client.pull(pulled)
        monkeypatch.undo()
        for name, t in tensors.items():  # 12 pushes of ones at lr 0.1
            torch.testing.assert_close(pulled[name], t - 1.2, rtol=0, atol=1e-5, msg=name)
        assert started == []
    finally:
        leave(sessions, clients)


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
                return stub.MapSegment(map_request(run_id, worker, seg, **overrides))

            def rejected(call, code: grpc.StatusCode, words: str) -> None:
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == code, err.value.details()
                assert words in err.value.details() and "\n" not in err.value.details()

            seg, other = segments[0], segments[1]
            rejected(lambda: map_segment(seg, run_id="nope"), grpc.StatusCode.NOT_FOUND, "unknown run")
            rejected(lambda: map_segment(seg, segment="../x"), grpc.StatusCode.INVALID_ARGUMENT, "bad segment name")
            precondition = grpc.StatusCode.FAILED_PRECONDITION
            rejected(lambda: map_segment(seg, fd=2**31 - 1), precondition, "no such process or descriptor")
            rejected(lambda: map_segment(seg, pid_namespace=pid_namespace() + 1), precondition, "PID namespace")
            unsealed = hand_made_memfd(seg.size, seg.token)
            try:
                rejected(lambda: map_segment(seg, fd=unsealed), precondition, "not sealed against shrinking")
            finally:
                os.close(unsealed)
            rejected(lambda: map_segment(seg, token=bytes(16)), precondition, "token")
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
                request = shard_pb2.PushRequest(run_id=run_id, worker_id=mine, step=step, part_count=1)
                request.parts.append(part)
                return stub.Push(iter([request]))

            size = 4 * p.count

            def region(segment: Segment = seg, offset: int = ALIGN, length: int = size):
                return tensor_pb2.SharedRegion(segment=segment.name, offset=offset, length=length)

            invalid = grpc.StatusCode.INVALID_ARGUMENT
            rejected(lambda: push(region(offset=seg.size - 64)), invalid, "not an aligned range")
            rejected(lambda: push(region(offset=ALIGN + 4)), invalid, "not an aligned range")
            rejected(lambda: push(region(offset=0)), invalid, "not an aligned range")
            rejected(lambda: push(region(length=size - 4)), invalid, "payload is")
            rejected(lambda: push(region(other)), precondition, "not mapped for worker")
            rejected(lambda: push(region(segments[4])), precondition, "not mapped for worker")
            rejected(lambda: push(region(), payload=b"\0" * size), invalid, "a payload and a shared one")
            empty = shard_pb2.PushRequest(run_id=run_id, worker_id=mine, step=0, part_count=1)
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
            # Made again, a push is answered as applied and applied once (the values below).
            assert push(region(), step=1).applied and push(region(), step=1).applied
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
            segment.release()
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
                stub.MapSegment(map_request(run_id, worker, segment))
            seg.floats(ALIGN, p.count).copy_(tensors["w"])

            def region(segment: Segment = seg, offset: int = ALIGN, length: int = size):
                return tensor_pb2.SharedRegion(segment=segment.name, offset=offset, length=length)

            def average(deposit: tensor_pb2.SharedRegion, into: tensor_pb2.SharedRegion, step: int = 1):
                part = tensor_pb2.TensorPart(
                    name="w", index=0, offset=p.offset, count=p.count, dtype=tensor_pb2.DTYPE_FLOAT32, codec=NONE
                )
                part.shared.CopyFrom(deposit)
                request = shard_pb2.GroupAverageRequest(
                    run_id=run_id, worker_id=mine, step=step, members=[mine], part_count=1
                )
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
        seg.release()
        other.release()
        leave(sessions, clients)


def _punch_hole(fd: int, offset: int, length: int) -> None:
    """Free the pages of [offset, offset + length) of a file, its size unchanged (they read as
    zeros after): what F_SEAL_SHRINK still allows."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    punch_hole_keep_size = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
    if libc.fallocate(fd, punch_hole_keep_size, offset, length) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def test_a_client_that_cuts_its_segment_cannot_kill_the_shard(shards_only):
    """A local client maps a segment and then tries to cut it from under the shard's mapping
    (ftruncate to 0, from its own descriptor and a fresh one, from a thread racing the shard's
    copies) while it keeps pushing and pulling through it: the seals refuse every cut, and the
    shard process stays alive and answers. An unsealed segment, which it could cut, the shard
    refuses to map at all."""
    tensors = {"w": torch.randn(1 << 16)}
    spec = run_pb2.RunSpec(scheme="asgd", workers=1, steps=100, optimizer=run_pb2.OptimizerSpec(name="sgd", lr=0.5))
    run_id, sessions, clients, placement = join_run(shards_only.address, spec, tensors, transport="grpc")
    (worker,) = (s.worker_id for s in sessions)
    (p,) = placement.parts
    size = 4 * p.count
    segment = Segment.create(2 * size)
    fd = segment.descriptor()
    cuts: list[int] = []
    stop = threading.Event()

    def cut_in_a_loop() -> None:
        while not stop.is_set():
            for length in (0, ALIGN):
                try:
                    os.ftruncate(fd, length)
                    cuts.append(length)
                except PermissionError:
                    pass
            stop.wait(0.001)

    try:
        clients[0].register(tensors)
        with open_channel(placement.shards[p.shard]) as channel:
            stub = shard_pb2_grpc.ShardServiceStub(channel)
            assert stub.MapSegment(map_request(run_id, worker, segment)).size == segment.size
            part = tensor_pb2.TensorPart(
                name="w", index=0, offset=p.offset, count=p.count, dtype=tensor_pb2.DTYPE_FLOAT32, codec=NONE
            )
            part.shared.CopyFrom(tensor_pb2.SharedRegion(segment=segment.name, offset=ALIGN, length=size))
            into = tensor_pb2.SharedRegion(segment=segment.name, offset=ALIGN + size, length=size)
            cutter = threading.Thread(target=cut_in_a_loop)
            cutter.start()
            expected = tensors["w"].clone()
            for step in range(8):
                for target in (fd, os.open(f"/proc/self/fd/{fd}", os.O_RDWR)):
                    with pytest.raises(PermissionError):
                        os.ftruncate(target, 0)
                    if target != fd:
                        os.close(target)
                if step == 4:  # pages freed but not cut: they read as zeros, no fault
                    _punch_hole(fd, ALIGN, size)
                else:
                    segment.floats(ALIGN, p.count).fill_(0.25)
                    expected -= 0.5 * 0.25
                request = shard_pb2.PushRequest(run_id=run_id, worker_id=worker, step=step, part_count=1)
                request.parts.append(part)
                assert stub.Push(iter([request])).applied
                (response,) = stub.Pull(shard_pb2.PullRequest(run_id=run_id, worker_id=worker, into=into))
                assert response.parts[0].shared.offset == ALIGN + size
                torch.testing.assert_close(segment.floats(ALIGN + size, p.count), expected)
            stop.set()
            cutter.join()
            assert cuts == [] and os.fstat(fd).st_size == segment.size

            # An unsealed memfd: the client could cut it, so the shard never maps it, and calls
            # naming it are refused while the client cuts it.
            unsealed = hand_made_memfd(segment.size, segment.token)
            try:
                with pytest.raises(grpc.RpcError) as err:
                    stub.MapSegment(map_request(run_id, worker, segment, segment="gradps-unsealed", fd=unsealed))
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "not sealed against shrinking" in err.value.details()
                os.ftruncate(unsealed, 0)
                request = shard_pb2.PushRequest(run_id=run_id, worker_id=worker, step=8, part_count=1)
                request.parts.append(part)
                request.parts[0].shared.segment = "gradps-unsealed"
                with pytest.raises(grpc.RpcError) as err:
                    stub.Push(iter([request]))
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not mapped" in err.value.details()
            finally:
                os.close(unsealed)
            stats = stub.GetStats(shard_pb2.GetStatsRequest(run_id=run_id))
            assert stats.pushes == 8
        assert all(shard.poll() is None for shard in shards_only.shards), "a shard died"
    finally:
        stop.set()
        segment.release()
        leave(sessions, clients)
