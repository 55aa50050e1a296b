"""When a shard checkpoints its runs, where the checkpoints live, and what a restarted shard takes
back (the files themselves: ps_server/checkpoint.py).

Under the shard's state dir (--state-dir), its folder `shard-<shard id>/` holds one folder per run:

  <run>/run.binpb        the OpenRunRequest that opened the run (spec, placement, workers)
  <run>/ckpt-<sequence>/ the run's last K checkpoints, newest highest

A checkpoint is due when the run's step (ShardRule.step) reaches the next multiple of
RunSpec.checkpoint_every_steps, or checkpoint_every_seconds have passed since the last one,
checked whenever a push or deposit is applied. sync and pseudosync (Scheme.common_cut) go back
to a step every shard has a checkpoint of, so their shards keep no clock of their own: their
rank 0 does, and declares a cut a few steps ahead in a push (PushRequest.cut_step), also when a
checkpoint is asked for (CheckpointRun); every shard checkpoints that step (gradps/cuts.py).

The snapshot is taken where a checkpoint is due, under the run's lock; it is written in a
background thread, at most one in flight per run (a checkpoint due while one is being written is
skipped). A shard started on the same state dir and shard id serves each run from its newest
checkpoint that reads back whole, falling back to older ones, one line for each refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from google.protobuf.message import DecodeError

from gradps import metrics
from gradps.cuts import DECLARE_AHEAD
from gradps.errors import one_line
from gradps.schemes import get_scheme
from gradps.v1 import shard_pb2
from ps_server import checkpoint, direct_io
from ps_server.checkpoint import CheckpointError, Expected, Written
from ps_server.run_state import RunState
from ps_server.schemes import ShardRule

_LOGGER = logging.getLogger("gradps.shard")
OPEN_RUN = "run.binpb"
# Checkpoints kept per run unless the shard says otherwise (--keep-checkpoints).
KEEP = 3
# A checkpoint writer's nice value: the lowest priority.
_BACKGROUND_NICE = 19
# The first snapshot's memory is made ready this far ahead of the snapshot (see prepare).
_PREPARE_AHEAD_S = 2.0
_PREPARE_AHEAD_STEPS = 5
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _in_background() -> None:
    """The calling thread at the lowest CPU priority (on Linux a thread's nice value is its own):
    on a busy host the training steps go first and the checkpoint takes what is left."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux, or not allowed: as it is
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _BACKGROUND_NICE)


