"""Replans while operations are in flight: the controller keeps installing plans, whatever is in flight.

The load benchmark's condition: the demo's first operations leased and still
running, hundreds of session events, forced replans, and leases and done
reports between them. And the case no plan can prevent: operations in
flight that no longer fit beside the confirmed state (here an operator
reserves more of a GPU while they run); they are planned as landing only
what fits (`service/landing.py`), and what fills their GPU waits for them.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry

from planner_service.bench_load import EventStream
from planner_service.domain.demo import demo_scenario
from planner_service.domain.scenario import ClusterIn
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.metrics import Metrics
from planner_service.service.engine import ClusterService
from planner_service.service.inputs import EventsIn, ReportIn
from planner_service.service.queues import Races, must_wait
from planner_service.service.records import OpState
from planner_service.service.solving import PlanRequest, plan_from
from planner_service.service.store import SqliteStore
from planner_service.settings import Settings


class Clock:
    t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def open_service(db: Path) -> tuple[ClusterService, Clock]:
    clock = Clock()
    service = ClusterService(SqliteStore(db), Metrics(CollectorRegistry()), Settings(), clock=clock)
    service.start(demo_scenario)
    service.replan()
    return service, clock


def lease_all(service: ClusterService, rounds: int = 3) -> list[tuple[str, str]]:
    """Lease every node's ready operations, `rounds` leases of 8 per node; (operation id, lease id) pairs."""
    held = []
    for node in [n.id for n in service.live.declared.cluster.nodes]:
        for _ in range(rounds):
            lease = service.lease(node, 8)
            held += [(op["id"], lease["lease_id"]) for op in lease["operations"]]
    return held


def gpu_bytes(service: ClusterService, placement: dict, gpu: str) -> int:
    return sum(n for (_, loc), n in placement.items() if loc == Location.gpu(gpu))


def _ready(service, op_id: str) -> bool:
    """Whether every operation `op_id` depends on is done (or no longer recorded)."""
    ops = service.live.ops
    return all(d not in ops or ops[d].state is OpState.DONE for d in ops[op_id].op.depends_on)


