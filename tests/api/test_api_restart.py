"""A restarted app (same database) restores everything and keeps its promises."""

from __future__ import annotations

import sqlite3

from api_helpers import TINY, FakeClock, request
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from planner_service.api.app import create_app
from planner_service.service.store import Batch, SqliteStore
from planner_service.settings import Settings


def test_restart_restores_state(make_app):
    clock = FakeClock()
    first = make_app(tiny=True, clock=clock)
    first.events(
        request("e1", "s1", "beta", slo="blocking", input_tokens=1000), request("e2", "s2", "alpha", input_tokens=500)
    )
    first.post("/v1/plan")
    lease = first.lease("n1").json()
    first.report(lease["operations"][0]["id"], lease["lease_id"], measured_seconds=0.5)
    pending = first.lease("n1").json()
    state = {p: first.get(p).json() for p in ("/v1/srv", "/v1/sessions", "/v1/plan", "/v1/operations")}
    first.client.__exit__(None, None, None)

    second = make_app(clock=clock)  # no seed: the database wins
    for path, before in state.items():
        assert second.get(path).json() == before, path
    assert second.events(request("e1", "s1", "beta")).json()["duplicates"] == 1
    assert second.report(pending["operations"][0]["id"], pending["lease_id"]).status_code == 200


class FailingStore(SqliteStore):
    """A database whose writes start failing on demand (a full disk, a lost volume)."""

    failing = False

    def write(self, batch: Batch) -> None:
        if self.failing and batch:
            raise sqlite3.OperationalError("database or disk is full")
        super().write(batch)


def test_a_failed_database_write_changes_nothing_and_the_service_goes_on(tmp_path):
    store = FailingStore(tmp_path / "f.db")
    settings = Settings(db_path=tmp_path / "f.db", scenario_path=TINY, background_planning=False, plan_in_worker=False)
    with TestClient(create_app(settings, registry=CollectorRegistry(), store=store)) as client:
        assert client.post("/v1/events", json={"events": [request("e1", "s1", "beta")]}).status_code == 200
        store.failing = True
        refused = client.post("/v1/events", json={"events": [request("e2", "s2", "alpha")]})
        assert refused.status_code == 503 and "nothing changed" in refused.json()["detail"]
        assert client.get("/livez").status_code == 200  # memory went back to the database: nothing to restart
        assert {s["id"] for s in client.get("/v1/sessions").json()} == {"s1"}  # e2 was never acknowledged
        store.failing = False  # the disk has room again
        assert client.post("/v1/events", json={"events": [request("e2", "s2", "alpha")]}).json()["applied"] == 1
    with TestClient(create_app(settings, registry=CollectorRegistry())) as client:  # a restart agrees
        assert {s["id"] for s in client.get("/v1/sessions").json()} == {"s1", "s2"}


class UnreadableStore(FailingStore):
    """A lost volume: neither writes nor reads work any more."""

    def load(self, since):  # type: ignore[override]  # fails on demand, as the volume does
        if self.failing:
            raise sqlite3.OperationalError("disk I/O error")
        return super().load(since)


def test_a_failed_write_whose_reload_fails_too_stops_the_service_until_a_restart(tmp_path):
    store = UnreadableStore(tmp_path / "u.db")
    settings = Settings(db_path=tmp_path / "u.db", scenario_path=TINY, background_planning=False, plan_in_worker=False)
    with TestClient(create_app(settings, registry=CollectorRegistry(), store=store)) as client:
        assert client.post("/v1/events", json={"events": [request("e1", "s1", "beta")]}).status_code == 200
        store.failing = True
        assert client.post("/v1/events", json={"events": [request("e2", "s2", "alpha")]}).status_code == 503
        assert client.get("/livez").status_code == 503  # a liveness probe restarts it
        assert client.get("/v1/sessions").status_code == 503  # memory may not match the database
    store.failing = False
    with TestClient(create_app(settings, registry=CollectorRegistry())) as client:  # the restart
        assert client.get("/livez").status_code == 200
        assert {s["id"] for s in client.get("/v1/sessions").json()} == {"s1"}
