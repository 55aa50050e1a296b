"""A shard serves every thread's allocations from one malloc arena (gradps/channel.py
`tune_allocator`, applied by every gradps factory before it starts threads: make_server,
open_channel and the data port's StreamListener). gRPC decodes pushes on many threads, and a
gradient freed in one thread's arena cannot serve the next push decoded on another, so with an
arena per thread a shard's memory grows with its threads (docs/performance.md "Shard memory")."""

from __future__ import annotations

import platform
import threading

import pytest
import torch

from gradps.v1 import run_pb2
from tests.joined_run import join_run, leave

# glibc's arenas other than the main one live in heaps of this size, aligned to it (malloc.h's
# HEAP_MAX_SIZE on 64-bit): an anonymous read-write mapping at such an address, followed by its
# reserved, inaccessible rest.
_HEAP_MAX = 64 << 20


def _arena_heaps(pid: int) -> int:
    """The secondary arena heaps mapped in process `pid`."""
    with open(f"/proc/{pid}/maps") as f:
        maps = [line.split() for line in f]
    heaps = 0
    for used, rest in zip(maps, maps[1:], strict=False):
        start, end = (int(a, 16) for a in used[0].split("-"))
        rest_start, rest_end = (int(a, 16) for a in rest[0].split("-"))
        anonymous = len(used) == 5 and len(rest) == 5
        if (
            anonymous
            and start % _HEAP_MAX == 0
            and used[1].startswith("rw")
            and rest[1] == "---p"
            and rest_start == end
            and rest_end - start == _HEAP_MAX
        ):
            heaps += 1
    return heaps


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc arenas are glibc's")
def test_a_shard_serves_pushes_on_every_thread_from_one_malloc_arena(shards_only):
    # 32 MiB in 2 MiB parts over the shards, pushed by two workers at once through the messages
    # (the shard decodes each part into a fresh tensor on a gRPC thread).
    tensors = {"w": torch.zeros(8 << 20)}
    spec = run_pb2.RunSpec(
        scheme="asgd", workers=2, steps=100, part_size=2 << 20, optimizer=run_pb2.OptimizerSpec(name="sgd", lr=0.1)
    )
    run_id, sessions, clients, placement = join_run(shards_only.address, spec, tensors, 2, transport="grpc")
    try:
        clients[0].register(tensors)

        def push(client, worker: int) -> None:
            for step in range(4):
                client.push({"w": torch.full_like(tensors["w"], 1e-3 * (worker + 1))}, step)

        threads = [threading.Thread(target=push, args=(c, i)) for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        pulled = {"w": torch.empty_like(tensors["w"])}
        clients[0].pull(pulled)
        # 4 pushes of each worker, lr 0.1: the pushes landed.
        torch.testing.assert_close(pulled["w"], torch.full_like(tensors["w"], -0.1 * 4 * 3e-3))
    finally:
        leave(sessions, clients)
    for shard in shards_only.shards:
        assert _arena_heaps(shard.pid) == 0, f"shard {shard.pid} has malloc arenas of its own per thread"
