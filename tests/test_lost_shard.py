"""A shard holding parts of a running run killed with SIGKILL and never started again: the run fails
once the shard has been silent for --shard-return-timeout, saying which shard, and its workers are
free again; after a coordinator restart the silence counts from the restart. A shard restarted in
time recovers the run, which completes. Real processes (a local cluster; the coordinator takes the
option from its environment variable, which the local cluster passes on)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from client.local_cluster import LocalCluster
from client.report import follow
from client.sdk import Client
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import run_pb2
from tests.digits_run import CHECKPOINT_EVERY, digits_spec
from tests.services import until

HEARTBEAT_TIMEOUT_S = 2.0
RETURN_TIMEOUT_S = 5.0
# A machine of two cores with a test suite beside: the deadlines leave room.
MARGIN_S = 60.0
LOST = 1  # the shard killed for good
ENV = "GRADPS_SHARD_RETURN_TIMEOUT"


def _spec(steps: int) -> run_pb2.RunSpec:
    return digits_spec("sync", steps)


def _at_step(client: Client, run_id: str, step: int) -> bool:
    run = client.run(run_id).run
    assert run.state in (cpb.RUN_STATE_PENDING, cpb.RUN_STATE_RUNNING), run.message
    return run.state == cpb.RUN_STATE_RUNNING and any(m.step >= step for m in run.latest)


def _ended(client: Client, run_id: str) -> bool:
    return client.run(run_id).run.state in (cpb.RUN_STATE_COMPLETED, cpb.RUN_STATE_FAILED, cpb.RUN_STATE_STOPPED)


def _alive(client: Client, cluster: LocalCluster) -> list[bool]:
    """Whether the coordinator holds each of the cluster's shards alive, in the cluster's order
    (the coordinator numbers shards as they register, which they do side by side)."""
    alive = {s.address: s.alive for s in client.cluster().shard_infos}
    return [alive[f"127.0.0.1:{port}"] for port in cluster.shard_ports]


def _kill_shard(cluster: LocalCluster, index: int) -> float:
    """SIGKILL shard `index`; when it died (monotonic)."""
    cluster.shards[index].kill()
    cluster.shards[index].wait()
    return time.monotonic()


def _assert_failed_for_the_lost_shard(client: Client, run_id: str, port: int, since: str = "") -> str:
    """The run failed for the shard on `port`, named by its index in the run's placement and its
    address, in one line; the message."""
    answer = client.run(run_id)
    run, address = answer.run, f"127.0.0.1:{port}"
    assert run.state == cpb.RUN_STATE_FAILED, (cpb.RunState.Name(run.state), run.message)
    index = list(answer.placement.shards).index(address)
    assert run.message.startswith(f"shard {index} at {address} has not come back for "), run.message
    assert run.message.endswith(f"{since}: the run cannot go on without its parts"), run.message
    assert "\n" not in run.message
    return run.message


def _assert_released(client: Client, run_id: str) -> None:
    """The run's workers are live and idle: the coordinator may give them the next run."""
    workers = set(client.run(run_id).run.workers)

    def idle() -> bool:
        known = {w.worker_id: w for w in client.cluster().workers}
        return all(known[w].alive and not known[w].run_id for w in workers if w in known) and workers <= set(known)

    until(idle, MARGIN_S, f"workers {sorted(workers)} were not released", poll_s=0.2)


def _cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, return_timeout_s: float) -> LocalCluster:
    """Two shards and two workers, keeping runs and checkpoints in `tmp_path`; a coordinator that
    waits `return_timeout_s` for a lost shard."""
    monkeypatch.setenv(ENV, str(return_timeout_s))
    logs, state = tmp_path / "logs", tmp_path / "state"
    return LocalCluster(shards=2, workers=2, state_dir=state, log_dir=logs, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalCluster]:
    with _cluster(tmp_path, monkeypatch, RETURN_TIMEOUT_S) as c:
        yield c


