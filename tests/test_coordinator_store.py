"""A coordinator with a state dir remembers its runs: killed with SIGKILL and started again on the
same folder, it lists every run as it was (state, summary, events, placement), keeps pending runs
pending, goes on with a running run whose worker heartbeats again, fails (saying why) one whose
worker never comes back, and applies deletions and --keep-runs to what it stored. A state dir it
cannot use (not writable, corrupt, from a newer schema, in use) stops it at start-up with one line,
and is left as it was.

Real processes on loopback (a coordinator restarted on its port, one shard), a real SQLite file; the
test plays the workers with WorkerSession.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from click.testing import CliRunner
from google.protobuf.message import Message

from client.cli import cli
from client.sdk import run_spec
from gradps.channel import open_channel
from gradps.parameter_client import tensor_specs
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import coordinator_pb2_grpc
from gradps.worker_session import WorkerSession
from ps_server.coordinator import RESTARTED_MESSAGE
from ps_server.run_store import DB_NAME, SCHEMA_VERSION, RunStore, StoreError
from tests.services import Services, until

HEARTBEAT_TIMEOUT_S = 1.0
TENSORS = tensor_specs({"w": torch.zeros(64)})
STATES = cpb.RunState.Name


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Services]:
    c = Services(tmp_path, f"--heartbeat-timeout={HEARTBEAT_TIMEOUT_S}", f"--state-dir={tmp_path / 'state'}")
    try:
        c.start_coordinator("--keep-runs=10")
        c.add_shard()
        yield c
    finally:
        c.stop()


def _call(address: str, method: str, request: Message) -> Any:
    """One call, waiting for the coordinator to be reachable: channels to one address share gRPC's
    reconnect backoff, so a restarted coordinator may be reached a few seconds after it listens."""
    with open_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        answer = getattr(stub, method)(request, timeout=20, wait_for_ready=True)
        return list(answer) if method == "WatchRun" else answer


def _runs(address: str) -> dict[str, cpb.RunStatus]:
    return {r.run_id: r for r in _call(address, "ListRuns", cpb.ListRunsRequest()).runs}


def _submit(address: str, workers: int) -> str:
    spec = run_spec("asgd", workers=workers, steps=3, eval_every=0)
    return _call(address, "SubmitRun", cpb.SubmitRunRequest(spec=spec)).run_id


def _stop(address: str, run_id: str) -> None:
    _call(address, "StopRun", cpb.StopRunRequest(run_id=run_id))


def _events(address: str, run_id: str) -> list[cpb.WatchRunResponse]:
    return _call(address, "WatchRun", cpb.WatchRunRequest(run_id=run_id))


def _cli(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), env={"COLUMNS": "400", "GRADPS_COORDINATOR": None})
    return f"exit {result.exit_code}: {result.output}"


def _report(session: WorkerSession, run_id: str, step: int, **fields: Any) -> None:
    fields.setdefault("test_accuracy", -1.0)  # not evaluated
    session.report(run_id, cpb.Metrics(step=step, total_steps=3, samples=32 * step, **fields))


def _stored(state_dir: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(state_dir / DB_NAME) as db:
        return db.execute(sql).fetchall()


def _started(session: WorkerSession, run_id: str) -> None:
    """`session` is assigned `run_id`, places it and reports its first step."""
    assignment = session.wait_for_assignment(wait_s=10)
    assert assignment is not None and assignment.run_id == run_id, assignment
    session.placement(run_id, TENSORS, total_steps=3)
    _report(session, run_id, 1, loss=0.5)


def _assignment(session: WorkerSession) -> str:
    """The run `session` is assigned, asking until its channel reaches the restarted coordinator."""
    deadline = time.monotonic() + 20
    while True:
        try:
            assignment = session.wait_for_assignment(wait_s=10)
            return assignment.run_id if assignment else ""
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, e
            time.sleep(0.1)


@pytest.mark.slow
def test_a_killed_coordinator_takes_its_runs_back_from_its_state_dir(cluster: Services) -> None:
    address = cluster.address
    until(lambda: _call(address, "GetCluster", cpb.GetClusterRequest()).shards, 20, "no shard registered")
    sessions = [WorkerSession(address, name="a")]
    a = sessions[0]
    try:
        # A run that completes (reports, a placement), one stopped, one too big to start, three
        # running when the coordinator dies, and one waiting for their workers.
        completed = _submit(address, 1)
        assert (assigned := a.wait_for_assignment(wait_s=10)) is not None and assigned.run_id == completed
        placement = a.placement(completed, TENSORS, total_steps=3)
        _report(a, completed, 1, loss=0.75, test_accuracy=0.5)
        _report(a, completed, 3, loss=0.25, test_accuracy=0.875, done=True)
        stopped = _submit(address, 4096)
        _stop(address, stopped)
        too_big = _submit(address, 4096)
        going_on = _submit(address, 1)
        _started(a, going_on)
        sessions.append(c := WorkerSession(address, name="c"))
        given_up = _submit(address, 1)
        _started(c, given_up)
        sessions.append(d := WorkerSession(address, name="d"))
        orphaned = _submit(address, 1)
        _started(d, orphaned)
        later = _submit(address, 1)

        before = _runs(address)
        runs = (completed, stopped, too_big, going_on, given_up, orphaned, later)
        assert [STATES(before[r].state).removeprefix("RUN_STATE_") for r in runs] == [
            "COMPLETED",
            "STOPPED",
            "PENDING",
            "RUNNING",
            "RUNNING",
            "RUNNING",
            "PENDING",
        ]
        history = _events(address, completed)
        assert len(history) >= 4 and history[-1].run.state == cpb.RUN_STATE_COMPLETED
        stored = "SELECT steps, test_accuracy FROM runs WHERE run_id = ?"
        with sqlite3.connect(cluster.tmp / "state" / DB_NAME) as db:  # the columns for the sqlite3 shell
            assert db.execute(stored, (completed,)).fetchall() == [(3, 0.875)]
        a_id, c_id, d_id = a.worker_id, c.worker_id, d.worker_id

        cluster.kill_coordinator()
        d.close()  # dies while the coordinator is down: no one hears it again
        cluster.start_coordinator("--keep-runs=10")
        after = _runs(address)

        # Every run is listed again, oldest first; the ended ones exactly as they were, events and
        # placement included; pending ones still pending.
        assert list(after) == list(before)
        assert after[completed] == before[completed] and after[stopped] == before[stopped]
        assert [m.test_accuracy for m in after[completed].latest] == [0.875]
        assert _events(address, completed) == history
        assert _call(address, "GetRun", cpb.GetRunRequest(run_id=completed)).placement == placement
        assert after[too_big].state == after[later].state == cpb.RUN_STATE_PENDING
        assert after[too_big].spec == before[too_big].spec and after[too_big].pending_reason

        # The running runs keep their workers. One that asks for work again gave up its run, which
        # fails, saying why; free, it takes the run that waited since before the restart.
        assert _assignment(c) == later and c.worker_id == c_id
        failed = _runs(address)[given_up]
        assert failed.state == cpb.RUN_STATE_FAILED and failed.message == RESTARTED_MESSAGE, failed
        assert list(failed.dead_workers) == [c_id] and list(failed.latest) == list(before[given_up].latest)
        # One never heard again is dropped once its grace is over: its run fails the same way.
        until(lambda: _runs(address)[orphaned].state != cpb.RUN_STATE_RUNNING, 30, "the run never ended", 0.1)
        now = _runs(address)
        assert now[orphaned].state == cpb.RUN_STATE_FAILED and now[orphaned].message == RESTARTED_MESSAGE
        assert list(now[orphaned].dead_workers) == [d_id]
        # One that heartbeats goes on, and never had to rejoin.
        assert now[going_on].state == cpb.RUN_STATE_RUNNING and now[going_on].workers == [a_id]
        assert a.worker_id == a_id and not a.stopping
        workers = {w.worker_id: w for w in _call(address, "GetCluster", cpb.GetClusterRequest()).workers}
        assert (workers[a_id].name, workers[a_id].alive, workers[a_id].run_id) == ("a", True, going_on)
        _report(a, going_on, 3, loss=0.125, done=True)
        assert _runs(address)[going_on].state == cpb.RUN_STATE_COMPLETED
        table = _cli("runs", "--coordinator", address)
        assert table.startswith("exit 0") and "0.8750" in table and "coordinator restarted while" in table, table
        _stop(address, later)

        # Deleting and --keep-runs reach the stored runs: a deleted run stays deleted, and a
        # coordinator started with fewer runs to keep deletes the oldest ended ones.
        assert f"deleted {stopped}" in _cli("delete", stopped, "--coordinator", address)
        cluster.kill_coordinator()
        cluster.start_coordinator("--keep-runs=1")
        kept = _runs(address)
        assert list(kept) == [too_big, later], {r: STATES(s.state) for r, s in kept.items()}
        assert kept[later].state == cpb.RUN_STATE_STOPPED
    finally:
        for s in sessions:
            s.close()

    # The file itself: WAL, this schema version, only the runs kept, no events of the others.
    cluster.stop()
    assert _stored((cluster.tmp / "state"), "PRAGMA journal_mode") == [("wal",)]
    assert _stored((cluster.tmp / "state"), "SELECT version FROM schema_version") == [(SCHEMA_VERSION,)]
    assert _stored((cluster.tmp / "state"), "SELECT run_id, state FROM runs ORDER BY seq") == [
        (too_big, "pending"),
        (later, "stopped"),
    ]
    assert {r for (r,) in _stored((cluster.tmp / "state"), "SELECT DISTINCT run_id FROM events")} == {too_big, later}


# ---- state dirs it cannot use --------------------------------------------------------------------


def _corrupt(state_dir: Path) -> None:
    state_dir.mkdir()
    (state_dir / DB_NAME).write_bytes(b"not a database, " * 512)


def _newer(state_dir: Path) -> None:
    state_dir.mkdir()
    with sqlite3.connect(state_dir / DB_NAME) as db:
        db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        db.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION + 1,))
        db.execute("CREATE TABLE runs_of_the_future (x)")


def _foreign(state_dir: Path) -> None:
    state_dir.mkdir()
    with sqlite3.connect(state_dir / DB_NAME) as db:
        db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY)")


def _under_a_file(state_dir: Path) -> None:
    state_dir.parent.write_text("x")


def _read_only(state_dir: Path) -> None:
    state_dir.mkdir(mode=0o500)


# name: (make it, the folder to give below the case's own, words of the error)
_BAD_STATE_DIRS: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "corrupt database": (_corrupt, "state", f"{DB_NAME} is not a usable database (file is not a database)"),
    "newer schema": (_newer, "state", f"schema version {SCHEMA_VERSION + 1}, from a newer gradps"),
    "another program's database": (_foreign, "state", "no schema version: not a gradps coordinator's database"),
    "a file on the path": (_under_a_file, "a-file/state", "cannot create it: Not a directory"),
}
if os.geteuid() != 0:  # root writes into a read-only folder
    _BAD_STATE_DIRS["read-only folder"] = (_read_only, "state", "cannot write in it: Permission denied")


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())} if folder.is_dir() else {}


@pytest.mark.parametrize("case", list(_BAD_STATE_DIRS))
def test_a_state_dir_it_cannot_use_is_refused_and_left_as_it_was(tmp_path: Path, case: str) -> None:
    make, given, words = _BAD_STATE_DIRS[case]
    state_dir = tmp_path / given
    make(state_dir)
    files = _files(state_dir)
    with pytest.raises(StoreError) as refused:
        RunStore.open(state_dir)
    assert words in str(refused.value) and "\n" not in str(refused.value)
    assert _files(state_dir) == files, "the refused state dir changed"


def _refusing(state_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ps_server.coordinator", "--port=0", f"--state-dir={state_dir}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _refusal(state_dir: Path, process: subprocess.Popen) -> str:
    """The coordinator on `state_dir` exited at once with one line; returns the line."""
    _, stderr = process.communicate(timeout=60)
    lines = stderr.strip().splitlines()
    assert process.returncode == 1 and len(lines) == 1 and "Traceback" not in stderr, (process.returncode, stderr)
    assert lines[0].startswith(f"Error: --state-dir {state_dir}: "), lines
    return lines[0]


def test_the_coordinator_refuses_a_state_dir_it_cannot_use_in_one_line(tmp_path: Path) -> None:
    """A corrupt database, and a folder that another holds (here this test's own store), both at
    once: a coordinator takes seconds to start."""
    corrupt, held = tmp_path / "corrupt", tmp_path / "held"
    _corrupt(corrupt)
    holder = RunStore.open(held)
    try:
        processes = {corrupt: _refusing(corrupt), held: _refusing(held)}
        assert "is not a usable database (file is not a database)" in _refusal(corrupt, processes[corrupt])
        assert f"another coordinator (pid {os.getpid()}) uses it" in _refusal(held, processes[held])
    finally:
        holder.close()
    RunStore.open(held).close()  # free once its holder closed it


def test_a_coordinator_without_a_state_dir_writes_nothing(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    env = {k: v for k, v in os.environ.items() if k != "GRADPS_STATE_DIR"}
    args = [sys.executable, "-m", "ps_server.coordinator", "--port=0", f"--port-file={port_file}"]
    coordinator = subprocess.Popen(args, cwd=tmp_path, env=env, stderr=subprocess.DEVNULL)
    try:
        until(lambda: port_file.exists() or coordinator.poll() is not None, 60, "no port file")
        address = f"127.0.0.1:{port_file.read_text()}"
        run_id = _submit(address, 4096)
        assert _runs(address)[run_id].state == cpb.RUN_STATE_PENDING
    finally:
        coordinator.terminate()
        coordinator.wait(timeout=60)  # a SIGTERM shutdown on a busy host
    assert sorted(p.name for p in tmp_path.iterdir()) == ["port"]
