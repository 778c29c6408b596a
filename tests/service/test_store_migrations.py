"""The SQLite schema's versions: `PRAGMA user_version` and the ordered steps that bring an older database up.

Each older database is made here from the DDL of the build that wrote it (git history of
planner_service/service/store.py: the first release had no `observations.tokens`; no build before this one
recorded a version)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from planner_service.domain.state import Location, StateObject, placement_to_json
from planner_service.service.store import MIGRATIONS, SCHEMA_VERSION, Batch, SchemaError, SqliteStore

# the DDL of the first release (commit 7d07529), which recorded no user_version
FIRST_RELEASE = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (id TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (id TEXT PRIMARY KEY, type TEXT NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS operations (
    id TEXT PRIMARY KEY, epoch INTEGER NOT NULL, node TEXT NOT NULL, state TEXT NOT NULL, value TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS operations_state ON operations (state);
CREATE TABLE IF NOT EXISTS observations (
    t REAL NOT NULL, kind TEXT NOT NULL, from_model TEXT, to_model TEXT, gap_seconds REAL
);
CREATE INDEX IF NOT EXISTS observations_t ON observations (t);
"""
# the builds from a350149 until versions were recorded: the first release's tables, `tokens` added
UNVERSIONED_WITH_TOKENS = FIRST_RELEASE.replace("gap_seconds REAL\n", "gap_seconds REAL, tokens INTEGER\n")

OPERATION = '{"id": "1.op-1", "epoch": 1, "node": "n1", "state": "done", "seq": 1}'


def make(path: Path, ddl: str, *, tokens: bool, user_version: int = 0) -> None:
    db = sqlite3.connect(path)
    db.executescript(ddl)
    db.execute("INSERT INTO meta VALUES ('base', '{\"cluster\": {}}')")
    db.execute("INSERT INTO sessions VALUES ('s1', '{\"id\": \"s1\"}')")
    db.execute("INSERT INTO events VALUES ('ev-1', 'request', 100.0)")
    db.execute("INSERT INTO operations VALUES ('1.op-1', 1, 'n1', 'done', ?)", (OPERATION,))
    if tokens:
        db.execute("INSERT INTO observations VALUES (100.0, 'request', NULL, 'planner', NULL, 3000)")
    else:
        db.execute("INSERT INTO observations VALUES (100.0, 'gap', NULL, NULL, 2.5)")
    if user_version:
        db.execute(f"PRAGMA user_version = {user_version}")
    db.commit()
    db.close()


def user_version(path: Path) -> int:
    db = sqlite3.connect(path)
    try:
        return int(db.execute("PRAGMA user_version").fetchone()[0])
    finally:
        db.close()


def opened(path: Path) -> SqliteStore:
    store = SqliteStore(path)
    store.open()
    return store


def assert_kept(store: SqliteStore, observation: tuple[object, ...]) -> None:
    stored = store.load(0.0)
    assert stored.meta == {"base": {"cluster": {}}}
    assert stored.sessions == {"s1": {"id": "s1"}}
    assert stored.event_ids == {"ev-1": 100.0}
    assert stored.operations["1.op-1"]["state"] == "done"
    assert stored.observations == [observation]


def test_a_fresh_database_gets_every_step_and_the_current_version(tmp_path: Path) -> None:
    store = opened(tmp_path / "new.db")
    store.close()
    assert user_version(tmp_path / "new.db") == SCHEMA_VERSION == len(MIGRATIONS)


@pytest.mark.parametrize(
    ("ddl", "tokens", "observation"),
    [
        (FIRST_RELEASE, False, (100.0, "gap", None, None, 2.5, None)),
        (UNVERSIONED_WITH_TOKENS, True, (100.0, "request", None, "planner", None, 3000)),
    ],
    ids=["first-release", "with-tokens"],
)
def test_an_unversioned_database_is_adopted_by_its_shape_and_migrated_with_its_data(
    tmp_path: Path, ddl: str, tokens: bool, observation: tuple[object, ...]
) -> None:
    path = tmp_path / "old.db"
    make(path, ddl, tokens=tokens)
    store = opened(path)
    try:
        assert_kept(store, observation)
        columns = {row[1] for row in store.db.execute("PRAGMA table_info(observations)")}
        assert "tokens" in columns
    finally:
        store.close()
    assert user_version(path) == SCHEMA_VERSION
    store = opened(path)  # a second open has nothing to do
    try:
        assert_kept(store, observation)
    finally:
        store.close()


