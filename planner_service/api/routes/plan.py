from __future__ import annotations

from fastapi import APIRouter, Query

from planner_service.api.deps import OperatorDep, RouterAccessDep, ServiceDep
from planner_service.service import questions
from planner_service.wire.plan import CurrentPlanOut, ExplainOut, ParetoOut, ReplanOut

router = APIRouter(tags=["plan"])


@router.get("/v1/plan", response_model=CurrentPlanOut, response_model_exclude_unset=True)
def get_plan(service: ServiceDep, _: RouterAccessDep) -> CurrentPlanOut:
    """The current plan (as `statebudget plan --json`) with its `epoch`."""
    return CurrentPlanOut.model_validate(service.plan_view())


@router.post("/v1/plan", response_model=ReplanOut, response_model_exclude_unset=True)
def replan(service: ServiceDep, _: OperatorDep) -> ReplanOut:
    """Replan now: a new epoch supersedes the operations not yet leased. Returns the new plan, as GET does."""
    changed = service.replan(force=True)["changed"]
    return ReplanOut.model_validate({**service.plan_view(), "changed": changed})


@router.get("/v1/pareto", response_model=ParetoOut, response_model_exclude_unset=True)
def get_pareto(service: ServiceDep, _: OperatorDep) -> ParetoOut:
    """Predicted P95 switch latency against warm GPU bytes for the current workload."""
    return ParetoOut.model_validate(questions.pareto(service.live_view(), service.solve))


@router.get("/v1/explain", response_model=ExplainOut, response_model_exclude_unset=True)
def explain(
    service: ServiceDep,
    _: OperatorDep,
    model: str | None = Query(None, description="A model id."),
    session: str | None = Query(None, description="A session id."),
) -> ExplainOut:
    """Why each state object of a model (or a session) sits where it does, now and in the plan."""
    return ExplainOut.model_validate(questions.explain(service.live_view(), model=model, session=session))