def run_folder_name(run_id: str) -> str:
    """A run's folder: its id where that is a plain file name, else a digest of it."""
    if _SAFE_NAME.fullmatch(run_id):
        return run_id
    return "run-" + hashlib.sha256(run_id.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Listed:
    """A complete checkpoint as its manifest describes it."""

    sequence: int
    step: int
    min_version: int
    max_version: int
    # Bytes of its files.
    nbytes: int = 0
    # When its snapshot was taken (Unix seconds), and how long until its files were on disk
    # (0: unknown here: written by another process, or its outcome taken by `outcome`).
    created_unix: float = 0.0
    seconds: float = 0.0


@dataclass
class Outcome:
    """How the checkpoint being written ended: on disk, or why not."""

    written: Written | None = None
    error: str = ""
    snapshot_seconds: float = 0.0


class RunCheckpoints:
    """One run's checkpoints on this shard: when the next is due, the one in flight, the last K."""

    def __init__(self, folder: Path, shard_id: str, request: shard_pb2.OpenRunRequest, keep: int) -> None:
        self.folder = folder
        self.shard_id = shard_id
        self.request = request
        self.keep = keep
        self.expected = Expected(request.run_id, shard_id, checkpoint.open_run_digest(request))
        spec = request.spec
        self.every_steps = spec.checkpoint_every_steps
        self.every_s = spec.checkpoint_every_seconds
        # Cuts at one step on every shard: the time-based ones are declared by rank 0.
        self.common_cut = get_scheme(spec.scheme).common_cut
        self.sequence = max(self.sequences(), default=0)
        self.last_step = 0
        self.last_time = time.monotonic()
        # Checkpoints due while one was being written.
        self.skipped = 0
        self._cond = threading.Condition()
        self._writing = False
        self._outcomes: dict[int, Outcome] = {}
        self._closed = False
        # The threads writing a checkpoint or making its memory ready, joined by `finish`.
        self._background: list[threading.Thread] = []
        # The memory a snapshot is copied into, reused by the next one.
        self._buffers = direct_io.Buffers()
        # Whether that memory was made ready (or a snapshot was taken, which keeps its own).
        self._prepared = False

    def sequences(self) -> list[int]:
        """Sequence numbers of the complete (renamed) checkpoints, oldest first."""
        if not self.folder.is_dir():
            return []
        found = []
        for path in self.folder.iterdir():
            digits = path.name.removeprefix(checkpoint.PREFIX)
            if path.name.startswith(checkpoint.PREFIX) and digits.isdigit():
                found.append(int(digits))
        return sorted(found)

    # ---- writing ----------------------------------------------------------------------------

    def due(self, rule: ShardRule) -> bool:
        """Whether the run's interval says a checkpoint is due now, and its state is a cut (call
        with `run.cond` held)."""
        return rule.cut_ready() and self._due_within(rule, 0, 0.0)

    def prepare(self, rule: ShardRule) -> None:
        """Make the first snapshot's memory ready when one is due soon (call with `run.cond` held,
        at every change of the run). Copied into fresh memory, a snapshot faults in every page
        under the run's lock: 400 MB held every push and pull of the run for 0.25-1.25 s on a
        busy host. Made ready here on a background thread, the copy takes 20-40 ms; later
        snapshots reuse the memory of the one before."""
        if self._prepared or not self._due_within(rule, _PREPARE_AHEAD_STEPS, _PREPARE_AHEAD_S):
            return
        self._prepared = True
        sizes = checkpoint.file_sizes(rule.run, rule)
        self._start_background(self._reserve, sizes, name=f"checkpoint-memory-{rule.run.run_id}")

    def _due_within(self, rule: ShardRule, steps: int, seconds: float) -> bool:
        """Whether the run's interval says a checkpoint is due within `steps` steps or `seconds`
        seconds (a common cut: once it is declared, DECLARE_AHEAD steps ahead)."""
        step = rule.step() + steps
        if self.every_steps and step // self.every_steps > self.last_step // self.every_steps:
            return True
        if self.common_cut:
            return step >= rule.run.cut_step > self.last_step
        return bool(self.every_s) and time.monotonic() - self.last_time >= self.every_s - seconds

    def _reserve(self, sizes: list[int]) -> None:
        _in_background()
        self._buffers.reserve(sizes)

    def declare(self, rule: ShardRule, cut_step: int) -> None:
        """Rank 0 declared a cut at `cut_step` (call with `run.cond` held). Taken unless this shard
        completed step cut_step - DECLARE_AHEAD already: a worker told by an answer after that might
        have pushed the step before the cut unknowing (a late rank 0, with backup workers)."""
        run = rule.run
        if self.common_cut and cut_step > run.cut_step and rule.step() <= cut_step - DECLARE_AHEAD:
            run.cut_step, run.cut_asked = cut_step, False

    def start(self, run: RunState, rule: ShardRule) -> int | None:
        """Take a snapshot now (call with `run.cond` held) and write it in the background; its
        sequence number, or None when one is in flight (at most one is) or the run was removed."""
        with self._cond:
            if self._writing or self._closed:
                self.skipped += 1
                return None
            self._writing = True
            self.sequence += 1
            sequence = self.sequence
        try:
            snapshot = checkpoint.take(run, rule, self.shard_id, sequence, self.expected.open_digest, self._buffers)
        except BaseException:
            with self._cond:
                self._writing = False
                self._cond.notify_all()
            raise
        self.last_step, self.last_time = rule.step(), time.monotonic()
        self._prepared = True
        self._start_background(self._write, snapshot, name=f"checkpoint-{run.run_id}")
        return sequence

    def _start_background(self, work: Callable[[Any], None], arg: object, name: str) -> None:
        # Daemons, so that a shard killed mid-write still exits; a stopping one joins them (`finish`).
        thread = threading.Thread(target=work, args=(arg,), name=name, daemon=True)
        with self._cond:
            self._background = [t for t in self._background if t.is_alive()] + [thread]
        thread.start()

    def _write(self, snapshot: checkpoint.Snapshot) -> None:
        _in_background()
        outcome = Outcome(snapshot_seconds=snapshot.seconds)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if not (self.folder / OPEN_RUN).exists():
                checkpoint.write_atomically(self.folder / OPEN_RUN, self.request.SerializeToString(deterministic=True))
            outcome.written = checkpoint.write(snapshot, self.folder)
            self._prune()
            w = outcome.written
            scheme = self.request.spec.scheme
            metrics.SHARD_CHECKPOINT_SECONDS.labels(scheme, "snapshot").observe(snapshot.seconds)
            metrics.SHARD_CHECKPOINT_SECONDS.labels(scheme, "write").observe(w.seconds)
            metrics.SHARD_CHECKPOINT_BYTES.labels(scheme).inc(w.nbytes)
            _LOGGER.info(
                "run %s: checkpoint %d at step %d, %.1f MB in %.2f s (lock held %.3f s)",
                snapshot.run_id,
                w.sequence,
                w.step,
                w.nbytes / 1e6,
                w.seconds,
                snapshot.seconds,
            )
        except OSError as e:  # a full or read-only disk: the run goes on, without this checkpoint
            outcome.error = f"checkpoint of run {snapshot.run_id!r} under {self.folder}: {one_line(e)}"
            metrics.SHARD_CHECKPOINT_FAILURES.labels(self.request.spec.scheme).inc()
            _LOGGER.warning("%s", outcome.error)
        finally:
            self._buffers.give_back([f.buffer for f in snapshot.files])
            with self._cond:
                sequence = int(snapshot.manifest["sequence"])
                self._outcomes[sequence] = outcome
                # Those of the checkpoints kept (and one more), written or failed: not forever.
                for old in [s for s in self._outcomes if s < sequence - self.keep]:
                    del self._outcomes[old]
                self._writing = False
                self._cond.notify_all()

    def _prune(self) -> None:
        for sequence in self.sequences()[: -self.keep]:
            checkpoint.remove_tree(self._path(sequence))

    def finish(self, timeout_s: float) -> bool:
        """For a stopping shard: start no more checkpoints, and wait at most `timeout_s` for the
        one being written and for every background thread to end (False if one has not). A
        thread still running at the interpreter's exit is stopped where it stands, which inside
        torch (a snapshot's tensors being freed) aborts the process."""
        end = time.monotonic() + timeout_s
        with self._cond:
            self._closed = True
            threads = list(self._background)
        for thread in threads:
            thread.join(max(0.0, end - time.monotonic()))
        return not any(thread.is_alive() for thread in threads)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no checkpoint is being written; False after `timeout_s`."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._writing, timeout=timeout_s)

    def outcome(self, sequence: int, timeout_s: float | None = None) -> Outcome | None:
        """How checkpoint `sequence` ended, once it has (None after `timeout_s`)."""
        with self._cond:
            self._cond.wait_for(lambda: sequence in self._outcomes, timeout=timeout_s)
            return self._outcomes.pop(sequence, None)

    def wait_written(self, accept: Callable[[Listed], bool], timeout_s: float) -> tuple[Listed, Outcome | None] | None:
        """The newest complete checkpoint that `accept`s, once there is one, with how its writing
        went when it was written by this process; None after `timeout_s`."""
        found: list[Listed] = []

        def written() -> bool:
            found[:] = [c for c in self.listing().values() if accept(c)]
            return bool(found)

        with self._cond:
            if not self._cond.wait_for(written, timeout=timeout_s):
                return None
            return found[-1], self._outcomes.get(found[-1].sequence)

    def remove(self) -> None:
        """The run is closed on this shard: its checkpoints go (after the one in flight)."""
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: not self._writing)
        self._buffers.clear()
        if self.folder.is_dir():
            for sequence in self.sequences():
                checkpoint.remove_tree(self.folder / f"{checkpoint.PREFIX}{sequence:08d}")
            for path in self.folder.iterdir():
                path.unlink() if path.is_file() else checkpoint.remove_tree(path)
            self.folder.rmdir()

    def drop_after(self, step: int) -> None:
        """Remove the checkpoints taken after `step` (the run went back there: their steps will
        be done again), after the one in flight."""
        self.wait_idle()
        for sequence, listed in self.listing().items():
            if listed.step > step:
                checkpoint.remove_tree(self._path(sequence))

    # ---- reading ----------------------------------------------------------------------------

    def listing(self) -> dict[int, Listed]:
        """The complete checkpoints by sequence, oldest first, as their manifests say (not
        verified; one whose manifest does not read is left out)."""
        found = {}
        with self._cond:
            outcomes = dict(self._outcomes)
        for sequence in self.sequences():
            try:
                m = json.loads((self._path(sequence) / checkpoint.MANIFEST).read_bytes())
                nbytes = sum(int(f["bytes"]) for f in m["files"].values())
                o = outcomes.get(sequence)
                seconds = o.snapshot_seconds + o.written.seconds if o is not None and o.written else 0.0
                found[sequence] = Listed(
                    sequence,
                    int(m["step"]),
                    int(m["min_version"]),
                    int(m["max_version"]),
                    nbytes,
                    float(m.get("created_unix", 0.0)),
                    seconds,
                )
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
        return found

    def read_step(self, step: int, device: torch.device) -> RunState | None:
        """The run as its newest checkpoint at `step` that reads back whole holds it, verified as
        `load_step` does, for reading only: nothing here changes (not when the next checkpoint is
        due). None when there is no checkpoint at `step`; the newest one's CheckpointError when
        none there reads back whole."""
        found, refused = self._newest_whole(self._at_step(step), device)
        if found is None and refused:
            raise refused[0]
        return found[2] if found is not None else None

    def load_step(self, step: int, device: torch.device) -> tuple[RunState, ShardRule, Written] | None:
        """The run from its newest checkpoint at `step` that reads back whole (None: none does)."""
        return self.load_latest(device, self._at_step(step))

    def load_latest(
        self, device: torch.device, sequences: list[int] | None = None
    ) -> tuple[RunState, ShardRule, Written] | None:
        """The run from its newest checkpoint (of `sequences`, default all) that reads back
        whole; older ones in turn when it does not (a line for each refused); None when none does."""
        found, refused = self._newest_whole(self.sequences() if sequences is None else sequences, device)
        for e in refused:
            _LOGGER.warning("refused %s", e)
        if found is None:
            return None
        sequence, snapshot, run, rule = found
        m = snapshot.manifest
        self.last_step, self.last_time = int(m["step"]), time.monotonic()
        nbytes = sum(int(f["bytes"]) for f in m["files"].values())
        written = Written(self._path(sequence), sequence, m["step"], m["min_version"], m["max_version"], nbytes, 0.0)
        return run, rule, written

    def _newest_whole(
        self, sequences: list[int], device: torch.device
    ) -> tuple[tuple[int, checkpoint.Snapshot, RunState, ShardRule] | None, list[CheckpointError]]:
        """The newest of `sequences` that reads back whole, as read and restored (None: none
        does), and why each newer one was refused, newest first."""
        refused: list[CheckpointError] = []
        for sequence in reversed(sequences):
            try:
                snapshot = checkpoint.read(self._path(sequence), self.expected, device)
                run, rule = checkpoint.restore(snapshot, self.request, device)
            except CheckpointError as e:
                refused.append(e)
                continue
            return (sequence, snapshot, run, rule), refused
        return None, refused

    def _at_step(self, step: int) -> list[int]:
        """Sequence numbers of the complete checkpoints at `step`, oldest first."""
        return [sequence for sequence, listed in self.listing().items() if listed.step == step]

    def _path(self, sequence: int) -> Path:
        return self.folder / f"{checkpoint.PREFIX}{sequence:08d}"


