"""A shard killed with SIGKILL and started again with the same --shard-id and --state-dir serves its
runs from their latest complete checkpoints: the same values, versions, optimizer state and
exactly-once keys, bit-exact. Real processes (tests/services.py), the test as the run's worker."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from gradps import wire
from gradps.channel import open_channel
from gradps.errors import RolledBack
from gradps.parameter_client import ParameterClient
from gradps.v1 import run_pb2, shard_pb2, shard_pb2_grpc
from ps_server.checkpointing import OPEN_RUN
from tests.joined_run import NONE, join_run, leave
from tests.services import Services, until

SHARD_ID = "shard-a"
TENSORS = {"w": torch.randn(64, 32, generator=torch.Generator().manual_seed(0)), "b": torch.zeros(32)}


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    s = Services(tmp_path, "--heartbeat-timeout=2")
    try:
        s.start_coordinator()
        s.add_shard(f"--state-dir={tmp_path / 'state'}", f"--shard-id={SHARD_ID}")
        yield s
    finally:
        s.stop()


def _grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(t.shape, generator=g) for n, t in TENSORS.items()}


def _served(address: str, run_id: str, epoch: int = 0) -> dict[tuple[str, int], tuple[int, bytes]]:
    """What the shard serves for the run (to a call of restore epoch `epoch`): (version, value
    bytes) by part."""
    parts = {}
    with open_channel(address) as channel:
        stub = shard_pb2_grpc.ShardServiceStub(channel)
        pull = shard_pb2.PullRequest(run_id=run_id, worker_id=0, codec=NONE, restore_epoch=epoch)
        for response in stub.Pull(pull, timeout=20, wait_for_ready=True):
            for p in wire.parts_of(response):
                parts[(p.name, p.index)] = (p.version, bytes(p.payload))
    return parts


def _restored(address: str, run_id: str) -> shard_pb2.ListCheckpointsResponse:
    """The run's checkpoints on a restarted shard, once the coordinator told it where to go on from."""
    listing = shard_pb2.ListCheckpointsRequest(run_id=run_id)
    until(lambda: not _shard_call(address, "ListCheckpoints", listing).restored, 30, "not restored")  # type: ignore[attr-defined]
    return _shard_call(address, "ListCheckpoints", listing)  # type: ignore[return-value]


def _shard_call(address: str, method: str, request: object) -> object:
    with open_channel(address) as channel:
        return getattr(shard_pb2_grpc.ShardServiceStub(channel), method)(request, timeout=30, wait_for_ready=True)


def _checkpoints(tmp_path: Path, run_id: str) -> list[str]:
    folder = tmp_path / "state" / f"shard-{SHARD_ID}" / run_id
    return sorted(p.name for p in folder.glob("ckpt-*")) if folder.is_dir() else []


def _client(placement: shard_pb2.Placement, run_id: str, worker_id: int) -> ParameterClient:
    return ParameterClient(placement, run_id, worker_id, NONE, NONE, timeout_s=20, transport="grpc")


