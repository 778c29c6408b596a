"""The controller reconciles instead of trusting: a plan installs only against the state it was planned from,
a `done` report that would break the physical invariants is a conflict, and a state that breaks them is
repaired at start. Each case is the one under load that once applied a move twice and overfilled a GPU."""

from __future__ import annotations

import json
import sqlite3
from collections import defaultdict
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from planner_service.domain.demo import demo_scenario
from planner_service.domain.state import Kind, Tier
from planner_service.metrics import Metrics
from planner_service.service.engine import ClusterService
from planner_service.service.inputs import ReportIn, RequestEvent
from planner_service.service.store import Batch, SqliteStore
from planner_service.settings import Settings


class Clock:
    t = 1_000.0

    def __call__(self) -> float:
        return self.t


def new_service(path, clock: Clock) -> ClusterService:
    svc = ClusterService(SqliteStore(path), Metrics(CollectorRegistry()), Settings(lease_seconds=60), clock=clock)
    svc.start(demo_scenario)
    return svc


@pytest.fixture
def demo(tmp_path):
    svc = new_service(tmp_path / "demo.db", Clock())
    yield svc
    svc.close()


def nodes(svc: ClusterService) -> list[str]:
    return [n["id"] for n in svc.cluster_view()["nodes"]]


def finish(svc: ClusterService, lease: dict[str, Any]) -> None:
    for op in lease["operations"]:
        svc.report(op["id"], ReportIn(lease_id=lease["lease_id"], status="done"))


def overfilled(svc: ClusterService) -> list[str]:
    """Locations of the confirmed placement over their capacity, and objects held more than once over."""
    view = svc.cluster_view()
    capacity = {g["id"]: g["capacity_bytes"] for n in view["nodes"] for g in n["gpus"]}  # net of reserved
    experts = {m["id"]: m["resolved"]["experts_bytes"] for m in svc.models_view()}
    used: dict[str, int] = defaultdict(int)
    problems = []
    for entry in svc.srv_view()["placement"]:
        loc, obj, n = entry["location"], entry["object"], entry["bytes"]
        if loc["tier"] == Tier.GPU.value:
            used[loc["gpu"]] += n
        if obj["kind"] == Kind.EXPERTS.value and n > experts[obj["model"]]:
            problems.append(f"experts({obj['model']}) at {loc}: {n} > {experts[obj['model']]}")
    problems += [f"{gpu}: {n} > {capacity[gpu]}" for gpu, n in used.items() if n > capacity[gpu]]
    return problems


def test_a_move_leased_while_the_planner_solves_is_never_planned_again(demo: ClusterService) -> None:
    """Agents keep leasing and finishing work while every solve runs: the plan that comes out must not
    repeat a move that went in flight after its snapshot was taken."""
    demo.apply_events([RequestEvent(id="e1", type="request", session="s1", model="reasoner", input_tokens=2000)])
    demo.replan(force=True)
    solve = demo.planning.runner

    def solve_while_agents_work(*args: Any, **kwargs: Any) -> Any:
        for node in nodes(demo):  # each agent finishes what it holds and leases what became eligible
            for op in demo.operations_view(node=node, state="leased"):
                demo.report(op["id"], ReportIn(lease_id=op["lease_id"], status="done"))
            demo.lease(node, 1)
        return solve(*args, **kwargs)

    demo.planning.runner = solve_while_agents_work  # the agents' timing, made certain
    for i in range(6):
        demo.apply_events([RequestEvent(id=f"x{i}", type="request", session=f"t{i}", model="coder")])
        demo.replan(force=True)
    demo.planning.runner = solve  # the agents now drain the queues undisturbed
    for _ in range(50):
        leases = [demo.lease(node, 100) for node in nodes(demo)]
        if not any(lease["operations"] for lease in leases):
            break
        for lease in leases:
            finish(demo, lease)
    assert overfilled(demo) == []


