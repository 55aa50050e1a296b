"""The coordinator's memory of its runs, in SQLite: what a restarted coordinator takes back.

One file, `coordinator.db`, in the state dir: runs (spec, status, placement, membership epoch,
summary figures), every event WatchRun showed (the run's status after it, and the report that caused
it), and a few counters. The coordinator is the only writer (a lock file beside the database keeps a
second one out); it writes through, under its own lock, so the file follows the order of its state
changes.

WAL mode with `synchronous=NORMAL`: a commit is an append to the write-ahead log, without an fsync,
so a coordinator taking a metrics report per worker every few steps does not wait on the disk; a
killed coordinator (SIGKILL, a crash) loses nothing committed, since the log is in the OS's page
cache. Only a power loss or kernel crash can drop the last commits before a checkpoint, and never
leaves a torn database. FULL would fsync every report for a guarantee against power loss that
buys little: a power loss takes the shards' parameters (in memory) with it, so the runs it would
keep could not go on anyway.

Without a state dir the same tables live in memory (`:memory:`): one code path either way, and
nothing is written where no one asked for files.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from gradps import run_figures
from gradps.errors import DataLost
from gradps.v1 import coordinator_pb2 as cpb
from gradps.v1 import run_pb2, shard_pb2

_LOGGER = logging.getLogger("gradps.coordinator")
DB_NAME = "coordinator.db"
LOCK_NAME = "coordinator.lock"
# Seconds a statement waits for SQLite's own lock (a reader such as the sqlite3 shell).
_BUSY_TIMEOUT_S = 5.0

# Each entry takes the schema from version i to i + 1, in one transaction; a database written by a
# newer gradps (a version beyond the last) is refused rather than misread.
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE runs (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- submission order: ListRuns lists oldest first
            run_id TEXT NOT NULL UNIQUE,
            spec BLOB NOT NULL,                     -- gradps.v1.RunSpec
            status BLOB NOT NULL,                   -- gradps.v1.RunStatus without spec and latest
            state TEXT NOT NULL,                    -- pending, running, completed, failed, stopped
            message TEXT NOT NULL,
            submitted_at REAL NOT NULL,
            started_at REAL NOT NULL,
            finished_at REAL NOT NULL,
            epoch INTEGER NOT NULL,                 -- membership epoch: +1 per worker lost
            placement BLOB,                         -- gradps.v1.Placement, once the first worker asked
            opened_on_shards INTEGER NOT NULL,      -- the shards hold its parameters
            -- Summary of the workers' latest reports, for a reader with the sqlite3 shell; the
            -- coordinator reads the reports themselves (events).
            steps INTEGER NOT NULL,
            total_steps INTEGER NOT NULL,
            samples INTEGER NOT NULL,
            loss REAL,
            test_accuracy REAL,
            bytes_pushed INTEGER NOT NULL,
            bytes_pulled INTEGER NOT NULL
        )""",
        """CREATE TABLE events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,   -- the order WatchRun replays them in
            run_id TEXT NOT NULL,
            worker_id INTEGER,                      -- of the report, when one caused the event
            status BLOB NOT NULL,                   -- the run's RunStatus after it, without spec and latest
            metrics BLOB                            -- gradps.v1.Metrics: the report
        )""",
        "CREATE INDEX events_by_run ON events (run_id, worker_id, id)",
        """CREATE TABLE run_workers (                -- who a run's workers are, for GetCluster after a restart
            run_id TEXT NOT NULL,
            worker_id INTEGER NOT NULL,
            name TEXT NOT NULL,
            device TEXT NOT NULL,
            PRIMARY KEY (run_id, worker_id)
        )""",
        "CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
        "CREATE TABLE schema_version (version INTEGER NOT NULL)",
        "INSERT INTO schema_version VALUES (0)",
    ),
)
SCHEMA_VERSION = len(_MIGRATIONS)

_M = TypeVar("_M", bound=Message)

_UPSERT_RUN = (
    "INSERT INTO runs (run_id, spec, status, state, message, submitted_at, started_at, finished_at, epoch, "
    "placement, opened_on_shards, steps, total_steps, samples, loss, test_accuracy, bytes_pushed, bytes_pulled) "
    "VALUES (:run_id, :spec, :status, :state, :message, :submitted_at, :started_at, :finished_at, :epoch, "
    "NULL, 0, :steps, :total_steps, :samples, :loss, :test_accuracy, :bytes_pushed, :bytes_pulled) "
    "ON CONFLICT (run_id) DO UPDATE SET status = excluded.status, state = excluded.state, "
    "message = excluded.message, started_at = excluded.started_at, finished_at = excluded.finished_at, "
    "epoch = excluded.epoch, steps = excluded.steps, total_steps = excluded.total_steps, "
    "samples = excluded.samples, loss = excluded.loss, test_accuracy = excluded.test_accuracy, "
    "bytes_pushed = excluded.bytes_pushed, bytes_pulled = excluded.bytes_pulled"
)