def test_a_sync_run_restarted_from_its_checkpoint_serves_the_same_values_and_versions(services, tmp_path):
    spec = run_pb2.RunSpec(
        scheme="sync",
        workers=1,
        steps=100,
        optimizer=run_pb2.OptimizerSpec(name="sgd", lr=0.05, momentum=0.9),
        checkpoint_every_steps=4,
    )
    run_id, sessions, clients, placement = join_run(services.address, spec, TENSORS, transport="grpc")
    (address,) = placement.shards
    try:
        client, worker = clients[0], sessions[0].worker_id
        client.register(TENSORS)
        weights = {n: torch.zeros_like(t) for n, t in TENSORS.items()}
        after: dict[int, dict] = {}
        for step in range(6):
            client.push_pull(_grads(step), step, weights, min_version=step + 1)
            after[step + 1] = {n: t.clone() for n, t in weights.items()}
            if step + 1 == 4:
                at_checkpoint = _served(address, run_id)
        # Checkpoint 1 was due at step 4 (sync: steps completed); steps 4 and 5 came after it.
        until(lambda: _checkpoints(tmp_path, run_id) == ["ckpt-00000001"], 30, "no checkpoint at step 4")
        assert {v for v, _ in _served(address, run_id).values()} == {6}
        client.close()

        services.kill_shard(0)
        services.restart_shard(0)
        # The coordinator hears a new shard process and sends the run back to its newest common
        # checkpoint (the only one here: step 4) under restore epoch 1.
        listed = _restored(address, run_id)
        assert (listed.restore_epoch, listed.step, [c.step for c in listed.checkpoints]) == (1, 4, [4])  # type: ignore[attr-defined]
        served = _served(address, run_id, epoch=1)
        assert served == at_checkpoint  # values and versions, bit-exact
        assert {v for v, _ in served.values()} == {4}
        stats = _shard_call(address, "GetStats", shard_pb2.GetStatsRequest(run_id=run_id))
        assert stats.min_version == 4 and stats.pushes == 4  # type: ignore[attr-defined]

        # A call of the old epoch is told where to go back to.
        client = clients[0] = _client(placement, run_id, worker)
        with pytest.raises(RolledBack) as told:
            client.push(_grads(6), 6)
        assert (told.value.epoch, told.value.step) == (1, 4)

        # The worker goes on from step 4: the same weights as before the kill, bit for bit (the
        # momentum buffer came back too); a push of step 3, applied before the checkpoint, is
        # answered applied and not applied again.
        client.restore_epoch = 1
        client.push(_grads(3), 3)
        assert {v for v, _ in _served(address, run_id, epoch=1).values()} == {4}
        for step in (4, 5):
            client.push_pull(_grads(step), step, weights, min_version=step + 1)
            for name in TENSORS:
                assert torch.equal(weights[name], after[step + 1][name]), (step, name)
    finally:
        leave(sessions, clients)


