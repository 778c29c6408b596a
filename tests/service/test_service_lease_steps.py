"""An engine step is one call (a start, a wake, a restart) carried by several moves, one per GPU and object of
the instance: the service leases them together, so that a newer plan never supersedes the moves still queued
while the call they share has been made (an engine started with its experts on the GPUs, whose expert moves
the confirmed state would then never learn of). The demo cluster's first plan."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from planner_service.service.engine import ClusterService
from planner_service.service.queues import _with_step_siblings
from planner_service.service.records import OpRecord, OpState
from planner_service.service.solving import PlanRequest, PlanResult
from planner_service.wire.operations import ReportIn
from tests.service.test_service_reconcile import Clock, new_service


def steps_of(svc: ClusterService, node: str) -> dict[tuple[str, str], set[str]]:
    """(step, its moves' dependencies) -> the moves: those become ready together (a move of the step that
    waits on another of its moves' dependants comes later, with them)."""
    out: dict[tuple[str, str], set[str]] = defaultdict(set)
    assert svc.live.plan is not None
    for op in svc.live.plan.operations:
        if op.node == node and op.engine is not None:
            out[(f"{op.engine.transition.value} {op.engine.instance.id}", ",".join(op.depends_on))].add(op.id)
    return out


def test_a_lease_holds_every_ready_move_of_an_engine_step_it_holds_one_of(tmp_path) -> None:
    svc = new_service(tmp_path / "demo.db", Clock())
    try:
        svc.replan(force=True)
        together = 0
        for node in ("n1", "n2", "n3", "n4"):
            steps = steps_of(svc, node)
            while (lease := svc.lease(node, 1))["operations"]:
                ids = {op["id"] for op in lease["operations"]}
                for moves in steps.values():
                    if ids & moves:
                        assert moves <= ids, (node, sorted(moves - ids))  # the rest of the step, in this lease
                        together += len(moves) > 1
                for op_id in sorted(ids):
                    svc.report(op_id, ReportIn(lease_id=lease["lease_id"], status="done"))
        assert together  # the plan has a step of several moves, leased together past max_operations 1
    finally:
        svc.close()


def test_a_move_of_the_step_that_waits_on_another_of_its_moves_joins_the_lease_after_it(tmp_path) -> None:
    """Moves of one engine step that wait on each other (a restart's new experts on a GPU wait for the old
    weights to leave it) are moves of the one call, so the lease takes the waiting move too (the agent runs it
    after the other); a move that waits on an operation outside the lease, not done, stays queued."""
    svc = new_service(tmp_path / "demo.db", Clock())
    try:
        svc.replan(force=True)
        assert svc.live.plan is not None
        steps: dict[tuple[str, str, str], list] = {}
        for op in svc.live.plan.operations:
            if op.engine is not None:
                steps.setdefault((op.node, op.engine.instance.id, op.engine.transition.value), []).append(op)
        moves = max(steps.values(), key=len)  # the demo's biggest step (a restart's expert moves on n1)
        assert len(moves) >= 4
        first, second, third, fourth = (op.model_copy(update={"depends_on": []}) for op in moves[:4])
        chained = [
            OpRecord(first, 1, 0),
            OpRecord(second.model_copy(update={"depends_on": [first.id]}), 1, 1),
            OpRecord(third.model_copy(update={"depends_on": [second.id]}), 1, 2),
            OpRecord(fourth.model_copy(update={"depends_on": ["1.op-elsewhere"]}), 1, 3),  # leased to no one yet
        ]
        queued = {r.id for r in chained}
        leased = _with_step_siblings(chained, lambda d: d not in queued and d != "1.op-elsewhere", 1)
        assert [r.id for r in leased] == [first.id, second.id, third.id]
    finally:
        svc.close()


def test_a_queued_move_whose_engine_call_changed_is_not_kept_from_the_queue(tmp_path) -> None:
    """A replan whose start of an instance brings the same weights with another expert share is another engine
    call: the queued moves of the old call are superseded, not kept with it, so the agent never starts the
    engine with the experts of a plan whose expert moves are gone."""
    svc = new_service(tmp_path / "demo.db", Clock())
    try:
        svc.replan(force=True)
        started = [
            svc.live.ops[i]
            for i in sorted(svc.live.open_ops)
            if (step := svc.live.ops[i].op.engine) is not None and step.instance.gpu_expert_fraction < 1
        ]
        assert started, "the demo's first plan starts a MoE engine with part of its experts"
        solve = svc.planning.runner

        def with_all_experts(request: PlanRequest) -> PlanResult:
            result = solve(request)
            assert result.plan is not None
            ops = [
                op
                if op.engine is None or op.engine.instance.gpu_expert_fraction == 1
                else dataclasses.replace(
                    op,
                    engine=op.engine.model_copy(
                        update={"instance": op.engine.instance.model_copy(update={"gpu_expert_fraction": 1.0})}
                    ),
                )
                for op in result.plan.operations
            ]
            return dataclasses.replace(result, plan=dataclasses.replace(result.plan, operations=ops))

        svc.planning.runner = with_all_experts
        svc.replan(force=True)
        assert all(r.state is OpState.SUPERSEDED for r in started)
        assert all(
            svc.live.ops[i].op.engine.instance.gpu_expert_fraction == 1
            for i in svc.live.open_ops
            if svc.live.ops[i].op.engine is not None
        )
    finally:
        svc.close()
