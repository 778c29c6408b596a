"""The published SRV and the installed plan are typed in memory and stored as the JSON the `srv` and `plan`
meta rows have always held (a pinned copy: `stored_srv_and_plan_rows.json`, a run of two engine nodes whose
one leased move failed, so the next plan holds its chain back). The service writes those rows, reads them
back as the views they describe, and writes them back unchanged."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from planner_service.domain.scenario import Scenario, parse_scenario
from planner_service.metrics import Metrics
from planner_service.service.engine import ClusterService
from planner_service.service.inputs import ReportIn, WhatIfIn
from planner_service.service.published import InstalledPlan, PublishedSrv
from planner_service.service.questions import what_if
from planner_service.service.store import SqliteStore
from planner_service.settings import Settings
from planner_service.solver.registry import solve
from tests.service.test_service_reconcile import Clock

HERE = Path(__file__).parent
PINNED: dict[str, Any] = json.loads((HERE / "stored_srv_and_plan_rows.json").read_text())


def engine_scenario() -> Scenario:
    """The tiny scenario with a vLLM engine per model on both nodes and one session on beta."""
    data = json.loads((HERE / "tiny_scenario.json").read_text())
    for node in data["cluster"]["nodes"]:
        node["engines"] = [{"model": model, "kind": "vllm", "features": ["sleep_mode"]} for model in ("alpha", "beta")]
    data["sessions"] = [
        {"id": "s1", "user": "u1", "slo": "interactive", "model": "beta", "active": True, "context_tokens": 1000}
    ]
    return parse_scenario(data)


def open_service(db: Path, clock: Clock) -> ClusterService:
    svc = ClusterService(SqliteStore(db), Metrics(CollectorRegistry()), Settings(lease_seconds=60), clock=clock)
    svc.start(engine_scenario)
    return svc


def stored_rows(db: Path) -> dict[str, Any]:
    with sqlite3.connect(db) as conn:
        return {k: json.loads(v) for k, v in conn.execute("SELECT key, value FROM meta WHERE key IN ('srv', 'plan')")}


def write_rows(db: Path, rows: dict[str, Any]) -> None:
    with sqlite3.connect(db) as conn:
        for key, value in rows.items():
            conn.execute("UPDATE meta SET value = ? WHERE key = ?", (json.dumps(value), key))


@pytest.fixture
def db(tmp_path) -> Path:
    """A database after the pinned run: a plan, its one leased move failed, and the plan after it."""
    path, clock = tmp_path / "s.db", Clock()
    svc = open_service(path, clock)
    try:
        svc.replan(force=True)
        lease = svc.lease("n1", 3)
        (op,) = lease["operations"]
        svc.report(op["id"], ReportIn(lease_id=lease["lease_id"], status="failed", error="engine busy"))
        clock.t += 1
        svc.replan(force=True)
    finally:
        svc.close()
    return path


def test_the_service_writes_the_rows_in_their_stored_form(db):
    rows = stored_rows(db)
    assert rows["plan"]["solve_seconds"] >= 0
    rows["plan"]["solve_seconds"] = PINNED["plan"]["solve_seconds"]  # the one figure that varies run to run
    assert rows == PINNED


def test_the_stored_rows_read_back_as_the_views_they_describe(db):
    pinned_srv = {**PINNED["srv"], "version": 5}  # a version no fresh publish would reach
    write_rows(db, {"srv": pinned_srv, "plan": PINNED["plan"]})
    clock = Clock()
    clock.t = 1002.0
    svc = open_service(db, clock)
    try:
        srv = svc.srv_view()
        assert {"version": srv["version"], "srv": srv["srv"]} == pinned_srv
        assert svc.plan_view() == {k: v for k, v in PINNED["plan"].items() if k != "engines"}
        assert svc.live.status() == {"epoch": 2, "srv_version": 5}
        assert svc.live.held_until == clock.t  # held-back moves are queued again at the first replan

        snapshot = svc.metrics_snapshot()
        assert snapshot.queue == {("n1", "interactive", "held_back"): len(PINNED["plan"]["held_back"])}
        assert snapshot.predicted_p95_seconds == PINNED["plan"]["predicted"]["switch_latency_p95_seconds"]
        answer = what_if(svc.live_view(), WhatIfIn(), solve)
        assert answer["baseline_predicted"] == PINNED["plan"]["predicted"]

        planned_gpu = {g["id"]: g["planned_bytes"] for n in svc.cluster_view()["nodes"] for g in n["gpus"]}
        pinned_gpu: dict[str, int] = {}
        for entry in PINNED["plan"]["placement"]:
            if entry["location"]["tier"] == "gpu":
                gpu = entry["location"]["gpu"]
                pinned_gpu[gpu] = pinned_gpu.get(gpu, 0) + entry["bytes"]
        assert planned_gpu == pinned_gpu

        assert svc.live.plan is not None and svc.live.plan.to_json() == PINNED["plan"]
        assert svc.live.stored_srv() == pinned_srv
    finally:
        svc.close()


def test_a_stored_row_round_trips_through_its_record():
    assert PublishedSrv.from_json(PINNED["srv"]).to_json() == PINNED["srv"]
    plan = InstalledPlan.from_stored(PINNED["plan"])
    assert plan is not None and plan.to_json() == PINNED["plan"]
    assert json.dumps(plan.to_json(), sort_keys=True) == json.dumps(PINNED["plan"], sort_keys=True)


def test_a_stored_plan_that_no_longer_validates_is_planned_anew(db, caplog):
    write_rows(db, {"plan": {**PINNED["plan"], "status": "no-such-status"}})
    svc = open_service(db, Clock())
    try:
        assert svc.live.plan is None and svc.live.status()["epoch"] is None
        assert "the stored plan is not valid any more" in caplog.text
        assert svc.replan()["epoch"] == 3  # the epoch stays the store's: the next plan is a new one
        assert svc.plan_view()["epoch"] == 3
    finally:
        svc.close()