def test_checkpoint_run_now_survives_a_kill_and_open_run_again_keeps_it(services, tmp_path):
    spec = run_pb2.RunSpec(scheme="asgd", workers=1, steps=100, optimizer=run_pb2.OptimizerSpec(name="adam", lr=0.01))
    run_id, sessions, clients, placement = join_run(services.address, spec, TENSORS, transport="grpc")
    (address,) = placement.shards
    try:
        client, worker = clients[0], sessions[0].worker_id
        client.register(TENSORS)
        weights = {n: torch.zeros_like(t) for n, t in TENSORS.items()}
        answers = []
        for step in range(5):
            client.pull(weights)
            client.push(_grads(step), step)
            if step in (2, 4):
                answers.append(_shard_call(address, "CheckpointRun", shard_pb2.CheckpointRunRequest(run_id=run_id)))
                if step == 2:
                    at_first = _served(address, run_id)
        first, second = answers
        assert (first.sequence, first.step, first.min_version, first.max_version) == (1, 3, 3, 3)  # type: ignore[attr-defined]
        assert (second.sequence, second.step, second.min_version) == (2, 5, 5)  # type: ignore[attr-defined]
        assert second.bytes > 3 * 4 * sum(t.numel() for t in TENSORS.values())  # type: ignore[attr-defined]
        assert _checkpoints(tmp_path, run_id) == ["ckpt-00000001", "ckpt-00000002"]
        client.close()

        # Killed; its newest checkpoint damaged meanwhile: the shard serves the one before, and
        # says why in one line.
        services.kill_shard(0)
        newest = next((tmp_path / "state" / f"shard-{SHARD_ID}" / run_id / "ckpt-00000002").glob("*.safetensors"))
        data = bytearray(newest.read_bytes())
        data[-3] ^= 1
        newest.write_bytes(bytes(data))
        services.restart_shard(0)
        assert _restored(address, run_id).restore_epoch == 0  # asgd: it goes on from its own, no epoch
        assert _served(address, run_id) == at_first
        log = (tmp_path / "shard-0.log").read_text()
        refused = [line for line in log.splitlines() if "refused" in line]
        assert len(refused) == 1 and str(newest) in refused[0] and "SHA-256 mismatch" in refused[0], refused

        # The coordinator's OpenRun for the run, made again, keeps the restored state; another
        # OpenRun for it is refused and changes nothing.
        request = shard_pb2.OpenRunRequest()
        request.ParseFromString((newest.parent.parent / OPEN_RUN).read_bytes())
        assert request.run_id == run_id and list(request.workers) == [worker]
        _shard_call(address, "OpenRun", request)
        assert _served(address, run_id) == at_first
        request.total_steps += 1
        with pytest.raises(grpc.RpcError) as refused_open:
            _shard_call(address, "OpenRun", request)
        assert refused_open.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert _served(address, run_id) == at_first

        # Bad requests: a status and one line, nothing changed.
        with pytest.raises(grpc.RpcError) as unknown:
            _shard_call(address, "CheckpointRun", shard_pb2.CheckpointRunRequest(run_id="no-such-run"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND and "\n" not in (unknown.value.details() or "")

        # It goes on from there: a push applies on the restored Adam state, and a new checkpoint
        # takes the next sequence number.
        client = clients[0] = _client(placement, run_id, worker)
        client.pull(weights)
        client.push(_grads(3), 3)
        assert {v for v, _ in _served(address, run_id).values()} == {4}
        third = _shard_call(address, "CheckpointRun", shard_pb2.CheckpointRunRequest(run_id=run_id))
        assert third.sequence == 3 and third.min_version == 4  # type: ignore[attr-defined]
    finally:
        leave(sessions, clients)


def test_a_shard_without_a_state_dir_refuses_checkpoint_run(tmp_path):
    s = Services(tmp_path, "--heartbeat-timeout=2")
    try:
        s.start_coordinator()
        s.add_shard()
        spec = run_pb2.RunSpec(scheme="asgd", workers=1, steps=10)
        run_id, sessions, clients, placement = join_run(s.address, spec, TENSORS, transport="grpc")
        try:
            with pytest.raises(grpc.RpcError) as refused:
                _shard_call(placement.shards[0], "CheckpointRun", shard_pb2.CheckpointRunRequest(run_id=run_id))
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "--state-dir" in (refused.value.details() or "")
        finally:
            leave(sessions, clients)
    finally:
        s.stop()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--port=0"], "--state-dir needs a --shard-id"),
        (["--port=0", "--shard-id=a/b"], "--shard-id: shard id 'a/b'"),
    ],
)
def test_a_state_dir_without_a_usable_shard_id_stops_the_shard_at_start_up(tmp_path, flags, words):
    command = [sys.executable, "-m", "ps_server.shard", f"--state-dir={tmp_path}", "--coordinator=127.0.0.1:1"]
    done = subprocess.run([*command, *flags], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and not (tmp_path / "shard-a").exists()


def test_a_shard_stopped_with_sigterm_finishes_the_checkpoint_it_is_writing(services, tmp_path):
    big = {"w": torch.ones(16 << 20)}  # 64 MiB: its checkpoint takes a while to write and fsync
    spec = run_pb2.RunSpec(scheme="asgd", workers=1, steps=10)
    run_id, sessions, clients, placement = join_run(services.address, spec, big, transport="grpc")
    (address,) = placement.shards
    folder = tmp_path / "state" / f"shard-{SHARD_ID}" / run_id
    try:
        clients[0].register(big)
        with open_channel(address) as channel:
            asked = shard_pb2_grpc.ShardServiceStub(channel).CheckpointRun.future(
                shard_pb2.CheckpointRunRequest(run_id=run_id), timeout=60
            )
            # Being written (or, on a fast disk, written already: then this run proves less).
            written = (folder / ".ckpt-00000001.tmp", folder / "ckpt-00000001")
            until(lambda: any(path.exists() for path in written), 30, "no checkpoint being written")
            asked.cancel()  # no call in flight: the server stops at once, the write goes on
        services.shards[0].terminate()
        assert services.shards[0].wait(timeout=30) == 0
    finally:
        leave(sessions, clients)
    assert _checkpoints(tmp_path, run_id) == ["ckpt-00000001"]
    assert not (folder / ".ckpt-00000001.tmp").exists()
    assert "checkpoint 1 at step 0" in (tmp_path / "shard-0.log").read_text()
