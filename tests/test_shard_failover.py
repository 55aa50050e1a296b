"""A shard killed with SIGKILL in the middle of a run and started again at its address: the run
goes on from its checkpoints and completes. Real processes (a local cluster with a state dir),
real files; the test kills and restarts the shard."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from client.local_cluster import LocalCluster
from client.report import follow
from client.sdk import Client, GradpsError
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import tensor_pb2
from tests.digits_run import CHECKPOINT_EVERY, digits_spec
from tests.services import until

_spec = digits_spec


def _wait_for_step(client: Client, run_id: str, step: int) -> None:
    deadline = time.monotonic() + 120
    while True:
        run = client.run(run_id).run
        assert run.state in (cpb.RUN_STATE_PENDING, cpb.RUN_STATE_RUNNING), run.message
        if run.state == cpb.RUN_STATE_RUNNING and any(m.step >= step for m in run.latest):
            return
        assert time.monotonic() < deadline, f"run {run_id} never reached step {step}"
        time.sleep(0.02)


def _kill_and_restart(cluster: LocalCluster, client: Client, run_id: str, at_step: int, shard: int = 1) -> None:
    _wait_for_step(client, run_id, at_step)
    cluster.shards[shard].kill()
    cluster.shards[shard].wait()
    time.sleep(0.5)  # the workers find it gone and wait for it
    cluster.restart_shard(shard)


def _checkpointed(client: Client, run_id: str) -> bool:
    """Whether a step of the run is checkpointed on every shard holding its parts."""
    try:
        return bool(client.checkpoints(run_id).checkpoints)
    except GradpsError:  # not placed yet
        return False


def _log(cluster: LocalCluster) -> str:
    return (cluster.log_dir / "coordinator.log").read_text()


def _story(cluster: LocalCluster, run_id: str) -> str:
    """Every service's log lines about `run_id`: what a failed assertion shows."""
    return "\n".join(
        f"{path.stem}: {line}"
        for path in sorted(cluster.log_dir.glob("*.log"))
        for line in path.read_text(errors="replace").splitlines()
        if run_id in line
    )


def _exported(client: Client, run_id: str) -> dict[str, torch.Tensor]:
    return client.export_state_dict(run_id)


