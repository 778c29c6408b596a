"""Local search over the node (and precision) each model with requests in flight is served on.

The greedy gives those models their best group one at a time, so the first
ones take the best nodes; the exact oracle shows what that costs (a node
given whole to a MoE whose routed experts then fit, dense models packed
together, down to a smaller precision). This search starts from the
greedy's plan and tries, in a fixed order, every swap of two models' nodes,
every move of one model to another node, serving one model at another of
its precisions on its node, a swap or move together with another
precision for the model that moves (a 70B model fits the other node only
at fp8), and two nodes trading all their models (on gap-study seed 50 the
exact optimum is the greedy's plan with two nodes' four models traded).
Each candidate is planned by the greedy with those choices fixed and
scored by the evaluator; the first that improves is taken and the scan
starts over. Where none improves (a local optimum), the search steps to the
best candidate it has not seen, even a worse one, and goes on from there
(a tabu search: every assignment is planned once); it keeps the best plan
found and stops after `MAX_ESCAPES` such steps without a new best, or at
`max_plans` plans. Deterministic for a problem.

It costs hundreds of greedy plans (about a second at demo size), so it
serves where time allows (`plan --solver search`, what-if questions, the
gap study), not the online path.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from planner_service.domain.problem import Problem
from planner_service.planner.errors import PlanningError
from planner_service.planner.greedy import TargetPlan, plan_greedy
from planner_service.planner.objective import evaluate

MAX_PLANS = 400  # about a second at demo size
MAX_ESCAPES = 3  # steps out of a local optimum without a new best before it stops


@dataclass(frozen=True, slots=True)
class SearchResult:
    target: TargetPlan
    objective: float
    greedy_objective: float
    plans: int  # greedy plans made, the first included
    moves: int  # improving moves taken


def search_nodes(problem: Problem, max_plans: int = MAX_PLANS, max_escapes: int = MAX_ESCAPES) -> SearchResult:
    start = plan_greedy(problem)
    greedy_objective = _score(problem, start)
    best, best_objective = start, greedy_objective
    current, current_objective = start, greedy_objective
    nodes = _served_nodes(problem, start)
    fixed: dict[str, str] = {}  # precisions chosen by a move
    seen = {_key(nodes, fixed)}
    plans, moves, escapes = 1, 0, 0
    while plans < max_plans:
        escape = None  # the best unseen neighbour, taken when none improves (a step out of a local optimum)
        improved = False
        for candidate, precisions in _neighbours(problem, current, nodes, fixed):
            key = _key(candidate, precisions)
            if key in seen:
                continue
            if plans >= max_plans:
                break
            seen.add(key)
            plans += 1
            try:
                target = plan_greedy(problem, candidate, precisions)
            except PlanningError:
                continue  # that assignment leaves no room below GPU for a last copy
            objective = _score(problem, target)
            if objective < current_objective - 1e-9:
                current, current_objective, improved = target, objective, True
                nodes, fixed = _served_nodes(problem, target), precisions
                break
            if escape is None or objective < escape[0]:
                escape = (objective, target, precisions)
        if improved:
            if current_objective < best_objective - 1e-9:
                best, best_objective = current, current_objective
                moves, escapes = moves + 1, 0
            continue
        escapes += 1
        if escape is None or escapes > max_escapes:
            break
        current_objective, current, fixed = escape
        nodes = _served_nodes(problem, current)
    return SearchResult(best, best_objective, greedy_objective, plans, moves)


def _key(
    nodes: Mapping[str, str], precisions: Mapping[str, str]
) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    return tuple(sorted(nodes.items())), tuple(sorted(precisions.items()))


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
    another node, one model served at another of its precisions (on its node), a swap or move with another
    precision for the model that moves, then two nodes trading all their models."""
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
    # a model that fits another node only at another precision (or makes room there only so): both at once
    for a, b in itertools.combinations(models, 2):
        if nodes[a] != nodes[b]:
            for model in (a, b):
                for precision in _other_precisions(problem, plan, model):
                    yield {**nodes, a: nodes[b], b: nodes[a]}, {**fixed, model: precision}
    for model in models:
        for node in sorted(problem.nodes):
            if node != nodes[model]:
                for precision in _other_precisions(problem, plan, model):
                    yield {**nodes, model: node}, {**fixed, model: precision}
    # two nodes trade all their models (no single swap or move reaches that from two models on one node)
    for x, y in itertools.combinations(sorted(problem.nodes), 2):
        traded = {m: y if n == x else x if n == y else n for m, n in nodes.items()}
        if traded != nodes:
            yield traded, dict(fixed)


def _other_precisions(problem: Problem, plan: TargetPlan, model: str) -> list[str]:
    return [p for p in problem.models[model].precisions if p != plan.groups[model].precision]