_SET_COUNTER = (
    "INSERT INTO counters (name, value) VALUES (?, ?) ON CONFLICT (name) DO UPDATE SET value = excluded.value"
)

_STATES = {
    cpb.RUN_STATE_PENDING: "pending",
    cpb.RUN_STATE_RUNNING: "running",
    cpb.RUN_STATE_COMPLETED: "completed",
    cpb.RUN_STATE_FAILED: "failed",
    cpb.RUN_STATE_STOPPED: "stopped",
}


class StoreError(Exception):
    """The state dir cannot be used (one line, for the coordinator's start-up error)."""


@dataclass(frozen=True)
class StoredRun:
    """A run as the previous coordinator on this state dir left it."""

    # Its `latest` is empty: the workers' latest reports are `latest`, by worker id.
    status: cpb.RunStatus
    latest: dict[int, cpb.Metrics]
    placement: shard_pb2.Placement | None
    epoch: int
    opened_on_shards: bool
    # The name and device of each of its workers, by id.
    workers: dict[int, tuple[str, str]]


class RunStore:
    """Runs, their events and counters in one SQLite database; every method is thread-safe."""

    def __init__(self, connection: sqlite3.Connection, lock_fd: int | None, where: str) -> None:
        """Use `RunStore.open`."""
        self._db = connection
        self._lock_fd = lock_fd
        self._lock = threading.Lock()
        # Where the database is, for log lines.
        self.where = where
        # A failed write is logged once, until one succeeds again (a full disk would repeat it).
        self._failing = False
        self._closed = False

    @classmethod
    def open(cls, state_dir: Path | None) -> RunStore:
        """The store in `state_dir` (created if missing), or in memory for None. StoreError with one
        line when the folder cannot be written, another coordinator uses it, or its database is not
        one this version can read."""
        if state_dir is None:
            return cls(_connect(":memory:"), None, "memory")
        lock = state_dir / LOCK_NAME
        created = not lock.exists()
        lock_fd = _lock_dir(state_dir)
        try:
            connection = _connect(str(state_dir / DB_NAME))
        except BaseException:
            if created:  # a refused start leaves the folder as it found it
                lock.unlink(missing_ok=True)
            os.close(lock_fd)
            raise
        return cls(connection, lock_fd, str(state_dir / DB_NAME))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._db.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    # ---- reading (at start-up, and when a restored run is first watched) ----------------------

    def runs(self) -> list[StoredRun]:
        """Every stored run, oldest first. StoreError when a row cannot be read."""
        try:
            with self._lock:
                latest = self._latest()
                rows = self._db.execute(
                    "SELECT run_id, spec, status, epoch, placement, opened_on_shards FROM runs ORDER BY seq"
                ).fetchall()
                workers: dict[str, dict[int, tuple[str, str]]] = {}
                for run_id, worker_id, name, device in self._db.execute("SELECT * FROM run_workers"):
                    workers.setdefault(run_id, {})[worker_id] = (name, device)
        except sqlite3.DatabaseError as e:
            raise StoreError(_why(e)) from None
        runs = []
        for run_id, spec, status_bytes, epoch, placement_bytes, opened in rows:
            status = _parse(cpb.RunStatus, status_bytes, run_id)
            status.spec.CopyFrom(_parse(run_pb2.RunSpec, spec, run_id))
            placement = _parse(shard_pb2.Placement, placement_bytes, run_id) if placement_bytes is not None else None
            runs.append(
                StoredRun(status, latest.get(run_id, {}), placement, epoch, bool(opened), workers.get(run_id, {}))
            )
        return runs

    def _latest(self) -> dict[str, dict[int, cpb.Metrics]]:
        rows = self._db.execute(
            "SELECT e.run_id, e.worker_id, e.metrics FROM events AS e JOIN "
            "(SELECT MAX(id) AS id FROM events WHERE worker_id IS NOT NULL GROUP BY run_id, worker_id) AS last "
            "ON e.id = last.id"
        ).fetchall()
        latest: dict[str, dict[int, cpb.Metrics]] = {}
        for run_id, worker_id, metrics in rows:
            latest.setdefault(run_id, {})[worker_id] = _parse(cpb.Metrics, metrics, run_id)
        return latest

    def history(self, run_id: str, spec: run_pb2.RunSpec) -> list[cpb.WatchRunResponse]:
        """The events of `run_id` as WatchRun sent them: each with the run's status after it (the
        spec taken from `spec`, the latest reports replayed) and the report that caused it.
        DataLost when they cannot be read."""
        try:
            with self._lock:
                rows = self._db.execute("SELECT status, metrics FROM events WHERE run_id = ? ORDER BY id", (run_id,))
                stored = rows.fetchall()
            latest: dict[int, cpb.Metrics] = {}
            events = []
            for status_bytes, metrics_bytes in stored:
                run = _parse(cpb.RunStatus, status_bytes, run_id)
                run.spec.CopyFrom(spec)
                metrics = _parse(cpb.Metrics, metrics_bytes, run_id) if metrics_bytes is not None else None
                if metrics is not None:
                    latest[metrics.worker_id] = metrics
                run.latest.extend(latest[w] for w in sorted(latest))
                events.append(cpb.WatchRunResponse(run=run, metrics=metrics))
        except (sqlite3.Error, StoreError) as e:
            raise DataLost(f"the events of run {run_id} cannot be read from {self.where}: {e}") from None
        return events

    def counter(self, name: str) -> int:
        """A counter's value; 0 when never set."""
        with self._lock:
            row = self._db.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()
        return int(row[0]) if row else 0

    # ---- writing (as the coordinator's state changes) -----------------------------------------

    def save_event(self, event: cpb.WatchRunResponse, epoch: int) -> None:
        """The run's status after `event`, and the event itself (one transaction)."""
        status = event.run
        bare = _bare(status)
        metrics = event.metrics if event.HasField("metrics") else None
        row = {
            "run_id": status.run_id,
            "spec": status.spec.SerializeToString(),
            "status": bare,
            "state": _STATES.get(status.state, "unspecified"),
            "message": status.message,
            "submitted_at": status.submitted_at,
            "started_at": status.started_at,
            "finished_at": status.finished_at,
            "epoch": epoch,
            "total_steps": status.total_steps,
            **_summary(status.latest),
        }
        event_row = (
            status.run_id,
            metrics.worker_id if metrics is not None else None,
            bare,
            metrics.SerializeToString() if metrics is not None else None,
        )
        self._write(
            "an event of run " + status.run_id,
            (_UPSERT_RUN, row),
            ("INSERT INTO events (run_id, worker_id, status, metrics) VALUES (?, ?, ?, ?)", event_row),
        )

    def save_placement(self, run_id: str, placement: shard_pb2.Placement | None, opened_on_shards: bool) -> None:
        """The run's placement table, and whether its shards hold its parameters."""
        table = placement.SerializeToString() if placement is not None else None
        self._write(
            "the placement of run " + run_id,
            ("UPDATE runs SET placement = ?, opened_on_shards = ? WHERE run_id = ?", (table, opened_on_shards, run_id)),
        )

    def save_workers(self, run_id: str, workers: Iterable[tuple[int, str, str]]) -> None:
        """The id, name and device of each of the run's workers."""
        rows = [("INSERT OR REPLACE INTO run_workers VALUES (?, ?, ?, ?)", (run_id, *w)) for w in workers]
        self._write("the workers of run " + run_id, *rows)

    def delete_run(self, run_id: str) -> None:
        """Forget the run, its events and workers."""
        self._write(
            "the deletion of run " + run_id,
            ("DELETE FROM events WHERE run_id = ?", (run_id,)),
            ("DELETE FROM run_workers WHERE run_id = ?", (run_id,)),
            ("DELETE FROM runs WHERE run_id = ?", (run_id,)),
        )

    def set_counter(self, name: str, value: int) -> None:
        self._write("counter " + name, (_SET_COUNTER, (name, value)))

    def _write(self, what: str, *statements: tuple[str, Sequence[object] | Mapping[str, object]]) -> None:
        """The statements in one transaction. A failure (disk full, say) is logged, not raised: the
        coordinator goes on serving from memory, and its store lags until a write succeeds again."""
        with self._lock:
            try:
                with _transaction(self._db):
                    for sql, parameters in statements:
                        self._db.execute(sql, parameters)
            except sqlite3.Error as e:
                if not self._failing and not self._closed:  # closed: the coordinator is stopping
                    _LOGGER.error("could not save %s in %s: %s", what, self.where, e)
                self._failing = True
            else:
                if self._failing:
                    _LOGGER.warning("saving in %s works again", self.where)
                self._failing = False


@contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        with suppress(sqlite3.Error):  # a failed COMMIT leaves the transaction open
            if db.in_transaction:
                db.execute("ROLLBACK")
        raise


def _lock_dir(state_dir: Path) -> int:
    """Create `state_dir` and take its lock file (held until the process ends): one writer."""
    if state_dir.exists() and not state_dir.is_dir():
        raise StoreError("not a folder")
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(f"cannot create it: {e.strerror or e}") from None
    try:
        fd = os.open(state_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise StoreError(f"cannot write in it: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise StoreError(f"another coordinator (pid {holder or '?'}) uses it") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _connect(path: str) -> sqlite3.Connection:
    """Open, check and migrate the database at `path`; StoreError with one line if it cannot."""
    try:
        db = sqlite3.connect(path, timeout=_BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as e:
        raise StoreError(f"cannot open {DB_NAME}: {e}") from None
    try:
        # Checked before anything is written: a database this version refuses stays as it was.
        problems = [row[0] for row in db.execute("PRAGMA quick_check")]
        if problems != ["ok"]:
            raise StoreError(f"{DB_NAME} is corrupt ({problems[0]}); move it away to start afresh")
        _check_version(_schema_version(db))
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        _migrate(db)
        # A database opened read-only (its file's mode, a read-only mount) fails here, not later.
        with _transaction(db):
            db.execute(_SET_COUNTER, ("opened_at", int(time.time())))
    except sqlite3.DatabaseError as e:
        db.close()
        raise StoreError(_why(e)) from None
    except BaseException:
        db.close()
        raise
    return db


def _why(e: sqlite3.DatabaseError) -> str:
    text = str(e)
    if isinstance(e, sqlite3.OperationalError) and ("readonly" in text or "read-only" in text):
        return f"cannot write {DB_NAME}: {text}"
    if isinstance(e, sqlite3.OperationalError) and "locked" in text:
        return f"{DB_NAME} is locked by another process: {text}"
    return f"{DB_NAME} is not a usable database ({text}); move it away to start afresh"


def _check_version(version: int) -> None:
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{DB_NAME} has schema version {version}, from a newer gradps (this one reads up to "
            f"{SCHEMA_VERSION}); upgrade, or use another state dir"
        )


def _migrate(db: sqlite3.Connection) -> None:
    with _transaction(db):
        version = _schema_version(db)
        _check_version(version)
        for step in range(version, SCHEMA_VERSION):
            for statement in _MIGRATIONS[step]:
                db.execute(statement)
            db.execute("UPDATE schema_version SET version = ?", (step + 1,))
            _LOGGER.info("state database at schema version %d", step + 1)


def _schema_version(db: sqlite3.Connection) -> int:
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "schema_version" not in tables:
        if tables - {"sqlite_sequence"}:
            raise StoreError(f"{DB_NAME} holds tables but no schema version: not a gradps coordinator's database")
        return 0
    rows = db.execute("SELECT version FROM schema_version").fetchall()
    if len(rows) != 1 or not isinstance(rows[0][0], int):
        raise StoreError(f"{DB_NAME} has a broken schema_version table; move it away to start afresh")
    return int(rows[0][0])


def _parse(kind: type[_M], data: bytes, run_id: str) -> _M:
    message = kind()
    try:
        message.ParseFromString(data)
    except DecodeError:
        raise StoreError(
            f"{DB_NAME}: run {run_id}: an unreadable {kind.__name__}; move it away to start afresh"
        ) from None
    return message


def _bare(status: cpb.RunStatus) -> bytes:
    """`status` without its spec (stored once per run) and latest reports (stored as events)."""
    bare = cpb.RunStatus()
    bare.CopyFrom(status)
    bare.ClearField("spec")
    bare.ClearField("latest")
    return bare.SerializeToString()


def _summary(latest: Iterable[cpb.Metrics]) -> dict[str, float | None]:
    """The summary columns from the workers' latest reports, as `gradps runs` shows them."""
    reports = list(latest)
    return {
        "steps": run_figures.highest_step(reports),
        "samples": sum(m.samples for m in reports),
        "loss": run_figures.mean_loss(reports),
        "test_accuracy": run_figures.latest_test_accuracy(reports),
        "bytes_pushed": sum(m.bytes_pushed for m in reports),
        "bytes_pulled": sum(m.bytes_pulled for m in reports),
    }
