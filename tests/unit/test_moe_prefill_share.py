"""A MoE's predicted re-prefills are priced at the plan's own expert share: the experts a plan puts on GPU spare
the prefill streaming them (`costs.expert_prefill_seconds`), in the evaluator, the greedy and the MILP alike."""

from __future__ import annotations

from typing import Any

import pytest
from tiny_clusters import GIB, experts, gpu, held, model, node, on_gpu, on_nvme, scenario, session, weights

from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.problem import Problem
from planner_service.domain.scenario import parse_scenario
from planner_service.domain.state import Location, StateObject, Tier
from planner_service.planner import costs
from planner_service.planner.invariants import check_plan
from planner_service.planner.objective import Demand, evaluate
from planner_service.planner.plan import Plan
from planner_service.solver.registry import solve

EXPERTS = 48 * GIB
TOKENS = 32_768


def served_moe() -> dict[str, Any]:
    """m (4 GiB of weights, 48 GiB of routed experts in 192 experts of 1/4 GiB) served on n0's 64 GiB card
    with none of its experts there; one idle session of 32,768 tokens whose next request is predicted on m.
    A request decodes one token (`output_tokens_per_request`), so the experts' worth is their prefill's alone:
    32,768 tokens in 16 chunks of 2,048, each streaming all 48 GiB at 20 GB/s (41.2 s), against the 0.96 s the
    48 GiB cost on GPU."""
    return scenario(
        [node("n0", gpu("g0", 64))],
        [model("m", 4, experts_bytes=EXPERTS, expert_bytes=GIB // 4)],
        [session("s", "m", tokens=TOKENS)],
        [
            held(weights("m"), on_gpu("g0"), 4 * GIB),
            held(weights("m"), on_nvme("n0"), 4 * GIB),
            held(experts("m"), on_nvme("n0"), EXPERTS),
        ],
        constants={"output_tokens_per_request": 1},
    )


def problem_of(data: dict[str, Any]) -> Problem:
    return problem_from_scenario(parse_scenario(data))


def gpu_experts(plan: Plan) -> int:
    return sum(
        n for (obj, loc), n in plan.placement.items() if obj == StateObject.experts("m") and loc.tier is Tier.GPU
    )


def test_the_evaluator_prices_predicted_re_prefills_at_the_plans_expert_share() -> None:
    """The same placement with and without all of m's experts on g0: the predicted request's switch latency
    differs by the expert prefill of its history with none on GPU, times its SLO weight and probability."""
    problem = problem_of(served_moe())
    without = dict(problem.residency)
    with_experts = {**without, (StateObject.experts("m"), Location.gpu("g0")): EXPERTS}
    demand = Demand.of(problem)
    m = problem.models["m"]
    wq = float(demand.q[demand.row["m"], demand.position["s"]] * demand.slo_weight[demand.position["s"]])
    streamed = costs.expert_prefill_seconds(TOKENS, m, 0.0, [problem.gpus["g0"]], problem.constants)
    assert streamed == pytest.approx(16 * EXPERTS / 20e9, rel=1e-4)  # each chunk touches all but 2e-5 of them
    assert wq > 0
    switch_without = evaluate(problem, without)[0].switch_latency
    switch_with = evaluate(problem, with_experts)[0].switch_latency
    assert switch_without - switch_with == pytest.approx(wq * streamed)


@pytest.mark.parametrize("solver", ["greedy", "milp"])
def test_experts_go_on_gpu_where_their_prefill_alone_pays_for_them(solver: str) -> None:
    """Decode saves 0.003 s for the first 3 GiB of experts, less than their 0.06 s of HBM: only the prefill they
    spare pays for them, and every plan holds all 48 GiB (the greedy and the MILP left them on NVMe when the
    evaluator priced the prefill at the share on GPU now, none)."""
    problem = problem_of(served_moe())
    plan = solve(problem, solver)
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    assert gpu_experts(plan) == EXPERTS
