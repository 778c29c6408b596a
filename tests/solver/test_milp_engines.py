"""The MILP's plans on vLLM nodes go through the engine model as the greedy's do (planner/plan.py's
make_plan) and pass the same checker: the restart that pays is one engine step, the shift that does not
pay moves no engine."""

from __future__ import annotations

import pytest
from solver_cases import gpu, held, model, node, problem_of, session, weights

from planner_service.domain.engines import Transition
from planner_service.domain.units import GIB
from planner_service.planner.invariants import check_plan
from planner_service.solver.registry import solve

VLLM = {"kind": "vllm", "features": ["lmcache", "sleep_mode", "dev_mode"]}


@pytest.mark.parametrize(("b_active", "steps"), [(True, {Transition.RESTART, Transition.START}), (False, set())])
def test_milp_plans_on_vllm_nodes_are_engine_steps(b_active: bool, steps: set[Transition]) -> None:
    """One 26 GiB card whose vLLM engine serves a at bf16 (16 GiB); b (12 GiB) fits beside a only at fp8."""
    engines = [{"model": "a", "gpus": ["g0"], **VLLM}, {"model": "b", "gpus": ["g0"], **VLLM}]
    problem = problem_of(
        [{**node("n0", gpu("g0", 26)), "engines": engines}],
        [model("a", {"bf16": 16, "fp8": 8}), model("b", {"bf16": 12})],
        [session("s1", "a", active=True, tokens=4096), session("s2", "b", active=b_active, tokens=8192)],
        [
            held(weights("a"), "gpu", "g0", 16 * GIB),
            held(weights("a"), "nvme", "n0", 16 * GIB),
            held(weights("a", "fp8"), "nvme", "n0", 8 * GIB),
            held(weights("b"), "nvme", "n0", 12 * GIB),
        ],
    )
    plan = solve(problem, "milp", time_limit_seconds=20)
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    made = {op.engine.transition for op in plan.operations if op.engine is not None}
    assert made - {Transition.READAHEAD} == steps