def dropout_mlp(dataset: object) -> nn.Module:
    """A user's model with dropout (allowed below by import path): its masks come from torch's
    generator, which a worker seeds from the step it computes."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(dataset.input_shape), 64),
        nn.ReLU(),
        nn.Dropout(0.2),  # type: ignore[attr-defined]
        nn.Linear(64, dataset.num_classes),  # type: ignore[attr-defined]
    )


@pytest.fixture
def cluster(tmp_path: Path):
    logs = tmp_path / "logs"
    with LocalCluster(
        shards=2,
        workers=2,
        state_dir=tmp_path / "state",
        log_dir=logs,
        heartbeat_timeout_s=2.0,
        allow_import=["tests.test_shard_failover"],
    ) as c:
        yield c


_TOPK = tensor_pb2.CodecParams(codec=tensor_pb2.CODEC_TOPK, ratio=0.05)
_EVERY = {
    "every-20-steps": {},
    # The residuals are sent whole in the push before each checkpoint step: the cut holds them.
    "topk-error-feedback": {"codec": _TOPK},
    # rank 0 declares the cuts, so both shards checkpoint the same steps.
    "every-fifth-of-a-second": {"checkpoint_every_steps": 0, "checkpoint_every_seconds": 0.2},
    # The steps done again draw the same dropout masks.
    "dropout": {"model": "tests.test_shard_failover:dropout_mlp"},
}


# One way to checkpoint in the default selection; the others with the slow tests.
@pytest.mark.parametrize(
    "every",
    [pytest.param(v, id=k, marks=() if k == "every-20-steps" else pytest.mark.slow) for k, v in _EVERY.items()],
)
def test_a_sync_run_with_a_shard_killed_and_restarted_ends_bit_identical_to_one_without(cluster, every, tmp_path):
    """Every shard goes back to the newest step checkpointed on all of them and the workers redo
    the steps after it on the same batches: the same weights, bit for bit, as a run left alone
    (two workers: a sum of two gradients does not depend on their order)."""
    steps = 300  # killed at step 50, or after the first cut: a checkpoint before it, many steps after
    with Client(cluster.address) as client:
        alone = client.submit(_spec("sync", steps, **every))
        assert follow(client, alone, tmp_path / "alone", show_progress=False)["state"] == "completed"
        interrupted = client.submit(_spec("sync", steps, **every))
        if "checkpoint_every_seconds" in every:  # killed once a step is checkpointed on both shards
            until(lambda: _checkpointed(client, interrupted), 120, "no step checkpointed on both shards")
            _kill_and_restart(cluster, client, interrupted, at_step=0)
        else:
            _kill_and_restart(cluster, client, interrupted, at_step=50)
        summary = follow(client, interrupted, tmp_path / "interrupted", show_progress=False)
        assert summary["state"] == "completed", summary
        assert summary["shard_restores"] == 1
        status = client.run(interrupted).run
        assert status.restores == 1
        if "checkpoint_every_seconds" not in every:
            # Killed at step 50 or a little later: back to step 40 (or 60, if the kill came late).
            assert status.rolled_back_steps < 2 * CHECKPOINT_EVERY, status.rolled_back_steps
        print(f"\nrolled back {status.rolled_back_steps} steps")
        a, b = _exported(client, alone), _exported(client, interrupted)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert "every shard went back to step" in _log(cluster)


@pytest.mark.slow
def test_a_pseudosync_run_checkpointed_by_seconds_goes_back_to_a_cut_with_its_replica(cluster, tmp_path):
    """rank 0 declares the cuts by its clock and hands its replica in at each: a shard restart
    finds a step with a checkpoint on both shards, and the run completes."""
    spec = _spec("pseudosync", 600, checkpoint_every_steps=0, checkpoint_every_seconds=0.2)
    with Client(cluster.address) as client:
        run_id = client.submit(spec)
        until(lambda: _checkpointed(client, run_id), 120, "no step checkpointed on both shards")
        _kill_and_restart(cluster, client, run_id, at_step=0)
        summary = follow(client, run_id, tmp_path, show_progress=False)
        status = client.run(run_id).run
    assert summary["state"] == "completed", summary
    assert status.restores == 1 and status.rolled_back_steps > 0
    assert summary["final_test_accuracy"] >= 0.9, summary


def test_a_run_without_checkpoints_fails_with_the_reason_when_its_shard_comes_back_empty(cluster, tmp_path):
    with Client(cluster.address) as client:
        run_id = client.submit(_spec("asgd", 100_000, checkpoint_every_steps=0))
        _kill_and_restart(cluster, client, run_id, at_step=20)
        summary = follow(client, run_id, tmp_path, show_progress=False)
    assert summary["state"] == "failed", summary
    assert "restarted without the run's state" in summary["message"], summary["message"]
    assert "\n" not in summary["message"]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["sync", "asgd", "ssp", "wagma", "pseudosync"])
def test_each_scheme_survives_a_shard_kill_at_a_random_moment_and_reaches_its_accuracy(cluster, scheme, tmp_path):
    steps = 800  # wagma reaches 0.95-0.96 at 600 steps: too close to the target
    with Client(cluster.address) as client:
        run_id = client.submit(_spec(scheme, steps))
        at = random.Random().randint(CHECKPOINT_EVERY + 1, steps // 2)
        _kill_and_restart(cluster, client, run_id, at_step=at, shard=random.Random().randrange(2))
        summary = follow(client, run_id, tmp_path, show_progress=False)
        status = client.run(run_id).run
    went = [
        line.split("restarted; ", 1)[1]
        for line in _log(cluster).splitlines()
        if run_id in line and "restarted;" in line
    ]
    print(f"\n{scheme}: killed at step {at}: {'; '.join(went)}; accuracy {summary['final_test_accuracy']}")
    assert summary["state"] == "completed", summary
    assert status.restores == 1
    assert summary["final_test_accuracy"] >= 0.95, summary
    if scheme == "sync":
        assert status.rolled_back_steps <= 2 * CHECKPOINT_EVERY


@pytest.mark.slow
def test_a_cluster_stopped_mid_run_and_started_again_resumes_the_run_to_the_same_weights(tmp_path):
    """The whole local cluster stops (SIGTERM, workers first) in the middle of a sync run; a new
    one on the same state dir takes the run back, failed, and `gradps train --resume` takes it up
    from the newest step checkpointed on both shards: it ends with the weights of a run left
    alone, bit for bit."""
    state, steps = tmp_path / "state", 600
    with LocalCluster(shards=2, workers=2, state_dir=state, log_dir=tmp_path / "logs-1") as first:
        with Client(first.address) as client:
            alone = client.submit(_spec("sync", steps))
            assert follow(client, alone, tmp_path / "alone", show_progress=False)["state"] == "completed"
            expected = _exported(client, alone)
            stopped = client.submit(_spec("sync", steps))
            _wait_for_step(client, stopped, 100)
    with LocalCluster(shards=2, workers=2, state_dir=state, log_dir=tmp_path / "logs-2") as second:
        assert second.shard_ports == first.shard_ports  # where the run's placement names them
        with Client(second.address) as client:
            deadline = time.monotonic() + 60
            while (state_now := client.run(stopped).run.state) not in (cpb.RUN_STATE_FAILED, cpb.RUN_STATE_STOPPED):
                assert time.monotonic() < deadline, cpb.RunState.Name(state_now)
                time.sleep(0.1)
            resumed = subprocess.run(
                [sys.executable, "-m", "client.cli", "train", "--coordinator", second.address, "--resume", stopped]
                + ["--no-progress", "--out", str(tmp_path / "resumed")],
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert resumed.returncode == 0, resumed.stderr[-2000:]
            summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
            assert summary["state"] == "completed" and summary["steps"] == steps, summary
            got = _exported(client, stopped)
            with pytest.raises(GradpsError, match="only a failed or stopped run resumes"):
                client.resume(stopped)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    assert "resumed at step" in (tmp_path / "logs-2" / "coordinator.log").read_text()


@pytest.mark.parametrize("scheme", [pytest.param("pseudosync", marks=pytest.mark.slow), "wagma"])
def test_a_stopped_run_whose_model_is_on_its_workers_resumes(cluster, scheme, tmp_path):
    """pseudosync and wagma keep their models on their workers. pseudosync's rank 0 hands its
    replica in at every checkpoint step: a stopped run is taken up by new workers from the newest
    of them, with one replica on every worker to the end. wagma's new workers start from the
    consensus of the deposits in the checkpoint."""
    steps = 400
    with Client(cluster.address) as client:
        run_id = client.submit(_spec(scheme, steps))
        _wait_for_step(client, run_id, 100)
        client.stop(run_id)
        # At once: the same workers take it up while they still report the stop's errors, which
        # must not count for the resumed run.
        client.resume(run_id)
        summary = follow(client, run_id, tmp_path, show_progress=False)
        status = client.run(run_id).run
        listed = client.checkpoints(run_id)
    print(f"\n{scheme} stopped and resumed: accuracy {summary['final_test_accuracy']}")
    assert summary["state"] == "completed", summary["message"]
    done = [m for m in status.latest if m.done]
    assert sorted(m.rank for m in done) == [0, 1] and all(m.step == steps for m in done), done
    assert len({m.weights_digest for m in done}) == 1, done  # pseudosync's replica, wagma's global average
    assert summary["final_test_accuracy"] >= 0.9, f"{summary}\n{_story(cluster, run_id)}"
    if scheme == "pseudosync":  # its checkpoints are the steps its replica was handed in at
        assert all(c.step % CHECKPOINT_EVERY == 0 for c in listed.checkpoints) and listed.checkpoints
    assert "resumed at step" in _log(cluster)


def test_a_run_that_cannot_resume_says_why_in_one_line(cluster, tmp_path):
    with Client(cluster.address) as client:
        with pytest.raises(GradpsError, match="NOT_FOUND"):
            client.resume("no-such-run")
        completed = client.submit(_spec("wagma", CHECKPOINT_EVERY))
        assert follow(client, completed, tmp_path, show_progress=False)["state"] == "completed"
        with pytest.raises(GradpsError, match="only a failed or stopped run resumes") as refused:
            client.resume(completed)
        assert "\n" not in str(refused.value)
        assert client.run(completed).run.state == cpb.RUN_STATE_COMPLETED


@pytest.mark.parametrize(
    "scheme",
    [
        "sync",
        pytest.param("wagma", marks=pytest.mark.slow),
        pytest.param("pseudosync", marks=pytest.mark.slow),
        pytest.param("asgd", marks=pytest.mark.slow),
        pytest.param("ssp", marks=pytest.mark.slow),
    ],
)
def test_a_new_worker_takes_the_rank_of_a_killed_one_and_the_run_ends_with_every_rank(cluster, scheme, tmp_path):
    steps = 600 if scheme == "sync" else 800  # the asynchronous ones spread more in accuracy
    with Client(cluster.address) as client:
        # The new worker is up and idle before the run starts (on the two oldest): a run goes on
        # without the dead worker, and could end before a worker started after the kill is up.
        cluster.add_worker(len(cluster.workers))
        deadline = time.monotonic() + 60
        while len(client.cluster().workers) < 3:
            assert time.monotonic() < deadline, "the new worker never registered"
            time.sleep(0.1)
        run_id = client.submit(_spec(scheme, steps))
        _wait_for_step(client, run_id, 60)
        victim_id = client.run(run_id).run.workers[1]
        name = next(w.name for w in client.cluster().workers if w.worker_id == victim_id)
        victim = cluster.workers[int(name.rsplit("-", 1)[1])]
        victim.kill()
        victim.wait()
        summary = follow(client, run_id, tmp_path, show_progress=False)
        status = client.run(run_id).run
    print(
        f"\n{scheme}: worker {victim_id} killed near step 60, {status.joins} joined; "
        f"accuracy {summary['final_test_accuracy']}"
    )
    assert summary["state"] == "completed", summary
    assert summary["dead_workers"] == [victim_id]
    assert status.joins == 1 and victim_id not in status.workers and len(status.workers) == 2
    done = [m for m in status.latest if m.done]
    assert sorted(m.rank for m in done) == [0, 1] and all(m.step == steps for m in done), done
    assert summary["final_test_accuracy"] >= 0.85, summary  # a short run with a worker lost: a model, not the target
    if scheme == "pseudosync":  # the new worker took up the replica the others went back to
        assert status.rolled_back_steps > 0 and len({m.weights_digest for m in done}) == 1, done


@pytest.mark.parametrize(
    "scheme", [pytest.param("asgd", marks=pytest.mark.slow), "sync", pytest.param("pseudosync", marks=pytest.mark.slow)]
)
def test_gradps_checkpoint_has_every_shard_write_one_now(cluster, scheme, tmp_path):
    """asgd's shards each write one now; sync's and pseudosync's write the next cut, which rank 0
    declares when asked: the same step on both (pseudosync's with rank 0's replica handed in)."""
    with Client(cluster.address) as client:
        run_id = client.submit(_spec(scheme, 100_000, checkpoint_every_steps=0))
        _wait_for_step(client, run_id, 20)
        command = [sys.executable, "-m", "client.cli", "checkpoint", "--coordinator", cluster.address]
        done = subprocess.run([*command, run_id], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert len(lines) == 2 and all(" checkpoint 1 at step " in line for line in lines), lines
        steps = {line.split(" at step ")[1].split(",")[0] for line in lines}
        if scheme != "asgd":
            assert len(steps) == 1, lines
        unknown = subprocess.run([*command, "no-such-run"], capture_output=True, text=True, timeout=120)
        assert unknown.returncode != 0 and "NOT_FOUND" in unknown.stderr and "Traceback" not in unknown.stderr
        client.stop(run_id)
    folders = sorted(p.name for p in (tmp_path / "state").glob(f"shard-*/{run_id}/ckpt-*"))
    assert folders == ["ckpt-00000001", "ckpt-00000001"], folders


@pytest.mark.slow
@pytest.mark.parametrize("first", ["coordinator", "shard"])
def test_a_sync_run_goes_on_when_its_coordinator_and_a_shard_are_killed_together(cluster, first, tmp_path):
    """The coordinator and shard 1 killed with SIGKILL at once and started again (either first):
    the new coordinator takes the run back from its state dir, hears the restarted shard (a boot id
    it never saw) and has every shard go back to a common checkpoint; the run completes with every
    rank, and the runs of before are still listed."""
    steps = 600
    with Client(cluster.address) as client:
        earlier = client.submit(_spec("sync", CHECKPOINT_EVERY))
        assert follow(client, earlier, tmp_path / "earlier", show_progress=False)["state"] == "completed"
        run_id = client.submit(_spec("sync", steps))
        _wait_for_step(client, run_id, 50)
        killed_at = max(m.step for m in client.run(run_id).run.latest)
    # The shard first, the coordinator once the workers wait at it: a worker whose metrics report
    # is in flight when the coordinator dies gives up its run (README), which then ends without it.
    cluster.shards[1].kill()
    cluster.shards[1].wait()
    time.sleep(0.3)
    cluster.coordinator.kill()
    cluster.coordinator.wait()
    time.sleep(0.5)  # the workers find both gone
    if first == "coordinator":
        cluster.restart_coordinator()
        cluster.restart_shard(1)
    else:
        # A restarted shard registers before it writes its port file: start the coordinator meanwhile.
        shard = threading.Thread(target=cluster.restart_shard, args=(1,))
        shard.start()
        time.sleep(1.0)
        cluster.restart_coordinator()
        shard.join(timeout=60)
    with Client(cluster.address) as client:
        summary = follow(client, run_id, tmp_path / "run", show_progress=False)
        status = client.run(run_id).run
        listed = {r.run_id: r.state for r in client.runs()}
    print(
        f"\n{first} first: killed at step {killed_at}; {status.restores} restores, "
        f"{status.rolled_back_steps} steps rolled back; accuracy {summary['final_test_accuracy']}"
    )
    assert summary["state"] == "completed", summary
    assert status.restores == 1 and status.rolled_back_steps <= 2 * CHECKPOINT_EVERY, status
    done = [m for m in status.latest if m.done]
    assert sorted(m.rank for m in done) == [0, 1] and all(m.step == steps for m in done), done
    assert not status.dead_workers, status.dead_workers
    assert summary["final_test_accuracy"] >= 0.9, summary
    assert listed[earlier] == cpb.RUN_STATE_COMPLETED, listed
    assert "every shard went back to step" in _log(cluster)
