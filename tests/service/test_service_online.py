"""The planning loop runs the online rules the replay measures: stand-ins for the recent load, pins, adoption."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from planner_service.domain.problem import is_stand_in
from planner_service.domain.scenario import load_scenario
from planner_service.metrics import Metrics
from planner_service.planner.online import MAX_DEMAND_WINDOW_SECONDS
from planner_service.service.engine import ClusterService
from planner_service.service.errors import InvalidInput
from planner_service.service.inputs import RequestEvent, TurnEndEvent
from planner_service.service.store import SqliteStore
from planner_service.settings import Settings

TINY = Path(__file__).parent / "tiny_scenario.json"


class Clock:
    t = 1_000.0

    def __call__(self) -> float:
        return self.t


def open_service(db: Path, clock: Clock, **options: object) -> ClusterService:
    service = ClusterService(SqliteStore(db), Metrics(CollectorRegistry()), Settings(**options), clock=clock)
    service.start(lambda: load_scenario(TINY))
    return service


def stand_ins(service: ClusterService) -> list[tuple[str, str]]:
    state, _, _ = service.planning.planning_snapshot(stand_ins=True)
    return sorted((s.id, s.model) for s in state.sessions if is_stand_in(s.id))


def busy(service: ClusterService) -> None:
    """Four turns on beta, one on alpha, all over; a new request on beta in flight."""
    events: list = []
    for i in range(4):
        events += [
            RequestEvent(id=f"b{i}", type="request", session=f"s{i}", model="beta", input_tokens=2000),
            TurnEndEvent(id=f"b{i}-end", type="turn_end", session=f"s{i}", output_tokens=100),
        ]
    events += [
        RequestEvent(id="a0", type="request", session="s9", model="alpha", input_tokens=1000),
        TurnEndEvent(id="a0-end", type="turn_end", session="s9", output_tokens=100),
        RequestEvent(id="b4", type="request", session="s4", model="beta", input_tokens=500),
    ]
    service.apply_events(events)


def test_the_loop_plans_for_the_recent_load_and_installs_only_real_state(tmp_path):
    service = open_service(tmp_path / "o.db", Clock(), demand_seats=5)
    busy(service)
    # beta had 5 of 6 requests: 4 seats, one taken by s4 in flight; alpha 1 seat
    assert [model for _, model in stand_ins(service)] == ["alpha", "beta", "beta", "beta"]
    service.replan(force=True)
    plan = service.plan_view()
    named = {e["object"].get("session") for e in plan["placement"]}
    named |= {o["object"].get("session") for o in plan["operations"]}
    named |= {u["session"] for u in plan["unserved"]}
    assert not any(is_stand_in(s) for s in named)
    kv_sessions = {o["object"]["session"] for o in plan["operations"] if o["object"]["kind"] == "kv"}
    assert kv_sessions <= {f"s{i}" for i in range(5)} | {"s9"}
    service.close()


def test_the_recent_load_survives_a_restart_and_a_quiet_hour_and_leaves_after_a_day(tmp_path):
    clock = Clock()
    service = open_service(tmp_path / "o.db", clock, demand_seats=5)
    busy(service)
    before = stand_ins(service)
    service.close()
    restarted = open_service(tmp_path / "o.db", clock, demand_seats=5)
    assert stand_ins(restarted) == before
    clock.t += 3601.0  # a quiet hour later the window reaches back for the same requests
    assert stand_ins(restarted) == before
    restarted.close()
    restarted = open_service(tmp_path / "o.db", clock, demand_seats=5)  # the store keeps them that long
    assert stand_ins(restarted) == before
    clock.t += MAX_DEMAND_WINDOW_SECONDS  # a day later the load is forgotten
    assert stand_ins(restarted) == []
    restarted.close()


def test_no_stand_ins_when_the_seats_are_off(tmp_path):
    service = open_service(tmp_path / "o.db", Clock(), demand_seats=0)
    busy(service)
    assert stand_ins(service) == []
    service.close()


def test_a_replan_that_is_not_worth_its_moves_keeps_the_current_plan(tmp_path):
    clock = Clock()
    service = open_service(tmp_path / "o.db", clock, demand_seats=0)
    assert service.replan()["changed"]  # the first plan is always installed
    # a background session's turn on beta ended: loading beta for its next turn saves less than the load takes
    service.apply_events(
        [
            RequestEvent(id="e1", type="request", session="s1", model="beta", input_tokens=100, slo="background"),
            TurnEndEvent(id="e2", type="turn_end", session="s1", output_tokens=10),
        ]
    )
    clock.t += 5.0
    assert service.replan() == {"epoch": 1, "changed": False}
    kept = service.live.metrics.registry.get_sample_value("statebudget_replans_total", {"outcome": "kept"})
    assert kept == 1
    # an operator's replan installs it all the same
    assert service.replan(force=True) == {"epoch": 2, "changed": True}
    assert ("promote", "beta") in {(o["action"], o["object"]["model"]) for o in service.plan_view()["operations"]}
    service.close()


def test_events_for_a_stand_in_id_are_refused(tmp_path):
    service = open_service(tmp_path / "o.db", Clock())
    with pytest.raises(InvalidInput, match=r"events\[0\]\.session: ids beginning with 'expected-' are reserved"):
        service.apply_events([RequestEvent(id="e1", type="request", session="expected-beta-0", model="beta")])
    service.close()