def test_a_run_whose_shard_never_comes_back_fails_naming_it_and_frees_its_workers(cluster):
    with Client(cluster.address) as client:
        run_id = client.submit(_spec(100_000))
        until(lambda: _at_step(client, run_id, 20), 120, "the run never reached step 20", poll_s=0.05)
        killed = _kill_shard(cluster, LOST)
        until(lambda: _ended(client, run_id), HEARTBEAT_TIMEOUT_S + RETURN_TIMEOUT_S + MARGIN_S, "the run hangs")
        took = time.monotonic() - killed
        message = _assert_failed_for_the_lost_shard(client, run_id, cluster.shard_ports[LOST])
        print(f"\nfailed {took:.1f} s after the kill: {message}")
        # Its last heartbeat came at most a heartbeat interval (0.2 s) before the kill.
        assert took >= RETURN_TIMEOUT_S - 0.5, took
        _assert_released(client, run_id)
        assert _alive(client, cluster) == [True, False]  # shown dead, not forgotten yet
        # The workers stop waiting for the lost shard with their run: the next run (on shard 0
        # alone) trains at once, not after their two-minute wait.
        submitted = time.monotonic()
        after = client.submit(_spec(CHECKPOINT_EVERY))
        assert follow(client, after, cluster.log_dir / "after", show_progress=False)["state"] == "completed"
        assert time.monotonic() - submitted < MARGIN_S, time.monotonic() - submitted


@pytest.mark.slow
def test_after_a_coordinator_restart_a_shard_that_never_heartbeats_fails_its_run(tmp_path, monkeypatch):
    """The coordinator and shard 1 killed; the coordinator alone comes back, with a shorter
    return timeout than the first one had: the run fails that long after the restart, whatever
    the first one waited already."""
    with _cluster(tmp_path, monkeypatch, RETURN_TIMEOUT_S + MARGIN_S) as cluster:
        with Client(cluster.address) as client:
            earlier = client.submit(_spec(CHECKPOINT_EVERY))
            assert follow(client, earlier, tmp_path / "earlier", show_progress=False)["state"] == "completed"
            run_id = client.submit(_spec(100_000))
            until(lambda: _at_step(client, run_id, 20), 120, "the run never reached step 20", poll_s=0.05)
            _kill_shard(cluster, LOST)
            # Once the coordinator declared it dead the workers wait at the shard, and no metrics
            # report is in flight when the coordinator dies (one that is gives up its run: README).
            until(
                lambda: _alive(client, cluster) == [True, False],
                MARGIN_S,
                "the shard was not declared dead",
                poll_s=0.05,
            )
            assert client.run(run_id).run.state == cpb.RUN_STATE_RUNNING
        assert cluster.coordinator is not None
        cluster.coordinator.kill()
        cluster.coordinator.wait()
        monkeypatch.setenv(ENV, str(RETURN_TIMEOUT_S))
        cluster.restart_coordinator()
        restarted = time.monotonic()
        with Client(cluster.address) as client:
            until(lambda: _ended(client, run_id), RETURN_TIMEOUT_S + MARGIN_S, "the run hangs after the restart")
            took = time.monotonic() - restarted
            since = " (since the coordinator restarted)"
            message = _assert_failed_for_the_lost_shard(client, run_id, cluster.shard_ports[LOST], since)
            print(f"\nfailed {took:.1f} s after the restart: {message}")
            assert took >= RETURN_TIMEOUT_S - 0.5, took
            listed = {r.run_id: r.state for r in client.runs()}
            assert listed[earlier] == cpb.RUN_STATE_COMPLETED, listed
            _assert_released(client, run_id)


@pytest.mark.slow
def test_a_shard_restarted_within_the_return_timeout_keeps_its_run_going(tmp_path, monkeypatch):
    """A bound of a few heartbeat timeouts is enough for a shard's restart and RestoreRun."""
    with _cluster(tmp_path, monkeypatch, 15.0) as cluster, Client(cluster.address) as client:
        run_id = client.submit(_spec(300))
        until(lambda: _at_step(client, run_id, 2 * CHECKPOINT_EVERY), 120, "the run never reached step 40")
        _kill_shard(cluster, LOST)
        cluster.restart_shard(LOST)
        summary = follow(client, run_id, tmp_path / "run", show_progress=False)
        assert summary["state"] == "completed", summary
        assert client.run(run_id).run.restores == 1


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("-1", "-1.0 is not in the range x>=0"),
        ("soon", "'soon' is not a valid float"),
        ("nan", "nan is not a number of seconds"),
    ],
)
def test_a_bad_shard_return_timeout_is_refused_in_one_line(value, words):
    command = [sys.executable, "-m", "ps_server.coordinator", "--port=0", f"--shard-return-timeout={value}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and words in errors[0] and "--shard-return-timeout" in errors[0], done.stderr