def test_replans_keep_installing_while_the_first_operations_run_under_load(tmp_path):
    """Before the greedy kept a running MoE engine's expert share, the second plan gave the active sessions'
    KV the room of the reasoner's experts on n1: its prefills overfilled n1's L40s, and every replan after
    it was refused (409) while they ran."""
    service, clock = open_service(tmp_path / "s.db")
    rng, order = np.random.default_rng(0), random.Random(0)
    models = sorted(m.id for m in service.live.declared.models)
    streams = [EventStream(rng, models, range(lane, 200, 64), run=f"r-{lane}") for lane in range(64)]
    held = lease_all(service)
    for step in range(40):  # 800 events of 200 sessions, as the load benchmark sends them
        clock.t += 0.05
        service.apply_events(EventsIn.model_validate({"events": [next(streams[step % 64]) for _ in range(20)]}).events)
    conflicts = []
    for _ in range(4):
        assert service.replan(force=True)["changed"] is True
        held += lease_all(service)
        order.shuffle(held)
        kept = held[len(held) // 2 :]
        for op_id, lease_id in held[: len(held) // 2]:
            if not _ready(service, op_id):  # an agent runs a lease's move after those it waits on
                kept.append((op_id, lease_id))
                continue
            answer = service.report(op_id, ReportIn(lease_id=lease_id, status="done"))
            conflicts += [answer["operation"]["conflict"]] if answer["operation"].get("conflict") else []
        held = kept
    assert conflicts == []
    broken = service.live.metrics.plan_invariant_violations.collect()[0].samples
    assert [(b.labels, b.value) for b in broken if b.name.endswith("_total")] == []  # every plan was sound
    sizes = service.live.sizes
    assert sizes is not None
    for gpu in sizes.gpus:  # the confirmed state within every capacity
        assert gpu_bytes(service, service.live.placement, gpu) <= sizes.gpus[gpu].capacity_bytes
    service.close()


def test_operations_in_flight_that_no_longer_fit_are_planned_capped_and_waited_for(tmp_path):
    service, _ = open_service(tmp_path / "s.db")
    held = dict(lease_all(service))
    inflight = service.live.inflight()
    moving = [r for r in inflight if r.op.dest is not None and r.op.dest.tier is Tier.GPU and r.op.source != r.op.dest]
    assert moving, "the demo's first plan fills GPUs"
    filled = min(r.op.dest.id for r in moving)  # the first GPU the plan fills
    filling = [r for r in moving if r.op.dest.id == filled]
    confirmed = gpu_bytes(service, service.live.placement, filled)
    # the operator reserves all but what is confirmed on it: the operations filling it no longer fit
    data = demo_scenario().cluster.model_dump(mode="json")
    gpu = next(g for n in data["nodes"] for g in n["gpus"] if g["id"] == filled)
    capacity = service.live.sizes.gpus[filled].capacity_bytes  # type: ignore[union-attr]  # started
    gpu["reserved_bytes"] += capacity - confirmed
    service.put_cluster(ClusterIn.model_validate(data))

    assert service.replan(force=True)["changed"] is True  # was 409: "the state in flight cannot be planned"
    capped = service.planning.landing(service.live.inflight()).capped
    assert {r.id for r in filling} <= capped
    new = [service.live.ops[i] for i in service.live.open_ops if service.live.ops[i].epoch == service.live.epoch]
    for r in new:  # what the new plan puts on it waits for the capped operations there
        if r.op.dest == Location.gpu(filled) and r.state is OpState.QUEUED:
            assert {f.id for f in filling} <= set(r.op.depends_on), r.id

    # the capped operations land: their reports are conflicts (no room), and planning goes on
    for r in filling:
        answer = service.report(r.id, ReportIn(lease_id=held[r.id], status="done"))
        assert "capacity" in answer["operation"]["conflict"]
    assert service.replan(force=True)["changed"] is True
    assert gpu_bytes(service, service.live.placement, filled) <= service.live.sizes.gpus[filled].capacity_bytes  # type: ignore[union-attr]  # started
    service.close()


def test_the_race_index_finds_what_must_wait_finds(tmp_path):
    """`Races` (the install's index of the operations in flight) names, for every operation, exactly the
    operations in flight `must_wait` says it must wait for: the plan's own operations, and operations made
    to race each one in flight on each of its rules (fills what it frees or lands capped, reads what it
    writes, drops the source it reads, prefills a session's KV on the engine it brings up)."""
    service, clock = open_service(tmp_path / "r.db")
    rng = np.random.default_rng(1)
    models = sorted(m.id for m in service.live.declared.models)
    stream = EventStream(rng, models, range(200), run="r")
    lease_all(service)
    for _ in range(20):
        clock.t += 0.05
        service.apply_events(EventsIn.model_validate({"events": [next(stream) for _ in range(20)]}).events)
    inflight = service.live.inflight()
    capped = {r.id for r in inflight[::3]}
    with service.live.change():
        state, next_model, _ = service.planning.planning_snapshot(stand_ins=True)
        usage = service.planning._usage()
    plan = plan_from(PlanRequest(state, next_model, usage, "greedy", force=True)).plan
    assert plan is not None
    racing = []
    for r in inflight:
        if r.op.frees() is not None:
            racing.append(dataclasses.replace(r.op, id="fills", source=None, dest=r.op.frees(), keep_source=True))
        if r.op.dest is not None:
            racing.append(dataclasses.replace(r.op, id="reads", source=r.op.dest, dest=None, keep_source=True))
            racing.append(dataclasses.replace(r.op, id="capped", source=None, keep_source=True))
        if r.op.keep_source and r.op.source is not None:
            racing.append(dataclasses.replace(r.op, id="drops", source=r.op.source, dest=None, keep_source=False))
        if r.op.engine is not None and r.op.object.kind is Kind.WEIGHTS and r.op.dest is not None:
            kv = StateObject.kv(r.op.object.model, "s-new")
            racing.append(dataclasses.replace(r.op, id="prefills", object=kv, source=None, engine=None))
    assert any(op.id == "prefills" for op in racing)  # an engine comes up in flight
    races = Races(inflight, capped)
    found = 0
    for op in [*plan.operations, *racing]:
        expected = [r.id for r in inflight if must_wait(op, r, capped)]
        assert races.ordered(races.of(op)) == expected, op
        found += bool(expected)
    assert len(inflight) >= 10 and found >= len(inflight)  # every one in flight was raced, at least