def test_a_database_at_version_1_takes_the_later_steps(tmp_path: Path) -> None:
    path = tmp_path / "v1.db"
    make(path, FIRST_RELEASE, tokens=False, user_version=1)
    store = opened(path)
    try:
        assert_kept(store, (100.0, "gap", None, None, 2.5, None))
    finally:
        store.close()
    assert user_version(path) == SCHEMA_VERSION


def test_a_version_2_placement_row_becomes_one_row_per_entry_and_leaves_the_srv_row(tmp_path: Path) -> None:
    """Until version 3 the confirmed placement was one meta row (and a copy inside the SRV row)."""
    path = tmp_path / "v2.db"
    make(path, UNVERSIONED_WITH_TOKENS, tokens=True, user_version=2)
    weights, experts = StateObject.weights("planner", "bf16"), StateObject.experts("reasoner")
    kv = StateObject.kv("planner", "s1")
    placement = {
        (weights, Location.gpu("n1-g0")): 16 * 2**30,
        (experts, Location.nvme("n1")): 3 * 2**30,
        (kv, Location.host("n2")): 12345,
    }
    entries = placement_to_json(placement)
    db = sqlite3.connect(path)
    db.execute("INSERT INTO meta VALUES ('placement', ?)", (json.dumps(entries),))
    srv = {"version": 7, "srv": [{"model": "planner", "state": "weights", "tier": "gpu"}], "placement": entries}
    db.execute("INSERT INTO meta VALUES ('srv', ?)", (json.dumps(srv),))
    db.commit()
    db.close()
    store = opened(path)
    try:
        stored = store.load(0.0)
        assert stored.placement == placement
        assert "placement" not in stored.meta
        assert stored.meta["srv"] == {"version": 7, "srv": srv["srv"]}
        store.write(Batch(placement={(kv, Location.host("n2")): 0, (kv, Location.gpu("n2-g0")): 999}))
        assert store.load(0.0).placement == {
            (weights, Location.gpu("n1-g0")): 16 * 2**30,
            (experts, Location.nvme("n1")): 3 * 2**30,
            (kv, Location.gpu("n2-g0")): 999,
        }
    finally:
        store.close()
    assert user_version(path) == SCHEMA_VERSION


def test_a_newer_database_is_refused_naming_both_versions_and_left_untouched(tmp_path: Path) -> None:
    path = tmp_path / "newer.db"
    make(path, UNVERSIONED_WITH_TOKENS, tokens=True, user_version=SCHEMA_VERSION + 1)
    with pytest.raises(
        SchemaError, match=rf"schema version {SCHEMA_VERSION + 1}, newer than this build's {SCHEMA_VERSION}"
    ):
        opened(path)
    assert user_version(path) == SCHEMA_VERSION + 1


def test_a_database_of_another_shape_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE accounts (id INTEGER)")
    db.commit()
    db.close()
    with pytest.raises(SchemaError, match="not StateBudget's"):
        opened(path)


def test_a_failing_step_leaves_the_database_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """All steps commit together or none does: a step that fails rolls back the ones before it."""
    import planner_service.service.store as store_module

    path = tmp_path / "old.db"
    make(path, FIRST_RELEASE, tokens=False)
    monkeypatch.setattr(store_module, "MIGRATIONS", (*MIGRATIONS, "ALTER TABLE no_such_table ADD COLUMN x"))
    monkeypatch.setattr(store_module, "SCHEMA_VERSION", len(MIGRATIONS) + 1)
    with pytest.raises(sqlite3.OperationalError):
        opened(path)
    assert user_version(path) == 0
    db = sqlite3.connect(path)
    assert "tokens" not in {row[1] for row in db.execute("PRAGMA table_info(observations)")}
    db.close()


@pytest.mark.slow
def test_serve_refuses_a_newer_database_with_the_message_and_no_traceback(tmp_path: Path) -> None:
    path = tmp_path / "newer.db"
    make(path, UNVERSIONED_WITH_TOKENS, tokens=True, user_version=SCHEMA_VERSION + 1)
    out = subprocess.run(
        [sys.executable, "-m", "planner_service.cli", "serve", "--db", str(path), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2, out.stderr
    message = " ".join(out.stderr.split())  # the console wraps the line where the path's length puts it
    assert f"schema version {SCHEMA_VERSION + 1}, newer than this build's {SCHEMA_VERSION}" in message
    assert "Traceback" not in out.stderr
