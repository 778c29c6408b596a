"""What the reliability trials found in the service, each reduced to its smallest reproduction."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from planner_service.domain.scenario import load_scenario
from planner_service.metrics import Metrics
from planner_service.service.engine import ClusterService
from planner_service.service.inputs import ReportIn, RequestEvent, SessionEndEvent
from planner_service.service.store import SqliteStore
from planner_service.settings import Settings

TINY = Path(__file__).parents[1] / "service" / "tiny_scenario.json"


class Clock:
    t = 1_000.0

    def __call__(self) -> float:
        return self.t


def start(db: Path) -> ClusterService:
    svc = ClusterService(SqliteStore(db), Metrics(CollectorRegistry()), Settings(lease_seconds=30), clock=Clock())
    svc.start(lambda: load_scenario(TINY))
    return svc


def test_a_prefill_reported_done_after_its_session_ended_is_confirmed(tmp_path: Path) -> None:
    """The soak's F1 load found done reports that changed nothing and did not say so: a session ended while
    the prefill of its KV was leased, the node prefilled it, and the report answered `done` with no conflict
    while the confirmed placement left the bytes out (the service logged `refers to state or hardware no
    longer in the cluster`). The GPU holds them all the same, so the planner would count that room as free.
    The node's report wins: the KV is confirmed, and the next plans drop it as they drop any ended
    session's KV."""
    svc = start(tmp_path / "s.db")
    try:
        svc.apply_events([RequestEvent(id="e1", type="request", session="s1", model="alpha", input_tokens=1000)])
        svc.replan()
        leased = [(svc.lease(node, 100), node) for node in ("n1", "n2")]
        prefill = [
            (op, lease["lease_id"])
            for lease, _ in leased
            for op in lease["operations"]
            if op["object"]["kind"] == "kv" and op["from"] is None
        ]
        assert prefill, "the plan prefills the session's KV"
        op, lease_id = prefill[0]
        svc.apply_events([SessionEndEvent(id="e2", type="session_end", session="s1")])

        out = svc.report(op["id"], ReportIn(lease_id=lease_id, status="done", measured_seconds=0.1))

        assert out["operation"]["state"] == "done"
        held = [e for e in svc.srv_view()["placement"] if e["object"] == op["object"] and e["location"] == op["to"]]
        assert (
            held == [{"object": op["object"], "location": op["to"], "bytes": op["bytes"]}]
            or out["operation"]["conflict"]
        ), "reported done, not applied, and the record does not say why"
        assert held, "the node holds the prefilled KV: the confirmed placement must too"
        assert svc.session_view("s1")["ended"]
    finally:
        svc.close()
