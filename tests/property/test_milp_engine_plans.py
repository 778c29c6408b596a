"""The MILP oracle on engine nodes: the same random problems as `test_engine_plans.py` (random engine kinds,
features and management per node, sleepers reported, running engines pinned), kept small so that a solve of a second or two proves or nearly proves
them. The oracle's own plan passes the whole checker (capacities with KV pools and sleeping engines'
contexts included), its operations are ones the node's kind offers with their preconditions true in any
order `depends_on` allows, and the plan it returns is sound.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine_plans import Planned, _offered, _steps_hold_in_some_order, engine_problems

from planner_service.planner.invariants import check_plan
from planner_service.solver.registry import solve

SMALL = {"max_gpus": 4, "max_models": 3, "max_sessions": 8}


@settings(max_examples=6, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine_problems(**SMALL), st.randoms(use_true_random=False))
def test_milp_plans_on_engine_nodes_are_offered_in_every_order(planned: Planned, rng: random.Random) -> None:
    problem = planned.problem
    plan = solve(problem, "milp", time_limit_seconds=1.5)
    details = plan.extra["milp"]
    assert details["invariant_errors"] == []  # the solver's own plan, whether or not it is the one returned
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    _offered(problem, plan.operations)
    _steps_hold_in_some_order(problem, plan.operations, rng, fits=True)