def test_a_done_report_the_confirmed_state_cannot_take_is_a_conflict_not_a_change(demo: ClusterService) -> None:
    demo.replan(force=True)
    promote = next(
        (node, lease, op)
        for node in nodes(demo)
        for lease in [demo.lease(node, 100)]
        for op in lease["operations"]
        if op["action"] == "promote" and op["to"]["tier"] == Tier.GPU.value
    )
    node, lease, op = promote
    # the source no longer holds what the promote reads (say, a double-applied drop removed it)
    source = next(
        (obj, loc)
        for (obj, loc) in demo.live.placement
        if obj.to_json() == op["object"] and loc.to_json() == op["from"]
    )
    demo.live.placement[source] = 1
    before = dict(demo.live.placement)
    answer = demo.report(op["id"], ReportIn(lease_id=lease["lease_id"], status="done"))
    assert answer["operation"]["state"] == "done"
    assert "holds 1 bytes" in answer["operation"]["conflict"]
    assert demo.live.placement == before
    assert demo.live.metrics.report_conflicts.labels(node)._value.get() == 1
    assert demo.urgent.is_set()  # a replan is due


def test_a_conflict_is_committed_with_the_done_report_and_survives_a_restart(tmp_path) -> None:
    """What the report's answer says (done, not applied, and why) is what the database keeps: a record read back
    without its conflict would tell a replay of the done operations that the move landed (the soak's SIGKILL
    trials once found KV "missing" from the SRV after a restart this way)."""
    clock = Clock()
    svc = new_service(tmp_path / "conflict.db", clock)
    svc.replan(force=True)
    _, lease, op = next(
        (node, lease, op)
        for node in nodes(svc)
        for lease in [svc.lease(node, 100)]
        for op in lease["operations"]
        if op["action"] == "promote" and op["to"]["tier"] == Tier.GPU.value and op["from"] is not None
    )
    source = next(k for k in svc.live.placement if k[0].to_json() == op["object"] and k[1].to_json() == op["from"])
    svc.live.placement[source] = 1  # the source no longer holds what the promote reads
    answer = svc.report(op["id"], ReportIn(lease_id=lease["lease_id"], status="done"))
    conflict = answer["operation"]["conflict"]
    assert conflict is not None and "holds 1 bytes" in conflict
    svc.close()

    again = new_service(tmp_path / "conflict.db", clock)
    stored = next(r for r in again.operations_view(state="done") if r["id"] == op["id"])
    assert stored["conflict"] == conflict
    again.close()


def test_a_start_repairs_a_stored_placement_over_capacity_and_says_what_it_took_out(tmp_path) -> None:
    clock = Clock()
    svc = new_service(tmp_path / "over.db", clock)
    (obj, loc), n = next(((o, l), n) for (o, l), n in svc.live.placement.items() if l.tier is Tier.GPU)
    capacity = next(
        g["capacity_bytes"] for node in svc.cluster_view()["nodes"] for g in node["gpus"] if g["id"] == loc.id
    )
    svc.live.store.write(Batch(placement={(obj, loc): 3 * n}))  # the same promote applied three times
    svc.close()

    again = new_service(tmp_path / "over.db", clock)  # starts: no exception
    assert overfilled(again) == []
    quarantine = again.cluster_view()["quarantine"]
    assert quarantine and all(q["location"] == loc.to_json() for q in quarantine)
    assert sum(q["bytes"] for q in quarantine) >= 3 * n - min(n, capacity)
    again.close()
    with sqlite3.connect(tmp_path / "over.db") as conn:  # stored as the view shows it
        (row,) = conn.execute("SELECT value FROM meta WHERE key = 'quarantine'").fetchone()
    assert json.loads(row) == quarantine
    assert set(quarantine[0]) == {"object", "location", "bytes", "why"}
    third = new_service(tmp_path / "over.db", clock)  # the repair was committed: nothing more to take out
    assert third.cluster_view()["quarantine"] == quarantine
    third.close()
