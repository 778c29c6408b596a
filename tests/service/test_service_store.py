"""SqliteStore: batches commit atomically and come back after reopening."""

from __future__ import annotations

import os
import sqlite3
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from planner_service.domain.demo import demo_scenario
from planner_service.metrics import Metrics
from planner_service.service.engine import ClusterService
from planner_service.service.inputs import RequestEvent
from planner_service.service.store import Batch, SqliteStore
from planner_service.settings import Settings


def op(op_id: str, state: str = "queued") -> dict:
    return {"id": op_id, "epoch": 1, "node": "n1", "state": state}


def test_roundtrip_after_reopen(tmp_path):
    store = SqliteStore(tmp_path / "s.db")
    store.open()
    assert store.load(0).empty
    store.write(
        Batch(
            meta={"base": {"x": 1}, "epoch": 3},
            sessions={"s1": {"id": "s1"}, "s2": {"id": "s2"}},
            events=[("e1", "request", 10.0)],
            operations={"3.op-1": op("3.op-1")},
            observations=[
                (5.0, "handoff", "a", "b", None, None),
                (50.0, "gap", None, None, 2.5, None),
                (60.0, "request", None, "b", None, 900),
            ],
        )
    )
    store.write(
        Batch(sessions={"s2": None}, operations={"3.op-1": op("3.op-1", "done")}, events=[("e1", "request", 11.0)])
    )
    store.close()
    store = SqliteStore(tmp_path / "s.db")
    store.open()
    loaded = store.load(observations_since=10.0)
    assert loaded.meta == {"base": {"x": 1}, "epoch": 3}
    assert loaded.sessions == {"s1": {"id": "s1"}}
    assert loaded.event_ids == {"e1": 10.0}
    assert loaded.operations["3.op-1"]["state"] == "done"
    assert loaded.observations == [(50.0, "gap", None, None, 2.5, None), (60.0, "request", None, "b", None, 900)]
    mode = store.db.execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    store.close()


def test_a_failing_batch_leaves_nothing(tmp_path):
    store = SqliteStore(tmp_path / "s.db")
    store.open()
    store.write(Batch(meta={"epoch": 1}))
    with pytest.raises(KeyError):
        store.write(Batch(meta={"epoch": 2}, operations={"bad": {"id": "bad"}}))  # no epoch/node/state
    loaded = store.load(0)
    assert loaded.meta == {"epoch": 1} and loaded.operations == {}
    store.close()


def test_prune_keeps_recent_observations_and_event_ids(tmp_path):
    store = SqliteStore(tmp_path / "s.db")
    store.open()
    store.write(Batch(observations=[(1.0, "gap", None, None, 1.0, None), (100.0, "gap", None, None, 2.0, None)]))
    store.write(Batch(events=[("old", "request", 10.0), ("new", "request", 90.0)]))
    store.prune(observations_before=50.0, events_before=50.0)
    loaded = store.load(0)
    assert loaded.observations == [(100.0, "gap", None, None, 2.0, None)]
    assert loaded.event_ids == {"new": 90.0}
    store.close()
    with pytest.raises(RuntimeError):
        store.load(0)


def test_database_is_plain_sqlite(tmp_path):
    store = SqliteStore(tmp_path / "s.db")
    store.open()
    store.write(Batch(meta={"k": [1, 2]}))
    store.close()
    with sqlite3.connect(tmp_path / "s.db") as db:
        assert db.execute("SELECT value FROM meta WHERE key = 'k'").fetchone() == ("[1, 2]",)


def test_a_database_from_before_request_observations_gains_their_column(tmp_path):
    """The first release's tables (test_store_migrations.py has each older version's whole DDL)."""
    with sqlite3.connect(tmp_path / "s.db") as db:
        for table in (
            "meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
            "sessions (id TEXT PRIMARY KEY, value TEXT NOT NULL)",
            "events (id TEXT PRIMARY KEY, type TEXT NOT NULL, at REAL NOT NULL)",
            (
                "operations (id TEXT PRIMARY KEY, epoch INTEGER NOT NULL, node TEXT NOT NULL, state TEXT NOT NULL, "
                "value TEXT NOT NULL)"
            ),
            "observations (t REAL NOT NULL, kind TEXT NOT NULL, from_model TEXT, to_model TEXT, gap_seconds REAL)",
        ):
            db.execute(f"CREATE TABLE {table}")
        db.execute("INSERT INTO observations VALUES (1.0, 'handoff', 'a', 'b', NULL)")
    db.close()
    store = SqliteStore(tmp_path / "s.db")
    store.open()
    store.write(Batch(observations=[(2.0, "request", None, "a", None, 1200)]))
    assert store.load(0).observations == [
        (1.0, "handoff", "a", "b", None, None),
        (2.0, "request", None, "a", None, 1200),
    ]
    store.close()


