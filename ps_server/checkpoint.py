"""One shard's checkpoint of one run: a snapshot taken under the run's lock, written atomically,
read back verified.

A checkpoint is a folder `ckpt-<sequence>` (in the run's folder: ps_server/checkpointing.py)
holding safetensors files `tensors-<n>.safetensors` and `manifest.json`, whose fields are

  format, run_id, shard_id, shard_index, sequence, step, placement_version, open_run_sha256
  (the SHA-256 of the OpenRunRequest that opened the run: its spec, placement and workers),
  created_unix, min_version, max_version, files ({name: {bytes, sha256}}),
  run (every part's version, optimizer updates and the keys of its values and optimizer state;
  membership; the pushes remembered for exactly-once; counters), rule (the scheme's own state:
  ShardRule.save).

Written atomically: every file goes into a temporary folder `.ckpt-<sequence>.tmp`, each is
fsynced, the folder is renamed to its name and the run's folder fsynced. A process killed while
writing leaves a temporary folder, never a `ckpt-` one. Read back, a folder whose manifest,
sizes, SHA-256 or run does not match is refused with a one-line CheckpointError naming the file.
No pickle anywhere: tensors are safetensors (raw bytes under a JSON header), the rest is JSON.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import safetensors.torch
import torch

from gradps.errors import one_line
from gradps.v1 import shard_pb2
from ps_server import direct_io
from ps_server.run_state import RunState
from ps_server.saved_state import Saved, part_of
from ps_server.schemes import ShardRule, open_run

FORMAT = "gradps-shard-checkpoint/1"
MANIFEST = "manifest.json"
PREFIX = "ckpt-"
# Tensors per file up to about this many bytes: a file is hashed and written as a unit.
_FILE_BYTES = 256 << 20
# Tests only: "<marker>@<point>" pauses a write (forever, until the process is killed) at
# `mid-file` (half of the first file written) or `before-rename` (every file and the manifest
# written, the folder not yet renamed), after creating <marker>; a marker that exists already
# means no pause.
PAUSE_ENV = "GRADPS_TEST_PAUSE_CHECKPOINT"
_DTYPES = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message is one line naming the file."""


@dataclass(frozen=True)
class FileImage:
    """One safetensors file of a snapshot, byte for byte, in page-aligned memory."""

    name: str
    buffer: mmap.mmap
    size: int


@dataclass
class Snapshot:
    """A run's state on one shard at one moment, copied: written after the lock is released."""

    run_id: str
    # The manifest without `files` (added when written).
    manifest: dict[str, Any]
    # Taken: views of `files`; read back: the tensors loaded.
    tensors: dict[str, torch.Tensor]
    files: list[FileImage] = field(default_factory=list)
    # Seconds the run's lock was held to take it.
    seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class Written:
    """A checkpoint on disk."""

    path: Path
    sequence: int
    step: int
    min_version: int
    max_version: int
    nbytes: int
    seconds: float


def open_run_digest(request: shard_pb2.OpenRunRequest) -> str:
    """SHA-256 of an OpenRunRequest, as manifests record it: names the run's spec and placement."""
    return hashlib.sha256(request.SerializeToString(deterministic=True)).hexdigest()


# ---- the snapshot (under the run's lock) --------------------------------------------------------


def take(
    run: RunState,
    rule: ShardRule,
    shard_id: str,
    sequence: int,
    open_digest: str,
    buffers: direct_io.Buffers | None = None,
) -> Snapshot:
    """Copy everything the run needs to go on (call with `run.cond` held): parts' values and
    versions, optimizer state and schedule position, membership, exactly-once keys, the rule's
    state. The tensors are copied straight into the files' bytes, in memory from `buffers`."""
    began = time.perf_counter()
    parts, state, rule_state = _named(run, rule)
    versions = [p.version for p in run.parts.values()]
    manifest = {
        "format": FORMAT,
        "run_id": run.run_id,
        "shard_id": shard_id,
        "shard_index": run.shard_index,
        "sequence": sequence,
        "step": rule.step(),
        "placement_version": run.placement.version,
        "open_run_sha256": open_digest,
        "created_unix": time.time(),
        "min_version": min(versions, default=0),
        "max_version": max(versions, default=0),
        "run": {
            "parts": parts,
            "membership_epoch": run.membership_epoch,
            "restore_epoch": run.restore_epoch,
            "workers": sorted(run.workers),
            "ranks": sorted([w, r] for w, r in run.ranks.items()),
            "live_workers": sorted(run.live_workers),
            "applied": [[w, step, tau] for w, steps in run.applied.items() for step, tau in steps.items()],
            "pushes": run.pushes,
            "bytes_pushed": run.bytes_pushed,
            "bytes_pulled": run.bytes_pulled,
            "ended": run.ended,
        },
        "rule": rule_state.fields,
    }
    files, copies = _images({**state.tensors, **rule_state.tensors}, buffers or direct_io.Buffers())
    return Snapshot(run.run_id, manifest, copies, files, time.perf_counter() - began)


