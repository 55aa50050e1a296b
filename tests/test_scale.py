"""`gradps scale RUN --workers N` on a real local cluster: a running run trains with fewer of its
ranks (the highest ranks' workers go back to the idle pool) and then with all of them again (idle
workers take the empty ranks), and ends with every rank done. Bad requests are refused in one
line and change nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner

from client.cli import cli
from client.local_cluster import LocalCluster
from client.report import follow
from client.sdk import Client
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import run_pb2


def _spec(scheme: str, steps: int, workers: int = 3) -> run_pb2.RunSpec:
    return run_pb2.RunSpec(
        scheme=scheme,
        workers=workers,
        batch_size=32,
        steps=steps,
        eval_every=0,
        seed=0,
        optimizer=run_pb2.OptimizerSpec(name="sgd", lr=0.2),
    )


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), env={"COLUMNS": "400", "GRADPS_COORDINATOR": None})
    return result.exit_code, result.output


def _until(what: str, ready, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _step(client: Client, run_id: str) -> int:
    return max((m.step for m in client.run(run_id).run.latest), default=0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    logs = tmp_path_factory.mktemp("scale-logs")
    with LocalCluster(shards=1, workers=3, log_dir=logs, heartbeat_timeout_s=2.0) as c:
        yield c


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["sync", "wagma"])
def test_a_run_scaled_down_and_up_again_ends_with_every_rank(cluster, scheme, tmp_path: Path):
    steps = 3000
    with Client(cluster.address) as client:
        run_id = client.submit(_spec(scheme, steps))
        _until("the run never reached step 50", lambda: _step(client, run_id) >= 50)
        workers = list(client.run(run_id).run.workers)
        code, output = _cli("scale", run_id, "--workers", "1", "--coordinator", cluster.address)
        assert code == 0, output
        assert output.strip() == f"run {run_id}: scaled to 1 of 3 ranks; workers {workers[1]}, {workers[2]} left it"
        # They go back to the idle pool, and the run goes on with rank 0 alone.
        _until(
            "the released workers never became idle",
            lambda: all(not w.run_id for w in client.cluster().workers if w.worker_id in workers[1:]),
        )
        at = _step(client, run_id)
        _until("the run stopped going on with one worker", lambda: _step(client, run_id) >= at + 20)
        status = client.run(run_id).run
        assert status.state == cpb.RUN_STATE_RUNNING and status.scaled_to == 1 and not status.dead_workers
        answer = client.scale(run_id, 3)
        assert list(answer.released) == [] and answer.run.scaled_to == 3
        summary = follow(client, run_id, tmp_path, show_progress=False)
        status = client.run(run_id).run
    assert summary["state"] == "completed", summary
    assert status.joins == 2 and not status.dead_workers
    done = [m for m in status.latest if m.done]
    assert sorted(m.rank for m in done) == [0, 1, 2] and all(m.step == steps for m in done), done
    assert summary["final_test_accuracy"] >= 0.9, summary


def test_a_bad_scale_is_refused_in_one_line_and_changes_nothing(cluster, tmp_path: Path):
    with Client(cluster.address) as client:
        run_id = client.submit(_spec("sync", 100_000, workers=2))
        _until("the run never started", lambda: _step(client, run_id) >= 1)
        before = client.run(run_id).run
        for workers, code, message in (
            (3, grpc.StatusCode.INVALID_ARGUMENT, "has 2 ranks: it scales to 1 to 2 workers"),
            (0, grpc.StatusCode.INVALID_ARGUMENT, "has 2 ranks"),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                client._stub.ScaleRun(cpb.ScaleRunRequest(run_id=run_id, workers=workers))
            assert refused.value.code() == code and message in refused.value.details()
            assert "\n" not in refused.value.details()
        with pytest.raises(grpc.RpcError) as refused:
            client._stub.ScaleRun(cpb.ScaleRunRequest(run_id="no-such-run", workers=1))
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        after = client.run(run_id).run
        assert after.scaled_to == before.scaled_to == 0 and list(after.workers) == list(before.workers)
        client.stop(run_id)
        code, output = _cli("scale", run_id, "--workers", "1", "--coordinator", cluster.address)
        assert code != 0 and "only a running run scales" in output and len(output.strip().splitlines()) == 1, output
