"""Local search over the node each model with requests in flight is served on.

The greedy gives those models their best group one at a time, so the first
ones take the best nodes; the exact oracle shows what that costs (a node
given whole to a MoE whose routed experts then fit, dense models packed
together). This search starts from the greedy's nodes and tries, in a fixed
order, every swap of two models' nodes and every move of one model to
another node. Each candidate is planned by the greedy with those nodes fixed
and scored by the evaluator; the first that improves is taken and the
search starts over, until no candidate improves or `max_plans` plans have
been made. Deterministic for a problem.

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

MAX_PLANS = 200  # at demo size about a second; the search usually settles within 100


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
    nodes = _served_nodes(problem, best)
    plans, moves = 1, 0
    improved = True
    while improved and plans < max_plans:
        improved = False
        for candidate in _neighbours(nodes, sorted(problem.nodes)):
            if plans >= max_plans:
                break
            plans += 1
            try:
                target = plan_greedy(problem, candidate)
            except PlanningError:
                continue  # that assignment leaves no room below GPU for a last copy
            objective = _score(problem, target)
            if objective < best_objective - 1e-9:
                best, best_objective, nodes, improved = target, objective, _served_nodes(problem, target), True
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


def _neighbours(nodes: Mapping[str, str], all_nodes: list[str]) -> Iterator[dict[str, str]]:
    """Swaps of two models' nodes, then moves of one model to another node, in a fixed order."""
    models = sorted(nodes)
    for a, b in itertools.combinations(models, 2):
        if nodes[a] != nodes[b]:
            yield {**nodes, a: nodes[b], b: nodes[a]}
    for model in models:
        for node in all_nodes:
            if node != nodes[model]:
                yield {**nodes, model: node}
