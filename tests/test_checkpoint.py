"""Shard checkpoints on real files (ps_server/checkpoint.py, checkpointing.py): what is written
reads back bit-exact for every scheme, is a real safetensors file, and a checkpoint that is cut
short, truncated, bit-flipped, missing or another run's is refused, with one line naming the
file, and the previous one used. A process killed with SIGKILL while writing one never leaves a
checkpoint that loads."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from gradps.placement import place
from gradps.v1 import run_pb2, shard_pb2, tensor_pb2
from ps_server import checkpoint, direct_io
from ps_server.checkpoint import CheckpointError
from ps_server.checkpointing import OPEN_RUN, RunCheckpoints, ShardCheckpoints
from ps_server.run_state import Push, RunState
from ps_server.schemes import ShardRule, open_run
from tests.services import until

SHARD_ID = "s0"
WORKERS = [3, 5]
# A model of three tensors, cut into 1 KiB parts (several parts per tensor), all on shard 0.
SHAPES = {"w": (40, 30), "b": (30,), "v": (700,)}
_PART_BYTES = 1024


def _request(run_id: str, scheme: str, optimizer: run_pb2.OptimizerSpec, **params: object) -> shard_pb2.OpenRunRequest:
    tensors = [tensor_pb2.TensorSpec(name=n, shape=list(s), dtype=tensor_pb2.DTYPE_FLOAT32) for n, s in SHAPES.items()]
    placement = place(tensors, ["127.0.0.1:1"], _PART_BYTES)
    spec = run_pb2.RunSpec(
        scheme=scheme,
        workers=len(WORKERS),
        steps=50,
        optimizer=optimizer,
        scheme_params=run_pb2.SchemeParams(**params),  # type: ignore[arg-type]
    )
    return shard_pb2.OpenRunRequest(
        run_id=run_id, spec=spec, placement=placement, shard_index=0, workers=WORKERS, total_steps=50
    )


def _opened(request: shard_pb2.OpenRunRequest, seed: int = 0) -> tuple[RunState, ShardRule]:
    """The run as a shard opens it, with initial values registered."""
    run, rule = open_run(request, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    with run.cond:
        run.initialise([(p, torch.randn(p.count, generator=g)) for p in run.parts.values()], overwrite=False)
    return run, rule


def _grads(run: RunState, worker: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * worker + step)
    return {key: torch.randn(p.count, generator=g) for key, p in run.parts.items()}


def _step(run: RunState, rule: ShardRule, step: int, workers: list[int] = WORKERS) -> None:
    """Each of `workers` pushes (or, under wagma, deposits) its step `step`, as the shard applies them."""
    with run.cond:
        for w in workers:
            grads = _grads(run, w, step)
            if run.spec.scheme == "wagma":
                deposit = {k: run.parts[k].values + g for k, g in grads.items()}
                rule.group_average(w, step, frozenset(WORKERS), False, deposit)
                continue
            versions = {key: run.parts[key].version for key in grads}
            staleness = rule.push(Push(w, step, grads, versions))
            run.record_push(w, step, 4 * sum(g.numel() for g in grads.values()), staleness)
            rule.on_pull(w, list(run.parts.values()))


def _state(run: RunState, rule: ShardRule) -> tuple[dict, dict[str, torch.Tensor]]:
    """Everything a checkpoint holds of the run, as comparable values."""
    with run.cond:
        snap = checkpoint.take(run, rule, SHARD_ID, 0, "")
    manifest = {k: v for k, v in snap.manifest.items() if k != "created_unix"}
    return manifest, snap.tensors


def _assert_same(a: tuple[RunState, ShardRule], b: tuple[RunState, ShardRule]) -> None:
    (ma, ta), (mb, tb) = _state(*a), _state(*b)
    assert ma == mb
    assert ta.keys() == tb.keys()
    for key in ta:
        assert ta[key].dtype == tb[key].dtype and torch.equal(ta[key], tb[key]), key


SGD = run_pb2.OptimizerSpec(name="sgd", lr=0.1, momentum=0.9, nesterov=True)
ADAM = run_pb2.OptimizerSpec(name="adam", lr=0.01, schedule="cosine", warmup_steps=2)
CASES = {
    "sync-sgd": ("sync", SGD, {}),
    "sync-backup-adam": ("sync", ADAM, {"backup_workers": 1}),
    "asgd-dc-adaptive": ("asgd", SGD, {"dc_lambda": 0.04, "dc_adaptive": True, "staleness_lr": True}),
    "ssp-adam": ("ssp", ADAM, {"staleness": 2}),
    "pseudosync": ("pseudosync", SGD, {}),
    "wagma": ("wagma", SGD, {}),
}


def _write_and_read(tmp_path: Path, run: RunState, rule: ShardRule, request: shard_pb2.OpenRunRequest):
    digest = checkpoint.open_run_digest(request)
    with run.cond:
        snap = checkpoint.take(run, rule, SHARD_ID, 1, digest)
    written = checkpoint.write(snap, tmp_path)
    expected = checkpoint.Expected(request.run_id, SHARD_ID, digest)
    snapshot = checkpoint.read(written.path, expected, torch.device("cpu"))
    return written, checkpoint.restore(snapshot, request, run.device)


@pytest.mark.parametrize("case", list(CASES))
def test_every_scheme_reads_back_bit_exact_and_goes_on_alike(tmp_path, case):
    scheme, optimizer, params = CASES[case]
    request = _request("r1", scheme, optimizer, **params)
    run, rule = _opened(request)
    for step in range(3):
        _step(run, rule, step)
    _step(run, rule, 3, workers=WORKERS[:1])  # a step half done: sync's partial sums
    written, restored = _write_and_read(tmp_path, run, rule, request)
    assert written.path.name == "ckpt-00000001" and written.nbytes > 0
    _assert_same((run, rule), restored)
    # The optimizer's state (momentum, Adam's moments, the schedule) came back too: the next
    # steps give the same weights, bit for bit.
    for step in (3, 4):
        for pair in ((run, rule), restored):
            _step(*pair, step, workers=WORKERS[1:] if step == 3 else WORKERS)
    _assert_same((run, rule), restored)
    assert any(p.version > 0 for p in restored[0].parts.values()) or scheme == "wagma"


def test_the_ranks_of_a_worker_that_joined_come_back(tmp_path):
    request = _request("r1", "wagma", SGD)
    run, rule = _opened(request)
    run.set_workers([WORKERS[0], 9])  # worker 9 took rank 1, worker 5's
    run.set_live_workers({WORKERS[0], 9})
    _, (restored, _) = _write_and_read(tmp_path, run, rule, request)
    assert restored.workers == {WORKERS[0], 9}
    assert restored.holders([WORKERS[0], WORKERS[1]]) == frozenset({WORKERS[0], 9})


def test_the_files_are_safetensors_with_their_sha256_in_the_manifest(tmp_path):
    request = _request("r1", "sync", ADAM)
    run, rule = _opened(request)
    _step(run, rule, 0)
    written, _ = _write_and_read(tmp_path, run, rule, request)
    manifest = json.loads((written.path / "manifest.json").read_text())
    assert manifest["run_id"] == "r1" and manifest["shard_id"] == SHARD_ID and manifest["step"] == 1
    assert manifest["placement_version"] == request.placement.version
    assert manifest["min_version"] == manifest["max_version"] == 1
    (name,) = manifest["files"]
    data = (written.path / name).read_bytes()
    assert manifest["files"][name] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    # safetensors' own reader takes the file; every part's values are in it, bit-exact.
    loaded = safetensors.torch.load_file(written.path / name)
    with safetensors.safe_open(written.path / name, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    for entry in manifest["run"]["parts"]:
        part = run.parts[tuple(entry["part"])]  # type: ignore[index]
        assert torch.equal(loaded[entry["values"]], part.values)
        assert set(entry["optimizer"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    assert b"pickle" not in data and not any(b.endswith((".pt", ".pkl")) for b in map(str, written.path.iterdir()))


def _saving(root: Path, request: shard_pb2.OpenRunRequest, keep: int = 3) -> RunCheckpoints:
    return ShardCheckpoints(root, SHARD_ID, keep).for_run(request)


def _checkpoint_now(saving: RunCheckpoints, run: RunState, rule: ShardRule) -> checkpoint.Written:
    with run.cond:
        sequence = saving.start(run, rule)
    assert sequence is not None
    outcome = saving.outcome(sequence, timeout_s=120)
    assert outcome is not None and outcome.written is not None, outcome
    return outcome.written


def _two_checkpoints(root: Path) -> tuple[shard_pb2.OpenRunRequest, RunCheckpoints, list[checkpoint.Written], list]:
    """A sync run checkpointed at step 2 and step 3; the states it had then."""
    request = _request("r1", "sync", SGD)
    run, rule = _opened(request)
    saving = _saving(root, request)
    written, states = [], []
    for step in range(3):
        _step(run, rule, step)
        if step >= 1:
            written.append(_checkpoint_now(saving, run, rule))
            states.append(_state(run, rule))
    return request, saving, written, states


def _loaded_state(saving: RunCheckpoints) -> tuple[int, tuple]:
    loaded = saving.load_latest(torch.device("cpu"))
    assert loaded is not None
    run, rule, written = loaded
    return written.sequence, _state(run, rule)


def _refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused")]


def _same_state(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - 7] ^= 0x10  # in the tensors' bytes, past the header
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)


DAMAGE = {
    "truncated": lambda ckpt: _truncate(next(ckpt.glob("*.safetensors"))),
    "bit-flipped": lambda ckpt: _flip_a_bit(next(ckpt.glob("*.safetensors"))),
    "missing file": lambda ckpt: next(ckpt.glob("*.safetensors")).unlink(),
    "missing manifest": lambda ckpt: (ckpt / "manifest.json").unlink(),
    "manifest not json": lambda ckpt: (ckpt / "manifest.json").write_text("{ not json"),
}
WORDS = {
    "truncated": "truncated",
    "bit-flipped": "SHA-256 mismatch",
    "missing file": "missing",
    "missing manifest": "missing",
    "manifest not json": "unreadable",
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_refused_in_one_line_and_the_previous_one_used(tmp_path, caplog, damage):
    _, saving, written, states = _two_checkpoints(tmp_path)
    assert _same_state(_loaded_state(saving)[1], states[1])
    DAMAGE[damage](written[1].path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gradps.shard"):
        sequence, state = _loaded_state(saving)
    assert sequence == written[0].sequence and _same_state(state, states[0])
    (refused,) = _refusals(caplog)
    assert str(written[1].path) in refused and WORDS[damage] in refused and "\n" not in refused


def test_a_checkpoint_of_another_run_or_placement_or_shard_is_refused(tmp_path, caplog):
    request, saving, written, states = _two_checkpoints(tmp_path / "a")
    # Another run's checkpoint (another placement too: its parts are cut otherwise) copied in as
    # the newest.
    other = _request("r2", "sync", SGD)
    other.placement.version = 7
    run, rule = _opened(other, seed=5)
    _step(run, rule, 0)
    foreign = _checkpoint_now(_saving(tmp_path / "b", other), run, rule)
    newest = saving.folder / "ckpt-00000009"
    newest.mkdir()
    for f in foreign.path.iterdir():
        (newest / f.name).write_bytes(f.read_bytes())
    # The same run opened with another placement (a checkpoint whose OpenRun digest differs).
    moved = _request("r1", "sync", SGD)
    moved.placement.version = 2
    run2, rule2 = _opened(moved)
    elsewhere = _checkpoint_now(_saving(tmp_path / "c", moved), run2, rule2)
    replaced = saving.folder / "ckpt-00000008"
    replaced.mkdir()
    for f in elsewhere.path.iterdir():
        (replaced / f.name).write_bytes(f.read_bytes())
    # Another shard's checkpoint of the same run.
    other_shard = ShardCheckpoints(tmp_path / "d", "s1").for_run(request)
    run3, rule3 = _opened(request)
    theirs = _checkpoint_now(other_shard, run3, rule3)
    third = saving.folder / "ckpt-00000007"
    third.mkdir()
    for f in theirs.path.iterdir():
        (third / f.name).write_bytes(f.read_bytes())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gradps.shard"):
        sequence, state = _loaded_state(saving)
    assert sequence == written[1].sequence and _same_state(state, states[1])
    refused = _refusals(caplog)
    assert len(refused) == 3, refused
    assert "ckpt-00000009" in refused[0] and "run_id 'r2'" in refused[0]
    assert "ckpt-00000008" in refused[1] and "another placement" in refused[1]
    assert "ckpt-00000007" in refused[2] and "shard_id 's1'" in refused[2]
    # And read directly, each is a CheckpointError of one line.
    with pytest.raises(CheckpointError) as error:
        checkpoint.read(newest, saving.expected, torch.device("cpu"))
    assert "\n" not in str(error.value)


def test_only_the_last_k_are_kept_and_at_most_one_is_written_at_a_time(tmp_path):
    request = _request("r1", "sync", SGD)
    run, rule = _opened(request)
    saving = _saving(tmp_path, request, keep=2)
    for step in range(4):
        _step(run, rule, step)
        _checkpoint_now(saving, run, rule)
    assert saving.sequences() == [3, 4]
    assert sorted(p.name for p in saving.folder.iterdir()) == ["ckpt-00000003", "ckpt-00000004", OPEN_RUN]
    # Two due back to back: the second is skipped while the first is written.
    with run.cond:
        first = saving.start(run, rule)
        second = saving.start(run, rule)
    assert first == 5 and second is None and saving.skipped == 1
    outcome = saving.outcome(5, timeout_s=120)
    assert outcome is not None and outcome.written is not None
    # Closing the run removes its checkpoints.
    saving.remove()
    assert not saving.folder.exists()


def _due_after_each_step(saving, run, rule, steps: int, declare_ahead: int = 0) -> list[bool]:
    """Steps 0 to `steps` - 1 in turn: whether a checkpoint was due after each (one is written
    when it is); with `declare_ahead`, each step then declares a cut that many steps ahead."""
    due = []
    for step in range(steps):
        _step(run, rule, step)
        with run.cond:
            due.append(saving.due(rule))
            if due[-1]:
                saving.start(run, rule)
            if declare_ahead:
                saving.declare(rule, step + declare_ahead)
        saving.wait_idle(30)
    return due


def test_the_interval_counts_steps_or_seconds(tmp_path):
    request = _request("r1", "sync", SGD)
    request.spec.checkpoint_every_steps = 2
    run, rule = _opened(request)
    saving = _saving(tmp_path, request)
    due = _due_after_each_step(saving, run, rule, 5)
    assert due == [False, True, False, True, False]  # at steps 2 and 4 (sync: steps completed)
    timed = _request("r2", "asgd", SGD)
    timed.spec.checkpoint_every_seconds = 0.2
    run2, rule2 = _opened(timed)
    saving2 = _saving(tmp_path, timed)
    assert not saving2.due(rule2)
    time.sleep(0.25)
    assert saving2.due(rule2)


def test_the_listing_says_when_each_checkpoint_was_taken_and_how_long_it_took(tmp_path):
    """What `gradps bench step` places beside the steps: when each snapshot was taken and how long
    until its files were on disk; after a restart (another process) the time taken is unknown."""
    request = _request("r1", "asgd", SGD)
    run, rule = _opened(request)
    saving = _saving(tmp_path, request, keep=2)
    began = time.time()
    for step in range(3):
        _step(run, rule, step)
        with run.cond:
            saving.start(run, rule)
        saving.wait_idle(30)
    ended = time.time()
    listed = list(saving.listing().values())
    assert [c.sequence for c in listed] == [2, 3]  # the oldest pruned
    assert all(began <= c.created_unix <= ended and 0 < c.seconds <= ended - began for c in listed), listed
    assert listed[0].created_unix < listed[1].created_unix
    again = [(c.created_unix, c.seconds) for c in _saving(tmp_path, request, keep=2).listing().values()]
    assert again == [(c.created_unix, 0.0) for c in listed]


def test_a_common_cut_run_checkpoints_at_the_cut_rank_0_declares_not_by_the_shards_clock(tmp_path):
    """sync and pseudosync: shards that each kept time would checkpoint different steps, and a run
    could go back to none. The declared cut is taken while step cut - 3 is not complete here, and
    is due once the run reaches it; a declaration later than that is left (a worker might have
    pushed the step before the cut not knowing)."""
    request = _request("r1", "sync", SGD)
    request.spec.checkpoint_every_seconds = 0.01
    run, rule = _opened(request)
    saving = _saving(tmp_path, request)
    time.sleep(0.02)
    with run.cond:
        assert not saving.due(rule)  # seconds passed: not on this shard's clock
        run.cut_asked = True
        saving.declare(rule, 3)  # at step 0, declared for step 3: taken
        assert (run.cut_step, run.cut_asked) == (3, False)
    # Each step also declares the step 3 ahead, late: step (step + 3) - 3 is complete.
    due = _due_after_each_step(saving, run, rule, 4, declare_ahead=3)
    assert due == [False, False, True, False]  # at step 3 only
    assert run.cut_step == 3
    assert [c.step for c in saving.listing().values()] == [3]


# ---- a process killed while writing ----------------------------------------------------------


def _writer(root: str, marker: str, point: str) -> None:
    """In a process of its own: checkpoint a run at step 2, then again at step 3, pausing the
    second write at `point` (PAUSE_ENV) until killed."""
    request = _request("r1", "sync", SGD)
    run, rule = _opened(request)
    saving = _saving(Path(root), request)
    for step in range(2):
        _step(run, rule, step)
    _checkpoint_now(saving, run, rule)
    _step(run, rule, 2)
    os.environ[checkpoint.PAUSE_ENV] = f"{marker}@{point}"
    _checkpoint_now(saving, run, rule)
    raise SystemExit("the write did not pause")


@pytest.mark.parametrize("point", ["mid-file", "before-rename"])
def test_a_process_killed_while_writing_never_leaves_a_checkpoint_that_loads(tmp_path, caplog, point):
    marker = tmp_path / "paused"
    code = f"from tests.test_checkpoint import _writer; _writer({str(tmp_path)!r}, {str(marker)!r}, {point!r})"
    writer = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        until(lambda: marker.exists() or writer.poll() is not None, 60, "the write never paused")
        assert writer.poll() is None, "the writer exited"
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    finally:
        if writer.poll() is None:
            writer.kill()
    folder = tmp_path / f"shard-{SHARD_ID}" / "r1"
    temp = folder / ".ckpt-00000002.tmp"
    assert temp.is_dir() and not (folder / "ckpt-00000002").exists()
    if point == "mid-file":
        (half,) = temp.glob("*.safetensors")
        assert 0 < half.stat().st_size and not (temp / "manifest.json").exists()
    # What a restarted shard takes back: checkpoint 1 (step 2); the cut-short one is removed.
    with caplog.at_level(logging.INFO, logger="gradps.shard"):
        (restored,) = ShardCheckpoints(tmp_path, SHARD_ID).restore(torch.device("cpu"))
    run, rule, saving = restored
    assert rule.step() == 2 and all(p.version == 2 for p in run.parts.values())
    request = _request("r1", "sync", SGD)
    expected_run, expected_rule = _opened(request)
    for step in range(2):
        _step(expected_run, expected_rule, step)
    _assert_same((run, rule), (expected_run, expected_rule))
    assert not temp.exists() and saving.sequences() == [1]
    assert any("cut short" in r.getMessage() for r in caplog.records)


def test_each_checkpoint_is_counted_for_prometheus(tmp_path):
    from prometheus_client import REGISTRY

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, {"scheme": "sync", **labels}) or 0.0

    before = [sample("gradps_shard_checkpoint_seconds_count", phase=p) for p in ("snapshot", "write")]
    bytes_before = sample("gradps_shard_checkpoint_bytes_total")
    request = _request("r-metrics", "sync", SGD)
    run, rule = _opened(request)
    _step(run, rule, 0)
    written = _checkpoint_now(_saving(tmp_path, request), run, rule)
    after = [sample("gradps_shard_checkpoint_seconds_count", phase=p) for p in ("snapshot", "write")]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]
    assert sample("gradps_shard_checkpoint_bytes_total") - bytes_before == written.nbytes > 0


def test_the_first_snapshot_is_copied_into_memory_made_ready_before_it_was_due(tmp_path):
    request = _request("r1", "asgd", SGD)
    request.spec.checkpoint_every_seconds = 60
    run, rule = _opened(request)
    saving = _saving(tmp_path, request)
    _step(run, rule, 0)
    with run.cond:
        saving.prepare(rule)  # due in a minute: too early
    assert not any(t.name.startswith("checkpoint-memory-") for t in threading.enumerate())
    saving.last_time -= 59  # due in a second
    with run.cond:
        saving.prepare(rule)
        sizes = checkpoint.file_sizes(run, rule)
    until(lambda: not any(t.name.startswith("checkpoint-memory-") for t in threading.enumerate()), 30, "memory ready")
    reserved = list(saving._buffers._spare)
    assert [len(b) for b in reserved] == [direct_io.aligned(s) for s in sizes]
    written = _checkpoint_now(saving, run, rule)
    assert sum(f.stat().st_size for f in written.path.glob("*.safetensors")) == sum(sizes)
    assert {id(b) for b in saving._buffers._spare} == {id(b) for b in reserved}  # the snapshot's, given back
