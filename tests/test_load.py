"""A real cluster's load on the local one: sync runs of up to 256 workers, every other scheme with
64, and a run beside a thousand waiting pulls and a thousand open WatchRun streams. Waiting calls
hold no thread (gradps.serving), so each service's threads stay far below the calls it holds.
Figures are printed (`-s`), not asserted: this machine is shared; docs/performance.md has them
from 4 to 256 workers."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from client.local_cluster import LocalCluster
from gradps.channel import open_channel
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import coordinator_pb2_grpc, shard_pb2, shard_pb2_grpc
from tests.load_run import Beside, ends_exact, scheme_load

pytestmark = pytest.mark.load

# Below any count of waiting calls here: the shards' pools have 32 threads, the coordinator's 64.
MOST_THREADS = 120


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    # The workers here are threads of this one process, which also makes all of their calls: on two
    # busy cores a heartbeat thread among 256 can wait past the 5 s default and the coordinator
    # declares a live worker dead. Failure detection is tested elsewhere; here it must not fire.
    with LocalCluster(shards=2, workers=0, heartbeat_timeout_s=30.0) as c:
        yield c


@pytest.mark.parametrize("workers", [4, 16, 64, 256])
def test_a_sync_run_of_up_to_256_workers_completes_exactly_with_bounded_threads(cluster, workers):
    result = scheme_load(cluster, "sync", workers=workers, steps=8)
    print(result.line())
    assert ends_exact(result)
    assert result.sampled.failed_health_checks == 0 and result.sampled.health_checks > 0
    # Every worker's pull waits at every step boundary: with a thread each, 256 workers would take 256.
    assert max(result.sampled.threads.values()) < MOST_THREADS, result.sampled.threads


@pytest.mark.parametrize("scheme", ["asgd", "ssp", "pseudosync", "wagma"])
def test_every_scheme_holds_64_workers_with_bounded_threads(cluster, scheme):
    result = scheme_load(cluster, scheme, workers=64, steps=6)
    print(result.line())
    assert len(result.pulls_s) == 64 * 6  # every worker made every step
    assert result.sampled.failed_health_checks == 0
    assert max(result.sampled.threads.values(), default=0) < MOST_THREADS, result.sampled.threads


def _idle_load(address: str) -> Beside:
    """1,000 pulls that wait for a step the run never reaches and 1,000 open WatchRun streams, on
    100 connections each (a connection is one caller, limited to half a service's threads)."""

    def start(run_id: str, workers: list[int], shards: list[str]) -> Callable[[], None]:
        channels = [open_channel(address) for _ in range(100)]
        channels += [open_channel(shards[i % len(shards)]) for i in range(100)]
        for channel in channels:
            grpc.channel_ready_future(channel).result(timeout=60)
        calls = []
        for i, channel in enumerate(channels):
            for _ in range(10):
                if i < 100:
                    watch = coordinator_pb2_grpc.CoordinatorServiceStub(channel).WatchRun
                    calls.append(watch(cpb.WatchRunRequest(run_id=run_id), timeout=600))
                else:
                    pull = shard_pb2_grpc.ShardServiceStub(channel).Pull
                    request = shard_pb2.PullRequest(
                        run_id=run_id, worker_id=workers[i % len(workers)], min_version=10**9, wait_ms=600_000
                    )
                    calls.append(pull(request, timeout=600))
        time.sleep(2)  # the calls reach their services and wait before the run is timed

        def stop() -> None:
            held = sum(not call.done() for call in calls)
            for call in calls:
                call.cancel()
            for channel in channels:
                channel.close()
            assert held == len(calls), f"{len(calls) - held} of the waiting calls ended early"

        return stop

    return start


def test_a_run_beside_a_thousand_waiting_pulls_and_watch_streams_completes(cluster):
    plain = scheme_load(cluster, "sync", workers=8, steps=50)
    loaded = scheme_load(cluster, "sync", workers=8, steps=50, beside=_idle_load(cluster.address))
    print(f"alone: {plain.line()}\nbeside 1,000 pulls and 1,000 streams: {loaded.line()}")
    print(f"throughput beside them: {loaded.steps_per_s / plain.steps_per_s:.2f} of alone")
    assert ends_exact(loaded)
    assert loaded.sampled.failed_health_checks == 0
    assert max(loaded.sampled.threads.values()) < MOST_THREADS, loaded.sampled.threads