def file_sizes(run: RunState, rule: ShardRule) -> list[int]:
    """The bytes of each file a snapshot taken now would write (call with `run.cond` held): the
    memory to make ready for the next one."""
    _, state, rule_state = _named(run, rule)
    return [layout.size for layout in _layouts({**state.tensors, **rule_state.tensors})]


def _named(run: RunState, rule: ShardRule) -> tuple[list[dict[str, Any]], Saved, Saved]:
    """Every part's entry of the manifest, and the tensors it and the rule's state name (not
    copied yet)."""
    state, rule_state = Saved("run/"), Saved("rule/")
    opt = run.optimizer
    parts = []
    for key, part in run.parts.items():
        param = opt.params[key]
        entry = {
            "part": list(key),
            "version": part.version,
            "initialised": part.initialised,
            "values": state.put(part.values),
            "updates": opt.updates[key],
            "optimizer": _optimizer_entry(opt.opt.state.get(param, {}) if opt.opt else {}, state),
        }
        parts.append(entry)
    rule.save(rule_state)
    return parts, state, rule_state


@dataclass(frozen=True)
class _Layout:
    """Where each tensor of one safetensors file goes: after `head` (an 8-byte little-endian
    header size, a JSON header padded with spaces to 8 bytes), the tensors' bytes in a row."""

    keys: list[str]
    head: bytes
    # Each tensor's first byte in the file.
    starts: dict[str, int]
    size: int


