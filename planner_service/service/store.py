"""Durable state behind one small interface.

The service keeps its authoritative state in memory and writes every
acknowledged change through a `Store` as one atomic `Batch` before it answers.
`SqliteStore` is the embedded default: WAL with synchronous=NORMAL, so a
committed batch survives `kill -9` at once (its frames are in the operating
system's cache), and power loss once `sync()` has flushed the log. The
service commits under its state lock and syncs after releasing it, before it
answers: callers that committed meanwhile share one flush (group commit), so
the lock is not held for a disk flush per change. A replicated database
(PostgreSQL) can implement the same protocol.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from planner_service.domain.state import Kind, Location, Placement, StateObject, Tier

# (t, kind, from model, to model, gap seconds, context tokens): kind "handoff" (from, to), "gap" (gap
# seconds: a turn's tool and think time), "request" (to: its model; the session's context after it) or "end" (from:
# the model of the ended session's last request)
Observation = tuple[float, str, str | None, str | None, float | None, int | None]


@dataclass
class Batch:
    """Changes that commit together or not at all."""

    meta: dict[str, Any] = field(default_factory=dict)  # key -> JSON value
    sessions: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # id -> JSON, None deletes
    events: list[tuple[str, str, float]] = field(default_factory=list)  # (id, type, at)
    operations: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> JSON record
    # id -> fields of a stored record to set (a plan that adopts a queued operation, or supersedes one, changes
    # two or three fields of hundreds of records: written alone, not as whole records); after `operations`
    operation_updates: dict[str, dict[str, Any]] = field(default_factory=dict)
    observations: list[Observation] = field(default_factory=list)
    # (object, location) -> the bytes held there now, 0 where nothing is left: only the entries that changed
    placement: Placement = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(
            self.meta
            or self.sessions
            or self.events
            or self.operations
            or self.operation_updates
            or self.observations
            or self.placement
        )

    def merge(self, other: Batch) -> None:
        self.meta.update(other.meta)
        self.sessions.update(other.sessions)
        self.events.extend(other.events)
        self.operations.update(other.operations)
        for oid, fields in other.operation_updates.items():
            self.operation_updates.setdefault(oid, {}).update(fields)
        self.observations.extend(other.observations)
        self.placement.update(other.placement)


@dataclass
class Stored:
    """Everything a store holds, as read back on start."""

    meta: dict[str, Any]
    sessions: dict[str, dict[str, Any]]
    event_ids: dict[str, float]  # id -> when it was applied
    operations: dict[str, dict[str, Any]]
    observations: list[Observation]  # oldest first
    placement: Placement  # the confirmed placement

    @property
    def empty(self) -> bool:
        return "base" not in self.meta


class Store(Protocol):
    def open(self) -> None: ...

    def close(self) -> None: ...

    def load(self, observations_since: float) -> Stored: ...

    def write(self, batch: Batch) -> None:
        """Commit `batch` atomically before returning: durable against a crash of this process at once."""

    def sync(self) -> None:
        """Make every batch committed so far durable against power loss too. Called without the service's
        lock; concurrent callers share one flush."""

    def prune(self, observations_before: float, events_before: float) -> None:
        """Forget what no longer matters: old observations and event ids, the oldest finished operations."""


class SchemaError(RuntimeError):
    """A database this build cannot open: written by a newer build, or of a shape no version had."""


# The schema as numbered steps: step n takes a database from version n - 1 to n, and `PRAGMA user_version`
# records the last step applied. A change to the tables is a new step at the end; a step once released is
# never edited, since databases out there were made by it.
MIGRATIONS: tuple[str, ...] = (
    # 1: the first release
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE sessions (id TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE events (id TEXT PRIMARY KEY, type TEXT NOT NULL, at REAL NOT NULL);
    CREATE TABLE operations (
        id TEXT PRIMARY KEY, epoch INTEGER NOT NULL, node TEXT NOT NULL, state TEXT NOT NULL, value TEXT NOT NULL
    );
    CREATE INDEX operations_state ON operations (state);
    CREATE TABLE observations (
        t REAL NOT NULL, kind TEXT NOT NULL, from_model TEXT, to_model TEXT, gap_seconds REAL
    );
    CREATE INDEX observations_t ON observations (t);
    """,
    # 2: requests are observed with the session's context after them
    "ALTER TABLE observations ADD COLUMN tokens INTEGER;",
    # 3: the confirmed placement as one row per (object, location), so that a done report writes the two entries
    # it changed instead of the whole placement; an object's absent precision or session is '' (a key column is
    # never NULL: NULLs would not collide). The placement meta row, and its copy in the SRV row, move here.
    """
    CREATE TABLE placement (
        kind TEXT NOT NULL, model TEXT NOT NULL, precision TEXT NOT NULL, session TEXT NOT NULL,
        tier TEXT NOT NULL, location TEXT NOT NULL, bytes INTEGER NOT NULL,
        PRIMARY KEY (kind, model, precision, session, tier, location)
    ) WITHOUT ROWID;
    INSERT OR REPLACE INTO placement
        SELECT json_extract(e.value, '$.object.kind'), json_extract(e.value, '$.object.model'),
            coalesce(json_extract(e.value, '$.object.precision'), ''),
            coalesce(json_extract(e.value, '$.object.session'), ''),
            json_extract(e.value, '$.location.tier'),
            coalesce(json_extract(e.value, '$.location.gpu'), json_extract(e.value, '$.location.node')),
            json_extract(e.value, '$.bytes')
        FROM meta, json_each(meta.value) AS e
        WHERE meta.key = 'placement' AND json_extract(e.value, '$.bytes') > 0;
    DELETE FROM meta WHERE key = 'placement';
    UPDATE meta SET value = json_remove(value, '$.placement') WHERE key = 'srv';
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)


def _unversioned_version(db: sqlite3.Connection) -> int:
    """The version of a database that records none (`user_version` 0): empty, or made before versions were
    recorded, whose shape says which step it had reached."""
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not tables:
        return 0
    expected = {"meta", "sessions", "events", "operations", "observations"}
    if tables != expected:
        raise SchemaError(
            f"the database records no schema version and its tables {sorted(tables)} are not "
            f"StateBudget's {sorted(expected)}"
        )
    columns = {row[1] for row in db.execute("PRAGMA table_info(observations)")}
    return 2 if "tokens" in columns else 1


def migrate(db: sqlite3.Connection, path: object) -> int:
    """Bring the database to `SCHEMA_VERSION` in one transaction (all steps or none); returns the version it
    had. A database of a newer version is refused: this build would misread what it does not know."""
    db.execute("BEGIN IMMEDIATE")
    try:
        (recorded,) = db.execute("PRAGMA user_version").fetchone()
        if recorded > SCHEMA_VERSION:
            raise SchemaError(
                f"database {path} has schema version {recorded}, newer than this build's {SCHEMA_VERSION}: "
                "run the build that wrote it, or start from a fresh database (statebudget serve --reset)"
            )
        found = recorded or _unversioned_version(db)
        for step in MIGRATIONS[found:]:
            # one statement at a time: executescript would commit the transaction first
            for statement in filter(str.strip, step.split(";")):
                db.execute(statement)
        if recorded != SCHEMA_VERSION:
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return int(found)


_COLUMNS = frozenset({"epoch", "state"})  # fields of an operation record the table keeps as columns too
_FIELD = re.compile(r"[a-z_]+")


def _field_updates(updates: dict[str, dict[str, Any]]) -> list[tuple[str, list[tuple[Any, ...]]]]:
    """One UPDATE per set of field names: each field is set in the stored JSON record by `json_set`, its value
    given as JSON text (`json(?)`, so that a float keeps every digit and a string stays a string), and in its
    column when the table has one."""
    groups: dict[tuple[str, ...], list[tuple[Any, ...]]] = defaultdict(list)
    for oid, fields in updates.items():
        names = tuple(sorted(fields))
        if not all(_FIELD.fullmatch(n) for n in names):
            raise ValueError(f"operation {oid}: not field names: {names}")
        values = [fields[n] for n in names if n in _COLUMNS]
        groups[names].append((*(json.dumps(fields[n]) for n in names), *values, oid))
    statements = []
    for names, rows in groups.items():
        paths = ", ".join(f"'$.{n}', json(?)" for n in names)
        columns = "".join(f", {n} = ?" for n in names if n in _COLUMNS)
        statements.append((f"UPDATE operations SET value = json_set(value, {paths}){columns} WHERE id = ?", rows))
    return statements


def _placement_row(obj: StateObject, loc: Location) -> tuple[str, str, str, str, str, str]:
    """The key columns of a placement row."""
    return (obj.kind.value, obj.model, obj.precision or "", obj.session or "", loc.tier.value, loc.id)


def _placement_entry(
    kind: str, model: str, precision: str, session: str, tier: str, location: str
) -> tuple[StateObject, Location]:
    return StateObject(Kind(kind), model, precision or None, session or None), Location(Tier(tier), location)


# operations in these states are history: kept for reports' idempotency, not loaded into the queues
FINAL_KEEP = 5000


_UPSERT_META = "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value"
_UPSERT_SESSION = "INSERT INTO sessions (id, value) VALUES (?, ?) ON CONFLICT (id) DO UPDATE SET value = excluded.value"
_DELETE_SESSION = "DELETE FROM sessions WHERE id = ?"
_INSERT_EVENT = "INSERT OR IGNORE INTO events (id, type, at) VALUES (?, ?, ?)"
_UPSERT_OPERATION = (
    "INSERT INTO operations (id, epoch, node, state, value) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (id) DO UPDATE SET state = excluded.state, value = excluded.value"
)
_INSERT_OBSERVATION = (
    "INSERT INTO observations (t, kind, from_model, to_model, gap_seconds, tokens) VALUES (?, ?, ?, ?, ?, ?)"
)
_UPSERT_PLACEMENT = (
    "INSERT INTO placement (kind, model, precision, session, tier, location, bytes) VALUES (?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (kind, model, precision, session, tier, location) DO UPDATE SET bytes = excluded.bytes"
)
_DELETE_PLACEMENT = (
    "DELETE FROM placement WHERE kind = ? AND model = ? AND precision = ? AND session = ? AND tier = ? AND location = ?"
)


def _statements(batch: Batch) -> list[tuple[str, list[tuple[Any, ...]]]]:
    """The statements that commit `batch`, each with its rows, leaving out those with none."""
    placement = [(*_placement_row(obj, loc), n) for (obj, loc), n in batch.placement.items()]
    statements: list[tuple[str, list[tuple[Any, ...]]]] = [
        (_UPSERT_META, [(k, json.dumps(v)) for k, v in batch.meta.items()]),
        (_UPSERT_SESSION, [(k, json.dumps(v)) for k, v in batch.sessions.items() if v is not None]),
        (_DELETE_SESSION, [(k,) for k, v in batch.sessions.items() if v is None]),
        (_INSERT_EVENT, list(batch.events)),
        (
            _UPSERT_OPERATION,
            [(k, v["epoch"], v["node"], v["state"], json.dumps(v)) for k, v in batch.operations.items()],
        ),
        *_field_updates(batch.operation_updates),
        (_INSERT_OBSERVATION, list(batch.observations)),
        (_UPSERT_PLACEMENT, [row for row in placement if row[-1] > 0]),
        (_DELETE_PLACEMENT, [row[:-1] for row in placement if row[-1] <= 0]),
    ]
    return [(statement, rows) for statement, rows in statements if rows]


class SqliteStore:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._db: sqlite3.Connection | None = None
        self._flush = threading.Condition()  # guards the three below
        self._committed = 0  # batches committed
        self._synced = 0  # of them, flushed to disk
        self._flushing = False  # a caller is flushing (the others wait for it, then flush what it did not cover)

    def open(self) -> None:
        if str(self._path) != ":memory:":
            self._path.parent.mkdir(parents=True, exist_ok=True)
        # the service serializes every call under its own lock
        self._db = sqlite3.connect(str(self._path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # the commit writes the log; `sync()` flushes it
        try:
            migrate(self._db, self._path)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("store is not open")
        return self._db

    def load(self, observations_since: float) -> Stored:
        db = self.db
        meta = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM meta")}
        sessions = {k: json.loads(v) for k, v in db.execute("SELECT id, value FROM sessions")}
        event_ids = {event_id: at for event_id, at in db.execute("SELECT id, at FROM events")}
        operations = {k: json.loads(v) for k, v in db.execute("SELECT id, value FROM operations ORDER BY rowid")}
        observations: list[Observation] = list(
            db.execute(
                "SELECT t, kind, from_model, to_model, gap_seconds, tokens FROM observations WHERE t >= ? ORDER BY t, rowid",
                (observations_since,),
            )
        )
        placement: Placement = {}
        for *key, nbytes in db.execute(
            "SELECT kind, model, precision, session, tier, location, bytes FROM placement WHERE bytes > 0"
        ):
            placement[_placement_entry(*key)] = int(nbytes)
        return Stored(meta, sessions, event_ids, operations, observations, placement)

    def write(self, batch: Batch) -> None:
        if not batch:
            return
        statements = _statements(batch)  # rows made first: every call into SQLite lets go of the GIL, and
        db = self.db  # under load each costs a turn of it, so only the statements with rows are run
        db.execute("BEGIN IMMEDIATE")
        try:
            for statement, rows in statements:
                db.executemany(statement, rows)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        with self._flush:
            self._committed += 1

    def sync(self) -> None:
        """Flush the write-ahead log once for every batch committed before the call (group commit): a caller
        that finds a flush running waits for it, and the first to find none flushes for all that wait."""
        with self._flush:
            target = self._committed
            while self._synced < target:
                if self._flushing:
                    self._flush.wait()
                    continue
                self._flushing, covered = True, self._committed
                self._flush.release()
                try:
                    self._flush_log()
                finally:
                    self._flush.acquire()
                    self._flushing = False
                    self._flush.notify_all()
                self._synced = max(self._synced, covered)

    def _flush_log(self) -> None:
        """fsync the write-ahead log: the commits it holds (a checkpoint flushes what it moves out of it)."""
        if str(self._path) == ":memory:":
            return
        fd = os.open(f"{self._path}-wal", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def prune(self, observations_before: float, events_before: float) -> None:
        """Forget observations that left the window, event ids past their retention, old finished operations."""
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        db.execute("DELETE FROM observations WHERE t < ?", (observations_before,))
        db.execute("DELETE FROM events WHERE at < ?", (events_before,))
        # the newest by plan position, as memory keeps them (`Live.prune`): not by insertion, since an operation
        # a later plan repeats keeps its row and takes that plan's epoch
        db.execute(
            "DELETE FROM operations WHERE state IN ('done', 'failed', 'superseded') AND rowid NOT IN "
            "(SELECT rowid FROM operations WHERE state IN ('done', 'failed', 'superseded') "
            "ORDER BY epoch DESC, json_extract(value, '$.seq') DESC LIMIT ?)",
            (FINAL_KEEP,),
        )
        db.execute("COMMIT")
