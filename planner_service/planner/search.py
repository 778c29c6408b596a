"""Local search over the node (and precision) each model with requests in flight is served on.

The greedy gives those models their best group one at a time, so the first
ones take the best nodes; the exact oracle shows what that costs (a node
given whole to a MoE whose routed experts then fit, dense models packed
together, down to a smaller precision). This search starts from the
greedy's plan and tries, in a fixed order, every swap of two models' nodes,
every move of one model to another node, and serving one model at another
of its precisions on its node. Each candidate is planned by the greedy with
those choices fixed and scored by the evaluator; the first that improves is
taken and the search starts over, until no candidate improves or
`max_plans` plans have been made. Deterministic for a problem.

It costs tens of greedy plans, so it serves where time allows (`plan
--solver search`, what-if questions, the gap study), not the online path.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from planner_service.domain.problem import Problem
from planner_service.planner.greedy import PlanningError, TargetPlan, plan_greedy
from planner_service.planner.objective import evaluate

MAX_PLANS = 200  # under a second at demo size; the search usually settles within 150


@dataclass(frozen=True, slots=True)
class SearchResult:
    target: TargetPlan
    objective: float
    greedy_objective: float
    plans: int  # greedy plans made, the first included
    moves: int  # improving moves taken


def search_nodes(problem: Problem, max_plans: int = MAX_PLANS) -> SearchResult:
    best = plan_greedy(problem)
    greedy_objective = best_objective = _score(problem, best)
    nodes, fixed = _served_nodes(problem, best), {}  # fixed: precisions chosen by a move
    plans, moves = 1, 0
    improved = True
    while improved and plans < max_plans:
        improved = False
        for candidate, precisions in _neighbours(problem, best, nodes, fixed):
            if plans >= max_plans:
                break
            plans += 1
            try:
                target = plan_greedy(problem, candidate, precisions)
            except PlanningError:
                continue  # that assignment leaves no room below GPU for a last copy
            objective = _score(problem, target)
            if objective < best_objective - 1e-9:
                best, best_objective, improved = target, objective, True
                nodes, fixed = _served_nodes(problem, target), precisions
                moves += 1
                break
    return SearchResult(best, best_objective, greedy_objective, plans, moves)


def _score(problem: Problem, target: TargetPlan) -> float:
    objective, _ = evaluate(problem, target.placement, target.now, demand=target.demand)
    return objective.total


def _served_nodes(problem: Problem, target: TargetPlan) -> dict[str, str]:
    """The node of each model with requests in flight that the plan serves."""
    active = {s.model for s in problem.sessions.values() if s.active}
    return {m: group.node for m, group in sorted(target.groups.items()) if m in active}


def _neighbours(
    problem: Problem, plan: TargetPlan, nodes: Mapping[str, str], fixed: Mapping[str, str]
) -> Iterator[tuple[dict[str, str], dict[str, str]]]:
    """(nodes, precisions) to try, in a fixed order: swaps of two models' nodes, moves of one model to
    another node, then one model served at another of its precisions (on its node)."""
    models = sorted(nodes)
    for a, b in itertools.combinations(models, 2):
        if nodes[a] != nodes[b]:
            yield {**nodes, a: nodes[b], b: nodes[a]}, dict(fixed)
    for model in models:
        for node in sorted(problem.nodes):
            if node != nodes[model]:
                yield {**nodes, model: node}, dict(fixed)
    for model in models:
        for precision in problem.models[model].precisions:
            if precision != plan.groups[model].precision:
                yield dict(nodes), {**fixed, model: precision}
