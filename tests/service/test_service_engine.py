"""ClusterService without HTTP: a fake clock, the tiny cluster, in-flight work across epochs."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from planner_service.domain.scenario import load_scenario
from planner_service.metrics import Metrics
from planner_service.service.engine import ClusterService
from planner_service.service.errors import Conflict, InvalidInput, NotReady
from planner_service.service.inputs import ReportIn, RequestEvent, SessionEndEvent
from planner_service.service.store import SqliteStore
from planner_service.settings import Settings
from tests.service.test_service_reconcile import Clock as DemoClock
from tests.service.test_service_reconcile import new_service

TINY = Path(__file__).parent / "tiny_scenario.json"


class Clock:
    t = 1_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def service(tmp_path):
    clock = Clock()
    svc = ClusterService(
        SqliteStore(tmp_path / "e.db"), Metrics(CollectorRegistry()), Settings(lease_seconds=10), clock=clock
    )
    svc.clock = clock
    svc.start(lambda: load_scenario(TINY))
    yield svc
    svc.close()


def req(i: str, session: str, model: str, **kw) -> RequestEvent:
    return RequestEvent(id=i, type="request", session=session, model=model, **kw)


def test_not_ready_before_start(tmp_path):
    svc = ClusterService(SqliteStore(tmp_path / "x.db"), Metrics(CollectorRegistry()))
    with pytest.raises(NotReady):
        svc.srv_view()


def test_replan_without_changes_keeps_the_epoch(service):
    assert service.replan() == {"epoch": 1, "changed": True}
    assert service.replan() == {"epoch": 1, "changed": False}
    assert service.replan(force=True) == {"epoch": 2, "changed": True}


def test_in_flight_work_is_not_planned_twice_and_new_work_waits_for_it(service):
    service.apply_events([req("e1", "s1", "beta", slo="blocking", input_tokens=1000)])
    service.replan()
    drop = service.lease("n1", 10)
    assert [o["action"] for o in drop["operations"]] == ["drop"]
    service.replan(force=True)  # epoch 2 plans around the drop in flight
    ops = service.operations_view(node="n1", state="queued")
    assert all(o["epoch"] == 2 for o in ops)
    assert not any(o["action"] == "drop" for o in ops)
    dep = drop["operations"][0]["id"]
    assert all(dep in o["depends_on"] for o in ops if o["to"] and o["to"].get("gpu") == "n1-g0")
    assert service.lease("n1", 10)["operations"] == []  # waiting on the epoch-1 drop
    service.report(dep, ReportIn(lease_id=drop["lease_id"], status="done"))
    assert {o["action"] for o in service.lease("n1", 10)["operations"]} == {"promote"}


def test_every_move_of_an_engine_step_waits_on_what_is_in_flight_for_any_of_them(tmp_path):
    """With the demo's first ready operations leased (n1's reasoner leaves n1-g3 first), the next epoch plans
    around them: a start on n1-g0..g3 is one call for the whole group, made on the first of its moves an agent
    runs, so each of its moves waits on the free in flight on n1-g3, not only the move onto n1-g3."""
    svc = new_service(tmp_path / "demo.db", DemoClock())
    try:
        svc.replan()
        inflight = {o["id"] for n in ("n1", "n2", "n3", "n4") for o in svc.lease(n, 100)["operations"]}
        svc.replan(force=True)
        steps: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
        for o in svc.operations_view(state="queued"):
            if o["engine"] and o["engine"]["transition"] in ("start", "wake", "restart"):
                steps[(o["node"], o["engine"]["instance"]["id"], o["engine"]["transition"])].append(o)
        waits = {key: [inflight & set(o["depends_on"]) for o in moves] for key, moves in steps.items()}
        assert all(all(w == ws[0] for w in ws) for ws in waits.values()), waits
        assert any(len(ws) > 1 and ws[0] for ws in waits.values()), waits  # a group start waits on a free in flight
    finally:
        svc.close()


def test_switch_latency_is_observed_when_the_model_lands(service):
    service.apply_events([req("e1", "s1", "beta", slo="blocking", input_tokens=10)])
    service.replan()
    service.clock.t += 1
    first = service.lease("n1", 10)
    service.report(first["operations"][0]["id"], ReportIn(lease_id=first["lease_id"], status="done"))
    service.clock.t += 3
    second = service.lease("n1", 10)
    for op in second["operations"]:
        service.report(op["id"], ReportIn(lease_id=second["lease_id"], status="done", measured_seconds=0.5))
    registry = service.live.metrics.registry
    assert registry.get_sample_value("statebudget_switch_latency_seconds_sum", {"slo": "blocking"}) == 4.0
    assert registry.get_sample_value("statebudget_slo_violations_total", {"slo": "blocking"}) == 1.0  # 4 s > 2 s target


def test_ended_session_is_forgotten_once_its_kv_is_gone(service):
    service.apply_events([req("e1", "s1", "alpha", input_tokens=1000)])
    service.replan()
    lease = service.lease("n1", 10) if service.operations_view(node="n1") else service.lease("n2", 10)
    for op in lease["operations"]:
        service.report(op["id"], ReportIn(lease_id=lease["lease_id"], status="done"))
    service.apply_events([SessionEndEvent(id="end", type="session_end", session="s1")])
    assert service.session_view("s1")["ended"]
    for _ in range(4):  # run the plans out: nothing wants an ended session's KV
        service.replan()
        for node in ("n1", "n2"):
            lease = service.lease(node, 100)
            for op in lease["operations"]:
                service.report(op["id"], ReportIn(lease_id=lease["lease_id"], status="done"))
    assert "s1" not in {s["id"] for s in service.sessions_view()}
    assert not [e for e in service.srv_view()["placement"] if e["object"].get("session") == "s1"]


def test_unknown_model_names_the_known_ones(service):
    with pytest.raises(InvalidInput, match=r"events\[0\]\.model: unknown model 'gamma'; known: \['alpha', 'beta'\]"):
        service.apply_events([req("e", "s", "gamma")])


def test_report_for_a_lease_that_expired_is_refused(service):
    service.apply_events([req("e1", "s1", "beta", input_tokens=10)])
    service.replan()
    lease = service.lease("n1", 10)
    service.clock.t += 11
    with pytest.raises(Conflict, match="re-queued"):
        service.report(lease["operations"][0]["id"], ReportIn(lease_id=lease["lease_id"], status="done"))


def test_a_running_service_forgets_event_ids_past_their_retention(tmp_path):
    clock = Clock()
    svc = ClusterService(
        SqliteStore(tmp_path / "p.db"),
        Metrics(CollectorRegistry()),
        Settings(event_retention_seconds=600.0),
        clock=clock,
    )
    svc.start(lambda: load_scenario(TINY))
    assert svc.apply_events([req("e1", "s1", "beta")])["applied"] == 1
    clock.t += 300.0
    svc.tick()
    assert svc.apply_events([req("e1", "s1", "beta")])["duplicates"] == 1  # within retention: a resend is ignored
    clock.t += 3600.0
    svc.tick()  # an hour on, the hourly prune forgets it, in memory and in the database
    assert "e1" not in svc.live.event_ids
    assert svc.live.store.load(0).event_ids == {}
    assert svc.apply_events([req("e1", "s1", "beta")])["applied"] == 1
    svc.close()
