"""Plans and the questions asked of them: the current plan, what-if, the Pareto curve, explain."""

from __future__ import annotations

from pydantic import Field

from planner_service.wire.base import WireModel
from planner_service.wire.enums import Action, MilpBackend, OperationState, PlanStatus, SolverName
from planner_service.wire.operations import HeldBack, Operation
from planner_service.wire.state import Location, PlacementEntry, StateObject


class ObjectiveTerms(WireModel):
    """The objective's terms, in seconds of SLO-weighted switch latency (`total` is their sum)."""

    total: float
    switch_latency: float
    violations: float
    decode_slowdown: float
    degraded_precision: float
    gpu_memory: float
    moves: float
    unserved: float


class Predicted(WireModel):
    """What the plan is predicted to buy over the horizon."""

    switch_latency_p50_seconds: float
    switch_latency_p95_seconds: float
    switch_latency_mean_seconds: float
    slo_violation_rate: float
    gpu_bytes: int
    unserved_sessions: list[str]


class Unserved(WireModel):
    session: str
    constraint: str = Field(description="Why the session's request cannot be served.")


class SearchInfo(WireModel):
    """What the local search (solver `search`) did beyond the greedy."""

    greedy_objective: float
    plans: int
    moves: int


class MilpInfo(WireModel):
    """How the MILP oracle (solver `milp`) got its plan."""

    backend: MilpBackend | None
    solver_status: str | int | None = Field(description="The backend's own status: a name (CP-SAT) or a code.")
    plan_from: SolverName = Field(description="milp, or greedy when the greedy plan evaluates no worse.")
    model_objective: float | None
    milp_plan_objective: float | None
    greedy_objective: float | None
    greedy_model_objective: float
    unavoidable: float
    solver_seconds: float
    solver_cpu_seconds: float | None
    variables: int
    constraints: int
    invariant_errors: list[str]
    greedy_invariant_errors: list[str] = Field(
        default_factory=list, description="The greedy plan's invariant findings (the first five): why it lost."
    )


class PlanOut(WireModel):
    """A plan: the target placement, the operations that reach it, and what it is predicted to buy.

    Solver `search` adds `search`; solver `milp` adds `bound`, `gap` and `milp`.
    """

    solver: SolverName
    status: PlanStatus
    objective: float
    objective_terms: ObjectiveTerms
    solve_seconds: float
    placement: list[PlacementEntry]
    operations: list[Operation]
    predicted: Predicted
    unserved: list[Unserved]
    search: SearchInfo | None = None
    bound: float | None = Field(None, description="MILP: the solver's bound on the model objective.")
    gap: float | None = Field(None, description="MILP: relative gap between the plan's objective and the bound.")
    milp: MilpInfo | None = None


class CurrentPlanOut(PlanOut):
    """The plan the queues carry out: its operations are queued (ids qualified by the epoch)."""

    held_back: list[HeldBack] = Field(default_factory=list)
    epoch: int
    planned_at: str | None = Field(description="ISO 8601, UTC.")
    based_on_srv_version: int


class ReplanOut(CurrentPlanOut):
    changed: bool = Field(description="A new epoch was installed.")


class WhatIfOut(WireModel):
    solver: SolverName
    changes: int = Field(description="How many changes were applied.")
    based_on_epoch: int
    predicted: Predicted
    baseline_predicted: Predicted | None = Field(description="The current plan's prediction; null: no plan yet.")
    plan: PlanOut


class ParetoPoint(WireModel):
    """One greedy plan of a sweep: by warm-memory price (`gpu_price_seconds_per_gib`) or by GPU capacity
    (`gpu_capacity_fraction`); on the frontier, the P95 seconds each extra GiB buys."""

    gpu_price_seconds_per_gib: float | None = None
    gpu_capacity_fraction: float | None = None
    gpu_bytes: int
    switch_latency_p95_seconds: float
    switch_latency_mean_seconds: float
    unserved_sessions: int
    p95_seconds_saved_per_gib: float | None = None


class ParetoOut(WireModel):
    gpu_price_seconds_per_gib: float = Field(description="The live price.")
    points: list[ParetoPoint]
    frontier: list[ParetoPoint]


class Held(WireModel):
    """Bytes of the explained object at one location."""

    location: Location
    bytes: int


class ExplainedOperation(WireModel):
    id: str
    action: Action
    state: OperationState
    bytes: int
    reason: str


class ExplainedObject(WireModel):
    object: StateObject
    size_bytes: int
    confirmed: list[Held]
    planned: list[Held]
    operations: list[ExplainedOperation]
    why: str


class ExplainOut(WireModel):
    """Why each state object of a model (`model`) or of a session (`session`) sits where it does."""

    model: str | None = None
    session: str | None = None
    session_model: str | None = None
    session_active: bool | None = None
    epoch: int
    srv_version: int
    active_sessions: dict[str, list[str]] = Field(description="Model -> its sessions with a request in flight.")
    predicted_requests: dict[str, float] = Field(description="Model -> requests predicted over the horizon.")
    objects: list[ExplainedObject]
