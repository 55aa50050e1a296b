"""`gradps checkpoints RUN` and `gradps export RUN --checkpoint STEP` on a real local cluster (two
shards with a state dir, two workers): the steps every shard checkpointed are listed, and a
checkpoint exports exactly the weights the same run had at that step, also after a shard
restarted from its state dir. A step some shard has no checkpoint of, a damaged file and an
unknown run are refused with one line, and change nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from client.cli import cli
from client.local_cluster import LocalCluster
from client.report import follow
from client.sdk import Client, GradpsError
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import run_pb2
from ps_server.checkpoint import MANIFEST
from ps_server.checkpointing import run_folder_name
from tests.digits_run import digits_spec

EVERY = 10


def _spec(steps: int, every: int = EVERY, scheme: str = "sync") -> run_pb2.RunSpec:
    return digits_spec(scheme, steps, checkpoint_every_steps=every)


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), env={"COLUMNS": "400", "GRADPS_COORDINATOR": None})
    return result.exit_code, result.output


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    folder = tmp_path_factory.mktemp("export-checkpoint")
    with LocalCluster(shards=2, workers=2, state_dir=folder / "state", heartbeat_timeout_s=2.0) as c:
        yield c


@pytest.fixture(scope="module")
def runs(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A run of 20 steps checkpointed every 10, and the same run stopped at 10 (no checkpoints)."""
    out = tmp_path_factory.mktemp("runs")
    ids = {}
    with Client(cluster.address) as client:
        for name, spec in (("twenty", _spec(2 * EVERY)), ("ten", _spec(EVERY, every=0))):
            ids[name] = client.submit(spec)
            assert follow(client, ids[name], out / name, show_progress=False)["state"] == "completed"
    return ids


def _checkpoint_file(cluster: LocalCluster, run_id: str, shard: int, step: int) -> Path:
    """The first safetensors file of shard `shard`'s checkpoint of the run at `step`."""
    assert cluster.state_dir is not None
    folder = cluster.state_dir / f"shard-local-{shard}" / run_folder_name(run_id)
    for ckpt in sorted(folder.glob("ckpt-*")):
        if json.loads((ckpt / MANIFEST).read_text())["step"] == step:
            return ckpt / "tensors-00000.safetensors"
    raise AssertionError(f"no checkpoint at step {step} in {folder}")


def test_the_steps_every_shard_checkpointed_are_listed(cluster, runs):
    with Client(cluster.address) as client:
        listed = client.checkpoints(runs["twenty"])
        shards = sorted(client.cluster().shards)
    assert [c.step for c in listed.checkpoints] == [EVERY, 2 * EVERY]
    for c in listed.checkpoints:
        assert sorted(s.shard for s in c.shards) == shards
        assert c.bytes == sum(s.bytes for s in c.shards) and all(s.bytes > 0 for s in c.shards)
    assert sorted(s.shard for s in listed.shards) == shards
    code, output = _cli("checkpoints", runs["twenty"], "--coordinator", cluster.address)
    assert code == 0, output
    lines = output.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"step {EVERY}", f"step {2 * EVERY}"], output
    assert all(shard in lines[0] for shard in shards) and " MB on " in lines[0]
    code, output = _cli("checkpoints", runs["twenty"], "--coordinator", cluster.address, "--json")
    assert code == 0, output
    shown = json.loads(output)
    assert [c["step"] for c in shown["checkpoints"]] == [str(EVERY), str(2 * EVERY)]  # uint64: strings
    # A run without checkpoints has no step to list.
    code, output = _cli("checkpoints", runs["ten"], "--coordinator", cluster.address)
    assert code == 0 and "no step checkpointed on every shard" in output, output


