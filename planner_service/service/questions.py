"""Questions about the live state that never change it: what-if, the Pareto curve, explain.

Each works on a `LiveView`, a copy the service hands out under its lock, and
plans with a `solve` callable the service provides (so plan durations are
measured the same way as the online loop's).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from planner_service.domain.problem import Problem, compile_problem
from planner_service.domain.scenario import ScenarioError
from planner_service.domain.state import Kind, Placement, StateObject, Tier
from planner_service.planner.plan import Plan
from planner_service.planner.predictor import SwitchPredictor
from planner_service.service import changes as edits
from planner_service.service.errors import Conflict, InvalidInput, NotFound
from planner_service.service.inputs import WhatIfIn
from planner_service.service.live import LiveState
from planner_service.service.published import InstalledPlan
from planner_service.service.records import OpRecord, SessionState

GIB = 2**30
PARETO_PRICES = (0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
PARETO_CAPACITY_FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

Solve = Callable[..., Plan]


@dataclass(frozen=True)
class LiveView:
    state: LiveState  # the confirmed placement plus what leased operations will do
    next_model: dict[str, dict[str, float]]
    predictor: SwitchPredictor  # a copy
    ended: frozenset[str]
    now: float
    epoch: int
    srv_version: int
    plan: InstalledPlan | None  # immutable: shared, not copied
    sizes: Problem  # sizes, capacities and bandwidths of the live state
    placement: Placement  # confirmed
    plan_placement: Placement
    plan_ops: list[OpRecord]
    sessions: dict[str, SessionState]


def what_if(view: LiveView, body: WhatIfIn, solve: Solve) -> dict[str, Any]:
    """Apply the changes to a copy of the live scenario and plan it."""
    scenario = view.state.full_scenario()
    try:
        for i, change in enumerate(body.changes):
            scenario = edits.apply_change(scenario, change, f"changes[{i}]")
        scenario = edits.validated(scenario)
        for m in scenario.models:
            view.predictor.add_model(m.id)
        current = {s.id: s.model for s in scenario.sessions if s.id not in view.ended}
        problem = compile_problem(scenario, view.predictor.predict_sessions(current, view.now))
    except (edits.ChangeError, ScenarioError) as error:
        raise InvalidInput(str(error), field=edits.field_of(str(error))) from None
    options: dict[str, object] = {"time_limit_seconds": body.time_limit_seconds} if body.solver == "milp" else {}
    try:
        plan = solve(problem, body.solver, **options)
    except ValueError as error:
        raise InvalidInput(f"the changed scenario cannot be planned: {error}") from None
    return {
        "solver": body.solver,
        "changes": len(body.changes),
        "based_on_epoch": view.epoch,
        "predicted": plan.predicted.as_dict(),
        "baseline_predicted": view.plan.predicted.model_dump(mode="json") if view.plan is not None else None,
        "plan": plan.to_json(),
    }


def pareto(view: LiveView, solve: Solve) -> dict[str, Any]:
    """Predicted P95 switch latency against warm GPU bytes for the current workload.

    Two sweeps of the warm-memory budget, each point one greedy plan:
    - `gpu_price_seconds_per_gib` over a log grid, from the live placement;
    - `gpu_capacity_fraction`: every GPU shrunk to a fraction of its HBM,
      planned from cold GPUs (what is on GPU now is ignored; lower tiers stay).
    The frontier keeps the points no other point beats on both axes, with the
    P95 seconds each extra GiB buys between neighbours.
    """
    try:
        problem = view.state.problem(view.next_model)
    except ScenarioError as error:
        raise Conflict(f"the live state cannot be planned: {error}") from None
    points: list[dict[str, Any]] = []

    def point(knob: str, value: float, variant: Problem) -> None:
        plan = solve(variant, "greedy")
        points.append(
            {
                knob: value,
                "gpu_bytes": plan.predicted.gpu_bytes,
                "switch_latency_p95_seconds": round(plan.predicted.switch_latency_p95_seconds, 6),
                "switch_latency_mean_seconds": round(plan.predicted.switch_latency_mean_seconds, 6),
                "unserved_sessions": len(plan.unserved),
            }
        )

    for price in PARETO_PRICES:
        constants = problem.constants.model_copy(update={"gpu_price_seconds_per_gib": price})
        point("gpu_price_seconds_per_gib", price, dataclasses.replace(problem, constants=constants))
    below_gpu = {k: v for k, v in problem.residency.items() if k[1].tier is not Tier.GPU}
    for fraction in PARETO_CAPACITY_FRACTIONS:
        gpus = {
            g.id: dataclasses.replace(g, capacity_bytes=int(g.capacity_bytes * fraction)) for g in problem.gpus.values()
        }
        point("gpu_capacity_fraction", fraction, dataclasses.replace(problem, gpus=gpus, residency=below_gpu))
    frontier: list[dict[str, Any]] = []
    for p in sorted(points, key=lambda p: (p["gpu_bytes"], p["switch_latency_p95_seconds"])):
        if not frontier or p["switch_latency_p95_seconds"] < frontier[-1]["switch_latency_p95_seconds"]:
            if frontier:
                extra_gib = (p["gpu_bytes"] - frontier[-1]["gpu_bytes"]) / GIB
                saved = frontier[-1]["switch_latency_p95_seconds"] - p["switch_latency_p95_seconds"]
                p = {**p, "p95_seconds_saved_per_gib": round(saved / extra_gib, 6) if extra_gib > 0 else None}
            frontier.append(p)
    return {
        "gpu_price_seconds_per_gib": problem.constants.gpu_price_seconds_per_gib,
        "points": points,
        "frontier": frontier,
    }


def explain(view: LiveView, *, model: str | None = None, session: str | None = None) -> dict[str, Any]:
    """Why each state object of a model (or a session) sits where it does, now and in the plan."""
    if (model is None) == (session is None):
        raise InvalidInput("give exactly one of the query parameters 'model' or 'session'", field="model")
    sizes = view.sizes
    both = (view.placement, view.plan_placement)
    if model is not None:
        if model not in sizes.models:
            raise NotFound(f"unknown model {model!r}; known: {sorted(sizes.models)}")
        spec = sizes.models[model]
        objects = [StateObject.weights(model, p) for p in spec.precisions]
        if spec.is_moe:
            objects.append(StateObject.experts(model))
        kv_sessions = {
            o.session for pl in both for o, _ in pl if o.kind is Kind.KV and o.model == model and o.session is not None
        }
        objects += [StateObject.kv(model, s) for s in sorted(kv_sessions)]
        subject: dict[str, Any] = {"model": model}
        models = [model]
    else:
        if session not in view.sessions:
            raise NotFound(f"unknown session {session!r}")
        s = view.sessions[session]
        kv_models = {o.model for pl in both for o, _ in pl if o.kind is Kind.KV and o.session == session} | {s.model}
        objects = [StateObject.kv(m, session) for m in sorted(kv_models)]
        objects += [StateObject.weights(s.model, p) for p in sizes.models[s.model].precisions]
        subject = {"session": session, "session_model": s.model, "session_active": s.active}
        models = [s.model]
    unserved = {u.session: u.constraint for u in view.plan.unserved} if view.plan is not None else {}
    active = {
        m: sorted(sid for sid, s in view.sessions.items() if s.model == m and s.active and not s.ended) for m in models
    }
    return {
        **subject,
        "epoch": view.epoch,
        "srv_version": view.srv_version,
        "active_sessions": active,
        "predicted_requests": {m: round(_demand(view.next_model, m), 4) for m in models},
        "objects": [
            _explain_object(view, obj, active.get(obj.model) or _active(view, obj.model), unserved) for obj in objects
        ],
    }


def _demand(next_model: Mapping[str, Mapping[str, float]], model: str) -> float:
    """Expected requests for the model: the sum over sessions of the chance their next one goes there."""
    return sum(row.get(model, 0.0) for row in next_model.values())


def _active(view: LiveView, model: str) -> list[str]:
    return sorted(sid for sid, s in view.sessions.items() if s.model == model and s.active and not s.ended)


def _explain_object(view: LiveView, obj: StateObject, active: list[str], unserved: Mapping[str, str]) -> dict[str, Any]:
    sizes = view.sizes

    def where(placement: Placement) -> list[dict[str, Any]]:
        return [{"location": loc.to_json(), "bytes": n} for (o, loc), n in sorted(placement.items()) if o == obj]

    planned = where(view.plan_placement)
    ops = [
        {"id": r.id, "action": r.op.action.value, "state": r.state.value, "bytes": r.op.bytes, "reason": r.op.reason}
        for r in sorted(view.plan_ops, key=lambda r: (r.epoch, r.seq))
        if r.op.object == obj
    ]
    if (
        obj.kind is Kind.KV and obj.session is not None
    ):  # the whole history, from the live record (sizes may predate it)
        session = view.sessions.get(obj.session)
        size = session.context_tokens * sizes.models[obj.model].kv_bytes_per_token if session else 0
    else:
        size = sizes.size_of(obj)
    on_gpu = sum(e["bytes"] for e in planned if e["location"]["tier"] == "gpu")
    demand = _demand(view.next_model, obj.model)
    gib = size / GIB
    if on_gpu:
        why = f"{on_gpu / GIB:.2f} of {gib:.2f} GiB on GPU in the plan: " + (
            "requests in flight need it" if active else f"{demand:.2f} predicted requests make it worth its HBM"
        )
    elif waiting := [f"{sid}: {unserved[sid]}" for sid in active if sid in unserved]:
        why = "active requests wait for room: " + "; ".join(waiting)
    elif obj.kind is Kind.WEIGHTS and any(
        o.kind is Kind.WEIGHTS and o.model == obj.model and o.precision != obj.precision and loc.tier is Tier.GPU
        for o, loc in view.plan_placement
    ):
        why = "the model is served at another precision in the plan"
    else:
        price = sizes.constants.gpu_price_seconds_per_gib
        free = _largest_free_gpu_bytes(view)
        why = (
            f"kept off GPU: {demand:.2f} predicted requests for {obj.model} over the "
            f"{sizes.constants.horizon_seconds:.0f} s horizon do not pay for holding {gib:.2f} GiB "
            f"(price {price} s/GiB = {price * gib:.2f} s of objective) against the other uses of HBM"
        )
        if size > free:
            why += f"; no single GPU has {gib:.2f} GiB free in the plan (largest free: {free / GIB:.2f} GiB)"
    return {
        "object": obj.to_json(),
        "size_bytes": size,
        "confirmed": where(view.placement),
        "planned": planned,
        "operations": ops,
        "why": why,
    }


def _largest_free_gpu_bytes(view: LiveView) -> int:
    used: dict[str, int] = defaultdict(int)
    for (_, loc), n in view.plan_placement.items():
        if loc.tier is Tier.GPU:
            used[loc.id] += n
    return max((g.capacity_bytes - used[g.id] for g in view.sizes.gpus.values()), default=0)
