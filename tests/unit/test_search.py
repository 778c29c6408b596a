"""The local search over nodes: never worse than the greedy, sound plans, deterministic, nodes respected."""

from __future__ import annotations

import numpy as np
import pytest

from planner_service.domain.generate import random_scenario
from planner_service.domain.predictions import problem_from_scenario
from planner_service.planner import joint
from planner_service.planner.greedy import plan_greedy
from planner_service.planner.invariants import check_plan
from planner_service.planner.objective import evaluate
from planner_service.planner.search import _neighbours, search_nodes
from planner_service.solver.registry import solve


def problem(seed: int, gpus: int = 8, models: int = 5, sessions: int = 24):
    return problem_from_scenario(random_scenario(np.random.default_rng(seed), gpus, models, sessions))


@pytest.mark.parametrize("seed", range(6))
def test_search_is_never_worse_than_the_greedy_and_its_plan_is_sound(seed: int) -> None:
    p = problem(seed)
    greedy = solve(p, "greedy")
    searched = solve(p, "search", max_plans=40)
    assert searched.objective.total <= greedy.objective.total + 1e-9
    assert searched.extra["search"]["greedy_objective"] == pytest.approx(greedy.objective.total, abs=1e-6)
    assert check_plan(p, searched.placement, searched.operations, searched.unserved) == []


def test_search_finds_a_better_assignment_where_the_greedy_takes_the_best_node_first() -> None:
    # demo-sized seed 87: two moves from the greedy's nodes lower 3327.6 to 3261.7
    p = problem(87, gpus=16, models=7, sessions=100)
    found = search_nodes(p)
    assert found.moves >= 1
    assert found.objective < found.greedy_objective - 1.0


def test_search_is_deterministic() -> None:
    p = problem(3)
    first, second = search_nodes(p, max_plans=30), search_nodes(p, max_plans=30)
    assert first.target.placement == second.target.placement
    assert (first.plans, first.moves) == (second.plans, second.moves)


def test_greedy_serves_a_model_on_the_node_it_is_given() -> None:
    p = problem(2)
    free_choice = plan_greedy(p)
    model, group = next(iter(sorted(free_choice.groups.items())))
    elsewhere = next(n for n in sorted(p.nodes) if n != group.node)
    placed = plan_greedy(p, {model: elsewhere})
    assert placed.groups[model].node == elsewhere != group.node


def test_search_steps_out_of_a_local_optimum(monkeypatch: pytest.MonkeyPatch) -> None:
    # demo-sized seed 100: descent stops at the greedy's 7797.3 (no single move or swap improves); stepping to
    # the best unseen neighbour and going on reaches 7728.2 within the 400 plans. (Seeds 83 and 99 showed
    # this, 7722.7 -> 7522.0 and 5871.7 -> 5809.7, until the greedy priced the prefill's attention in its
    # re-prefill estimates and reached those itself; seed 73 before the tensor-parallel all-reduce was
    # priced, 5122.2 -> 5043.3.)
    monkeypatch.setattr(joint, "MAX_BOUND_STEPS", 3000)
    p = problem(100, gpus=16, models=7, sessions=100)
    descent = search_nodes(p, max_escapes=0)
    tabu = search_nodes(p)
    assert descent.moves == 0
    assert tabu.objective < descent.objective - 50.0
    assert tabu.plans <= 400


def test_search_trades_the_models_of_two_nodes() -> None:
    # demo-sized seed 50: the plan with n0's three models on n2 and n2's one on n0 (14167.4) is beaten by the
    # same plan with the two L40 nodes' models traded (13771.1), which no swap or move of one model (with or
    # without another precision) reaches (with a MoE's predicted prefills priced at the expert share on its
    # node's GPUs now, not the plan's, 15826.8 and 15475.6; 0.3 lower each before each of DeepSeek-V3's 4 ranks
    # on n3 held and restored its whole MLA latent; before a MoE's prefill priced its routed experts off GPU, 9196.7 and
    # 9028.7: the term adds 6500.4 and 6317.2 s of switch latency and 129.4 and 129.4 s of violations to the
    # same plans, every other term unchanged; before the tensor-parallel all-reduce and the prefill's attention
    # were priced, 6815.0 and 6689.3; before engine transitions were, 4989.9 and 4860.3: the MILP's optimum then)
    p = problem(50, gpus=16, models=7, sessions=100)
    nodes = {
        "m0-deepseek-v3": "n3",
        "m1-glm-4.5-air": "n2",
        "m2-glm-4.5v": "n1",
        "m3-llama-3.1-8b-instruct": "n0",
        "m4-llama-3.3-70b-instruct": "n0",
        "m5-qwen2.5-7b-instruct": "n1",
        "m6-qwen2.5-coder-32b-instruct": "n0",
    }
    start = plan_greedy(p, nodes)
    assert _objective(p, start) == pytest.approx(14167.4, abs=0.1)
    traded = {m: {"n0": "n2", "n2": "n0"}.get(n, n) for m, n in nodes.items()}
    assert (traded, {}) in list(_neighbours(p, start, nodes, {}))
    assert _objective(p, plan_greedy(p, traded)) == pytest.approx(13771.1, abs=0.1)


def _objective(p, target) -> float:
    return evaluate(p, target.placement, target.now, demand=target.demand)[0].total