class ShardCheckpoints:
    """Every run's checkpoints of one shard: `state_dir`/shard-<shard id>/."""

    def __init__(self, state_dir: Path, shard_id: str, keep: int = KEEP) -> None:
        if not _SAFE_NAME.fullmatch(shard_id):
            raise ValueError(f"shard id {shard_id!r}: 1 to 128 letters, digits, '.', '_' or '-'")
        self.root = state_dir / f"shard-{shard_id}"
        self.shard_id = shard_id
        self.keep = keep

    def for_run(self, request: shard_pb2.OpenRunRequest) -> RunCheckpoints:
        return RunCheckpoints(self.root / run_folder_name(request.run_id), self.shard_id, request, self.keep)

    def restore(self, device: torch.device) -> list[tuple[RunState, ShardRule, RunCheckpoints]]:
        """Every run this shard checkpointed, each from its newest checkpoint that reads back
        whole; temporary folders of writes cut short are removed."""
        restored = []
        folders = sorted(p for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else []
        for folder in folders:
            for temp in folder.glob(f".{checkpoint.PREFIX}*.tmp"):
                _LOGGER.info("removed %s: a checkpoint cut short", temp)
                checkpoint.remove_tree(temp)
            request = _open_request(folder)
            if request is None:
                continue
            saving = RunCheckpoints(folder, self.shard_id, request, self.keep)
            loaded = saving.load_latest(device)
            if loaded is None:
                _LOGGER.warning("run %s: no checkpoint in %s reads back whole; not restored", request.run_id, folder)
                continue
            run, rule, written = loaded
            _LOGGER.info(
                "run %s restored from %s: step %d, versions %d..%d",
                run.run_id,
                written.path,
                written.step,
                written.min_version,
                written.max_version,
            )
            restored.append((run, rule, saving))
        return restored


def _open_request(folder: Path) -> shard_pb2.OpenRunRequest | None:
    path = folder / OPEN_RUN
    request = shard_pb2.OpenRunRequest()
    try:
        request.ParseFromString(path.read_bytes())
    except FileNotFoundError:
        _LOGGER.warning("refused %s: missing", path)
        return None
    except (OSError, DecodeError) as e:
        _LOGGER.warning("refused %s: %s", path, one_line(e))
        return None
    if run_folder_name(request.run_id) != folder.name:
        _LOGGER.warning("refused %s: it opens run %r, not the folder's", path, request.run_id)
        return None
    return request