def test_prune_keeps_the_newest_finished_operations_by_plan_position_as_memory_does(tmp_path, monkeypatch):
    """An operation a later plan repeats keeps its row (inserted early) and takes that plan's epoch: pruning by
    insertion order would forget it, done and acknowledged, while memory keeps it; after a restart its report
    would no longer answer `duplicate`."""
    from planner_service.service import store as store_module

    monkeypatch.setattr(store_module, "FINAL_KEEP", 3)
    store = SqliteStore(tmp_path / "p.db")
    store.open()
    store.write(Batch(operations={"1.op-1": {**op("1.op-1"), "seq": 0}}))  # inserted first
    store.write(
        Batch(operations={f"2.op-{i}": {**op(f"2.op-{i}", "superseded"), "epoch": 2, "seq": i} for i in range(5)})
    )
    store.write(Batch(operation_updates={"1.op-1": {"epoch": 3, "seq": 0, "state": "done"}}))  # repeated, done
    store.prune(observations_before=0.0, events_before=0.0)
    kept = store.load(0).operations
    assert set(kept) == {"1.op-1", "2.op-4", "2.op-3"}
    assert kept["1.op-1"]["state"] == "done"
    store.close()


def test_writers_that_commit_while_the_log_is_flushed_share_the_next_flush(tmp_path, monkeypatch):
    """Group commit: eight writers, the first still flushing while the other seven commit: the seven wait
    and one flush covers them all, so eight commits cost two flushes, and a sync with nothing new costs none."""
    store = SqliteStore(tmp_path / "g.db")
    store.open()
    flushed: list[int] = []
    first_flush_may_end = threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        flushed.append(fd)
        if len(flushed) == 1:
            assert first_flush_may_end.wait(timeout=30)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)

    state_lock = threading.Lock()  # the service's: writes one at a time, flushes outside it

    def writer(i: int) -> None:
        with state_lock:
            store.write(Batch(operations={f"1.op-{i}": op(f"1.op-{i}")}))
        store.sync()

    first = threading.Thread(target=writer, args=(0,))
    first.start()
    deadline = time.monotonic() + 30
    while not flushed:  # the first writer is inside its flush
        assert time.monotonic() < deadline
        time.sleep(0.01)
    others = [threading.Thread(target=writer, args=(i,)) for i in range(1, 8)]
    for t in others:
        t.start()
    while store._committed < 8:  # the seven committed: none of them is covered by the running flush
        assert time.monotonic() < deadline
        time.sleep(0.01)
    first_flush_may_end.set()
    for t in [first, *others]:
        t.join(timeout=30)
    assert len(flushed) == 2
    store.sync()  # nothing committed since
    assert len(flushed) == 2
    store.close()
    reopened = SqliteStore(tmp_path / "g.db")
    reopened.open()
    assert set(reopened.load(0).operations) == {f"1.op-{i}" for i in range(8)}
    reopened.close()


def test_a_change_is_flushed_after_the_state_lock_is_released_and_a_read_flushes_nothing(tmp_path):
    """The service commits under its lock and flushes outside it, before the caller gets its answer."""
    store = SqliteStore(tmp_path / "l.db")
    service = ClusterService(store, Metrics(CollectorRegistry()), Settings(), clock=lambda: 1_000.0)
    service.start(demo_scenario)
    service.replan()
    syncs: list[bool] = []  # whether the state lock was held at each flush
    real_sync = store.sync

    def sync() -> None:
        syncs.append(service.live.lock.held())
        real_sync()

    store.sync = sync  # type: ignore[method-assign]  # counting the flushes
    service.apply_events([RequestEvent(id="e1", type="request", session="s1", model=service.live.model_ids()[0])])
    assert syncs == [False]
    service.sessions_view()
    node = service.live.node_ids()[0]
    service.lease(node, 0)  # leases nothing: writes nothing
    assert syncs == [False]
    service.replan(force=True)  # its snapshot (expiries) and its install: each flushed after the lock
    assert syncs and not any(syncs)
    service.close()
