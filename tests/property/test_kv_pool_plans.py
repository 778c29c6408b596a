"""Property tests on engine nodes: in every plan (greedy, search, MILP) each vLLM / SGLang engine the plan
starts, wakes or restarts is launched with a KV pool of at least one request of its model's maximum
context, and the sessions' KV predicted on each GPU of every engine running after the plan stays within
that engine's pool (the pool it is launched with, or the one it runs with as it is)."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from test_engine_plans import engine_scenarios

from planner_service.domain.engines import EngineState, Transition
from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.problem import Problem
from planner_service.domain.scenario import Scenario
from planner_service.domain.state import Kind, Tier
from planner_service.planner import engine_holdings, engine_instances
from planner_service.planner.plan import Plan
from planner_service.solver.registry import solve

SETTINGS = settings(
    max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
LAUNCHES = (Transition.START, Transition.RESTART, Transition.WAKE)


def _pools_hold(problem: Problem, plan: Plan) -> None:
    before = engine_instances.confirmed_states(problem)
    launched: dict[tuple[str, str], int] = {}
    for op in plan.operations:
        step = op.engine
        if step is None or step.transition not in LAUNCHES:
            continue
        least = engine_holdings.min_pool_bytes_per_gpu(problem, step.instance.model, len(step.instance.gpus))
        assert step.instance.kv_pool_bytes_per_gpu >= least, (op.id, step.instance.id, least)
        # in tokens (SGLang's --max-total-tokens), the pool holds one request of the instance's longest context
        if step.instance.max_context_tokens and problem.models[step.instance.model].kv_bytes_per_token:
            assert step.instance.kv_pool_tokens >= step.instance.max_context_tokens, (op.id, step.instance.id)
        launched[(op.node, step.instance.model)] = step.instance.kv_pool_bytes_per_gpu
    running_now = engine_holdings.launched_pools(problem, before)
    kv: dict[tuple[str, str], int] = defaultdict(int)
    for (obj, loc), nbytes in plan.placement.items():
        if obj.kind is Kind.KV and loc.tier is Tier.GPU:
            kv[(obj.model, loc.id)] += nbytes
    for key, view in plan.instances.items():
        if view.state is not EngineState.RUNNING:
            continue
        b = before[key]
        if key in launched:
            pool = launched[key]
        else:
            assert b.state is EngineState.RUNNING and b.same_instance(view), (key, b, view)
            pool = running_now[key]
        for g in view.gpus:
            assert kv[(view.model, g)] <= pool, (key, g, kv[(view.model, g)], pool)


@SETTINGS
@given(engine_scenarios())
def test_greedy_plans_launch_pools_the_engines_start_with_and_keep_kv_within_them(scenario: Scenario) -> None:
    problem = problem_from_scenario(scenario)
    _pools_hold(problem, solve(problem))


@settings(SETTINGS, max_examples=25)
@given(engine_scenarios(max_gpus=6, max_models=3, max_sessions=10))
def test_search_plans_launch_pools_the_engines_start_with_and_keep_kv_within_them(scenario: Scenario) -> None:
    problem = problem_from_scenario(scenario)
    _pools_hold(problem, solve(problem, "search"))


@settings(SETTINGS, max_examples=15)
@given(engine_scenarios(max_gpus=6, max_models=3, max_sessions=10))
def test_milp_plans_launch_pools_the_engines_start_with_and_keep_kv_within_them(scenario: Scenario) -> None:
    problem = problem_from_scenario(scenario)
    _pools_hold(problem, solve(problem, "milp", time_limit_seconds=2.0))