def _layouts(tensors: dict[str, torch.Tensor]) -> list[_Layout]:
    layouts = []
    for group in _files_of(tensors):
        # Widest elements first: every tensor starts aligned to its element's size.
        keys = sorted(group, key=lambda k: -tensors[k].element_size())
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for key in keys:
            t = tensors[key]
            nbytes = t.numel() * t.element_size()
            header[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        head = struct.pack("<Q", len(encoded)) + encoded
        starts = {key: len(head) + header[key]["data_offsets"][0] for key in keys}
        layouts.append(_Layout(keys, head, starts, len(head) + offset))
    return layouts


def _images(
    tensors: dict[str, torch.Tensor], buffers: direct_io.Buffers
) -> tuple[list[FileImage], dict[str, torch.Tensor]]:
    """`tensors` copied into the safetensors files that hold them; the files, and the copies as
    views of them."""
    files: list[FileImage] = []
    copies: dict[str, torch.Tensor] = {}
    for n, layout in enumerate(_layouts(tensors)):
        image = FileImage(f"tensors-{n:05d}.safetensors", buffers.get(layout.size), layout.size)
        image.buffer[: len(layout.head)] = layout.head
        for key in layout.keys:
            t = tensors[key]
            if not t.numel():
                copies[key] = torch.empty(t.shape, dtype=t.dtype)
                continue
            copies[key] = torch.frombuffer(image.buffer, dtype=t.dtype, count=t.numel(), offset=layout.starts[key])
            copies[key] = copies[key].view(t.shape)
            copies[key].copy_(t)
        files.append(image)
    return files, copies


def _optimizer_entry(state: dict[str, Any], saved: Saved) -> dict[str, Any]:
    """A part's torch optimizer state (momentum buffer; Adam's step and moments): tensors by key."""
    entry: dict[str, Any] = {}
    for name, value in sorted(state.items()):
        if isinstance(value, torch.Tensor):
            entry[name] = {"tensor": saved.put(value)}
        elif value is None or isinstance(value, int | float | bool):
            entry[name] = {"value": value}
        else:
            raise TypeError(f"optimizer state {name!r} of type {type(value).__name__} cannot be checkpointed")
    return entry


# ---- writing (off the lock) ---------------------------------------------------------------------


def write(snapshot: Snapshot, run_dir: Path) -> Written:
    """Write `snapshot` as `run_dir`/ckpt-<sequence>, atomically (see the module's docstring)."""
    began = time.perf_counter()
    sequence = int(snapshot.manifest["sequence"])
    final = run_dir / f"{PREFIX}{sequence:08d}"
    temp = run_dir / f".{PREFIX}{sequence:08d}.tmp"
    remove_tree(temp)
    temp.mkdir(parents=True)
    try:
        files = _write_files(snapshot, temp)
    except BaseException:
        remove_tree(temp)  # a full disk: nothing of this checkpoint stays behind
        raise
    if final.exists():  # a sequence number taken before (by a process that died after renaming)
        remove_tree(final)
    os.rename(temp, final)
    sync_dir(run_dir)
    m = snapshot.manifest
    nbytes = sum(f["bytes"] for f in files.values())
    return Written(final, sequence, m["step"], m["min_version"], m["max_version"], nbytes, time.perf_counter() - began)


def _write_files(snapshot: Snapshot, temp: Path) -> dict[str, dict[str, Any]]:
    """The snapshot's safetensors files and its manifest in `temp`, each fsynced, and `temp` too."""
    files: dict[str, dict[str, Any]] = {}
    for n, image in enumerate(snapshot.files):
        halfway = image.size // 2 if n == 0 and _pausing("mid-file") else -1
        digest = direct_io.write_file(
            temp / image.name, memoryview(image.buffer)[: image.size], halfway, lambda: _pause_for_tests("mid-file")
        )
        files[image.name] = {"bytes": image.size, "sha256": digest}
    manifest = {**snapshot.manifest, "files": files}
    with open(temp / MANIFEST, "wb") as f:
        f.write(json.dumps(manifest, indent=1, sort_keys=True).encode())
        _sync(f)
    _pause_for_tests("before-rename")
    sync_dir(temp)
    return files


def write_atomically(path: Path, data: bytes) -> None:
    """`data` as the file `path`, whole or not at all (temp file, fsync, rename, fsync folder)."""
    temp = path.with_name(f".{path.name}.tmp")
    with open(temp, "wb") as f:
        f.write(data)
        _sync(f)
    os.rename(temp, path)
    sync_dir(path.parent)


def _files_of(tensors: dict[str, torch.Tensor]) -> Iterable[list[str]]:
    """The tensors' keys cut into files of about _FILE_BYTES (at least one file, maybe empty)."""
    group: list[str] = []
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if group and size + nbytes > _FILE_BYTES:
            yield group
            group, size = [], 0
        group.append(key)
        size += nbytes
    yield group


def _sync(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())


def sync_dir(path: Path) -> None:
    """fsync a folder: the names created or renamed in it are on disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(path: Path) -> None:
    """Remove a checkpoint folder (or a temporary one), if there."""
    if not path.exists():
        return
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def _pausing(point: str) -> bool:
    marker, _, at = os.environ.get(PAUSE_ENV, "").rpartition("@")
    return bool(marker) and at == point and not os.path.exists(marker)


def _pause_for_tests(point: str) -> None:
    if not _pausing(point):
        return
    marker = os.environ[PAUSE_ENV].rpartition("@")[0]
    Path(marker).write_text(str(os.getpid()))
    while True:  # until killed: what a crash at this point leaves is what the test looks at
        time.sleep(3600)


# ---- reading ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    """What a checkpoint must belong to: the run, the shard and the OpenRunRequest it was opened by."""

    run_id: str
    shard_id: str
    open_digest: str


def read(folder: Path, expected: Expected, device: torch.device) -> Snapshot:
    """The checkpoint in `folder`, verified: its manifest, each file's size and SHA-256, its run,
    shard and placement. CheckpointError (one line naming the file) otherwise."""
    manifest = _manifest(folder / MANIFEST)
    for name, want in (("run_id", expected.run_id), ("shard_id", expected.shard_id)):
        if manifest[name] != want:
            raise CheckpointError(f"{folder / MANIFEST}: a checkpoint of {name} {manifest[name]!r}, not {want!r}")
    if manifest["open_run_sha256"] != expected.open_digest:
        raise CheckpointError(
            f"{folder / MANIFEST}: a checkpoint of another placement or spec of run {expected.run_id!r} "
            "(its OpenRun digest differs)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in manifest["files"].items():
        tensors.update(_tensors(folder / name, entry))
    return Snapshot(manifest["run_id"], manifest, {k: t.to(device) for k, t in tensors.items()})


def _manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable: {one_line(e)}") from None
    needed = ("format", "run_id", "shard_id", "sequence", "step", "open_run_sha256", "files", "run", "rule")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    if missing := [k for k in needed if k not in manifest]:
        raise CheckpointError(f"{path}: the manifest lacks {', '.join(missing)}")
    files = manifest["files"]
    if not isinstance(files, dict) or any(not _plain_name(n) for n in files):
        raise CheckpointError(f"{path}: `files` must name files of the checkpoint's folder")
    return manifest


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and name.endswith(".safetensors") and "/" not in name and not name.startswith(".")


def _tensors(path: Path, entry: Any) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors, once its size and SHA-256 match the manifest's `entry`."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable: {one_line(e)}") from None
    if not isinstance(entry, dict) or len(data) != entry.get("bytes"):
        raise CheckpointError(f"{path}: truncated or extended: {len(data)} bytes, the manifest says {entry}")
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise CheckpointError(f"{path}: SHA-256 mismatch: the file changed after it was written")
    try:
        return safetensors.torch.load(data)
    except Exception as e:  # safetensors raises its own SafetensorError: the file is not one
        raise CheckpointError(f"{path}: not a safetensors file: {one_line(e)}") from None


# ---- restoring ----------------------------------------------------------------------------------


def restore(snapshot: Snapshot, request: shard_pb2.OpenRunRequest, device: torch.device) -> tuple[RunState, ShardRule]:
    """The run as `request` opens it, with the state `snapshot` holds (read by `read`: its
    tensors on `device`). CheckpointError when the snapshot does not fit the run."""
    run, rule = open_run(request, device)
    m = snapshot.manifest
    try:
        _restore_parts(run, m["run"]["parts"], Saved("run/", tensors=snapshot.tensors))
        _restore_run(run, m["run"])
        rule.load(Saved("rule/", fields=m["rule"], tensors=snapshot.tensors))
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise CheckpointError(
            f"{m.get('run_id')!r} checkpoint {m.get('sequence')}: does not fit its run: {one_line(e)}"
        ) from None
    return run, rule


def _restore_parts(run: RunState, entries: list[dict[str, Any]], saved: Saved) -> None:
    opt = run.optimizer
    if sorted(part_of(e["part"]) for e in entries) != sorted(run.parts):
        raise ValueError("its parts are not those the placement gives this shard")
    order = list(opt.params)
    state: dict[int, dict[str, Any]] = {}
    for e in entries:
        key = part_of(e["part"])
        part, values = run.parts[key], saved.get(e["values"])
        if values.dtype != torch.float32 or values.shape != part.values.shape:
            raise ValueError(f"part {key[0]}/{key[1]}: values of {values.dtype} {list(values.shape)}")
        part.values.copy_(values)
        part.version, part.initialised = int(e["version"]), bool(e["initialised"])
        opt.updates[key] = int(e["updates"])
        if e["optimizer"]:
            state[order.index(key)] = {
                name: saved.get(v["tensor"]) if "tensor" in v else v["value"] for name, v in e["optimizer"].items()
            }
    if opt.opt is not None and state:
        loaded = opt.opt.state_dict()
        loaded["state"] = state
        opt.opt.load_state_dict(loaded)


def _restore_run(run: RunState, fields: dict[str, Any]) -> None:
    run.membership_epoch = int(fields["membership_epoch"])
    run.restore_epoch = int(fields.get("restore_epoch", 0))  # absent before restores existed
    if "workers" in fields:  # a resumed run's, not those OpenRun named
        run.workers = frozenset(int(w) for w in fields["workers"])
    if "ranks" in fields:  # absent before workers could join
        run.ranks = {int(w): int(r) for w, r in fields["ranks"]}
        if not run.workers <= run.ranks.keys():
            raise ValueError(f"workers {sorted(run.workers - run.ranks.keys())} have no rank")
    else:
        run.set_workers(sorted(run.workers))
    live = {int(w) for w in fields["live_workers"]}
    if not live <= run.workers:
        raise ValueError(f"live workers {sorted(live - run.workers)} are not the run's")
    run.live_workers = live
    for worker, step, staleness in fields["applied"]:
        run.applied.setdefault(int(worker), {})[int(step)] = int(staleness)
    run.pushes, run.bytes_pushed = int(fields["pushes"]), int(fields["bytes_pushed"])
    run.bytes_pulled = int(fields["bytes_pulled"])
    run.ended = bool(fields["ended"])
