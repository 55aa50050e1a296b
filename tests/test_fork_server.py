"""The local cluster's fork server: shards and workers forked as `python -m` would start them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from client.fork_server import ForkedService, start_service

# A coordinator nobody serves: a worker or a shard pointed at it retries for a minute.
_NOWHERE = "--coordinator=127.0.0.1:1"


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", **extra)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_forked_service_has_its_own_arguments_environment_folder_and_log(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    # The environment: --device from GRADPS_DEVICE, refused as click refuses it.
    refused = start_service("gpu_worker.service", [_NOWHERE], _env(GRADPS_DEVICE="bogus"), tmp_path / "worker.log")
    assert isinstance(refused, ForkedService)
    assert refused.wait(timeout=30) == 2
    log = (tmp_path / "worker.log").read_text()
    assert log.startswith("Usage: python -m gpu_worker.service [OPTIONS]"), log
    assert "Error: Invalid value for '--device' (env var: 'GRADPS_DEVICE'): 'bogus'" in log, log
    # The folder: a relative --state-dir is the service's working folder's.
    shard = start_service(
        "ps_server.shard", [_NOWHERE, "--state-dir=state", "--shard-id=one"], _env(), tmp_path / "shard.log"
    )
    try:
        deadline = 30.0
        while not (tmp_path / "state" / "shard-one").is_dir():
            assert shard.poll() is None, (tmp_path / "shard.log").read_text()
            with pytest.raises(subprocess.TimeoutExpired):
                shard.wait(timeout=0.2)
            deadline -= 0.2
            assert deadline > 0, "the shard made no checkpoint folder under its working folder"
    finally:
        shard.kill()
    assert shard.wait(timeout=30) == -signal.SIGKILL


def test_a_forked_service_leads_its_own_session_is_named_as_its_command_and_its_death_is_reported(tmp_path) -> None:
    worker = start_service("gpu_worker.service", [_NOWHERE], _env(), tmp_path / "worker.log")
    try:
        assert os.getsid(worker.pid) == worker.pid  # a Ctrl-C at the client's terminal misses it
        log = tmp_path / "worker.log"
        while "retrying" not in log.read_text():  # up, and listening for signals
            with pytest.raises(subprocess.TimeoutExpired):
                worker.wait(timeout=0.2)
        # ps and pgrep -f see the command that would have started it, not the fork server's.
        command = Path(f"/proc/{worker.pid}/cmdline").read_bytes().rstrip(b"\0").decode()
        assert command == f"{sys.executable} -m gpu_worker.service {_NOWHERE}", command
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 1  # its own handler's exit
        assert worker.returncode == 1
        assert log.read_text().splitlines()[-1] == "Error: stopped before joining the coordinator at 127.0.0.1:1"
        worker.kill()  # once it exited, a signal goes nowhere
    finally:
        worker.kill()


def test_other_services_start_as_processes_of_their_own(tmp_path) -> None:
    coordinator = start_service("ps_server.coordinator", ["--port=-1"], _env(), tmp_path / "coordinator.log")
    assert isinstance(coordinator, subprocess.Popen)
    assert coordinator.wait(timeout=30) == 2


def test_services_whose_interpreter_would_start_differently_get_a_fork_server_of_their_own(tmp_path) -> None:
    # PYTHONPATH is read when an interpreter starts: a fork of one started without it would lack it.
    started = [
        start_service("gpu_worker.service", [_NOWHERE], env, tmp_path / f"worker-{i}.log")
        for i, env in enumerate([_env(), _env(), _env(PYTHONPATH=str(tmp_path))])
    ]
    try:
        parents = [_parent(p.pid) for p in started]
        assert parents[0] == parents[1] != parents[2], parents
        assert os.getpid() not in parents
    finally:
        for p in started:
            p.kill()


def test_a_service_whose_fork_server_was_killed_is_still_waited_for(tmp_path) -> None:
    env = _env(PYTHONPATH=str(tmp_path))  # a fork server of this test's own
    worker = start_service("gpu_worker.service", [_NOWHERE], env, tmp_path / "worker.log")
    os.kill(_parent(worker.pid), signal.SIGKILL)
    worker.kill()
    assert worker.wait(timeout=30) == 255  # its status went with the server
    again = start_service("gpu_worker.service", [_NOWHERE], env, tmp_path / "again.log")
    try:
        assert isinstance(again, ForkedService) and again.poll() is None
    finally:
        again.kill()
    assert again.wait(timeout=30) == -signal.SIGKILL
