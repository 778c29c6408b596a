"""A plan: the target placement, the operations to reach it, and what it is predicted to buy.

Every solver returns a `Plan`, produced by `make_plan` from a target
placement, so operations, objective and predicted metrics are computed the
same way for all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from planner_service.domain.problem import Problem
from planner_service.domain.state import Location, StateObject, placement_to_json
from planner_service.planner.engine_holdings import expert_fractions, kv_pools
from planner_service.planner.engine_instances import InstanceView, confirmed_states
from planner_service.planner.engine_plan import attach_steps, restart_unpairing
from planner_service.planner.engine_targets import engine_target, unserved_by_engines
from planner_service.planner.objective import Demand, Objective, Predicted, evaluate
from planner_service.planner.operations import Operation, build_operations, share_step_dependencies
from planner_service.planner.residency import ResidencyIndex, copy_placement
from planner_service.wire.enums import PlanStatus as PlanStatus  # noqa: PLC0414 -- re-exported: it was defined here


@dataclass
class Plan:
    solver: str
    status: PlanStatus
    objective: Objective
    predicted: Predicted
    placement: dict[tuple[StateObject, Location], int]
    operations: list[Operation]
    unserved: dict[str, str]
    solve_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    # (node, model) -> the engine instance of an engine node (vLLM, SGLang) and its state after the plan
    instances: dict[tuple[str, str], InstanceView] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "solver": self.solver,
            "status": self.status.value,
            "objective": round(self.objective.total, 6),
            "objective_terms": {k: round(v, 6) for k, v in self.objective.as_dict().items()},
            "solve_seconds": round(self.solve_seconds, 6),
            "placement": placement_to_json(self.placement),
            "operations": [op.to_json() for op in self.operations],
            "predicted": self.predicted.as_dict(),
            "unserved": [{"session": s, "constraint": why} for s, why in sorted(self.unserved.items())],
        }
        if self.instances:
            out["engines"] = [view.to_json() for _, view in sorted(self.instances.items())]
        out.update(self.extra)
        return out


def make_plan(
    problem: Problem,
    solver: str,
    target: Mapping[tuple[StateObject, Location], int],
    unserved: Mapping[str, str],
    reasons: Mapping[StateObject, str] | None = None,
    status: PlanStatus | None = None,
    solve_seconds: float = 0.0,
    *,
    now: ResidencyIndex | None = None,
    demand: Demand | None = None,
) -> Plan:
    """The plan that reaches `target`: its operations, objective and predicted metrics.

    On engine nodes the target is first made one the engines can reach (`engine_targets.engine_target`) and
    every move is named as the engine step that carries it out (`engine_plan.attach_steps`).

    `now` (the confirmed placement's index) and `demand` may come from the solver, which built them already.
    """
    placement = (
        copy_placement(target) if min(target.values(), default=1) > 0 else {k: v for k, v in target.items() if v > 0}
    )
    now = now or ResidencyIndex.build(problem, problem.residency)
    before = confirmed_states(problem)
    engines = engine_target(problem, placement, before)  # what engine nodes can reach (engine_targets.py)
    placement = engines.placement
    then = ResidencyIndex.build(problem, placement)
    if before:  # sessions whose engine the plan could not bring up are unserved
        unserved = {**unserved_by_engines(problem, then.serving, unserved), **unserved}
    operations = build_operations(
        problem, placement, reasons, now, then.serving, engines.no_backup, engines.kv_prefill_only
    )
    attach_steps(
        problem,
        operations,
        before,
        engines.after,
        kv_pools(problem, placement, engines.after),
        expert_fractions(problem, placement, engines.after),
    )
    # a step is one call: it waits on all its moves' waits (a restart no order makes safe: a stop, then a start)
    operations = share_step_dependencies(operations, restart_unpairing(problem, before, engines.after, now))
    objective, predicted = evaluate(problem, placement, now, then, demand)
    if status is None:
        status = PlanStatus.PARTIAL if unserved else PlanStatus.OK
    return Plan(
        solver, status, objective, predicted, placement, operations, dict(unserved), solve_seconds,
        instances=engines.after,
    )  # fmt: skip