def test_a_checkpoint_exports_the_weights_the_run_had_at_its_step(cluster, runs, tmp_path):
    with Client(cluster.address) as client:
        at_ten = client.export_state_dict(runs["ten"])  # the same run, stopped at step 10
        at_twenty = client.export_state_dict(runs["twenty"])
    out = tmp_path / "at-10.pt"
    code, output = _cli(
        "export", runs["twenty"], "--checkpoint", str(EVERY), "--out", str(out), "--coordinator", cluster.address
    )
    assert code == 0 and output.startswith(f"wrote {out}"), output
    exported = torch.load(out, weights_only=True)
    _assert_equal(exported, at_ten)
    assert any(not torch.equal(exported[n], at_twenty[n]) for n in exported)  # 10 steps apart
    with Client(cluster.address) as client:
        _assert_equal(client.export_state_dict(runs["twenty"], checkpoint_step=2 * EVERY), at_twenty)


def test_a_missing_step_or_unknown_run_is_refused_in_one_line_and_nothing_is_written(cluster, runs, tmp_path):
    out = tmp_path / "never.pt"
    with Client(cluster.address) as client:
        before = client.run(runs["twenty"]).run
        shards = client.cluster().shards
    code, output = _cli(
        "export", runs["twenty"], "--checkpoint", "15", "--out", str(out), "--coordinator", cluster.address
    )
    assert code != 0 and len(output.strip().splitlines()) == 1, output
    assert "NOT_FOUND" in output and f"at step 15 (its steps: {EVERY}, {2 * EVERY})" in output, output
    assert any(f"shard {s} " in output for s in shards), output
    assert not out.exists()
    code, output = _cli(
        "export", "no-such-run", "--checkpoint", "10", "--out", str(out), "--coordinator", cluster.address
    )
    assert code != 0 and "NOT_FOUND" in output and len(output.strip().splitlines()) == 1, output
    code, output = _cli("checkpoints", "no-such-run", "--coordinator", cluster.address)
    assert code != 0 and "NOT_FOUND" in output and len(output.strip().splitlines()) == 1, output
    assert not out.exists()
    with Client(cluster.address) as client:
        assert client.run(runs["twenty"]).run == before
        assert [c.step for c in client.checkpoints(runs["twenty"]).checkpoints] == [EVERY, 2 * EVERY]


def test_a_damaged_checkpoint_is_refused_naming_its_file(cluster, runs):
    path = _checkpoint_file(cluster, runs["twenty"], shard=0, step=EVERY)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle] ^= 0xFF
    original = path.read_bytes()
    path.write_bytes(bytes(data))
    try:
        with Client(cluster.address) as client, pytest.raises(GradpsError) as refused:
            client.export_state_dict(runs["twenty"], checkpoint_step=EVERY)
    finally:
        path.write_bytes(original)
    message = str(refused.value)
    assert "DATA_LOSS" in message and str(path) in message and "SHA-256" in message, message
    assert "\n" not in message
    with Client(cluster.address) as client:  # whole again: it exports
        client.export_state_dict(runs["twenty"], checkpoint_step=EVERY)


def test_a_restarted_shard_exports_the_checkpoints_of_an_ended_run(cluster, runs):
    with Client(cluster.address) as client:
        at_ten = client.export_state_dict(runs["ten"])
        cluster.shards[1].kill()
        cluster.shards[1].wait()
        cluster.restart_shard(1)
        assert client.run(runs["twenty"]).run.state == cpb.RUN_STATE_COMPLETED
        assert [c.step for c in client.checkpoints(runs["twenty"]).checkpoints] == [EVERY, 2 * EVERY]
        _assert_equal(client.export_state_dict(runs["twenty"], checkpoint_step=EVERY), at_ten)


def test_a_wagma_checkpoint_is_refused_its_model_is_on_the_workers(cluster, tmp_path):
    with Client(cluster.address) as client:
        run_id = client.submit(_spec(2 * EVERY, scheme="wagma"))
        assert follow(client, run_id, tmp_path, show_progress=False)["state"] == "completed"
        assert [c.step for c in client.checkpoints(run_id).checkpoints]  # the shards' own state is kept
        with pytest.raises(GradpsError, match="FAILED_PRECONDITION.*keeps its model on its workers") as refused:
            client.export_state_dict(run_id, checkpoint_step=EVERY)
    assert "\n" not in str(refused.value)
