"""Solvers behind one protocol, registered by name, and the planner's own: the greedy and its search.

A solver takes a compiled `Problem` and returns a `Plan`. The MILP oracle sits
a layer up and registers itself there (`solver/registry.py` builds the
registry of all of them), so the planner never imports the solver.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Protocol

from planner_service.domain.problem import Problem
from planner_service.planner.greedy import plan_greedy
from planner_service.planner.plan import Plan, make_plan
from planner_service.planner.search import MAX_PLANS, search_nodes
from planner_service.wire.enums import SolverName as SolverName  # noqa: PLC0414 -- re-exported: it was defined here


class Solver(Protocol):
    def __call__(self, problem: Problem, **options: object) -> Plan: ...


@contextmanager
def cycle_collection_paused() -> Iterator[None]:
    """Hold Python's cycle collector off for one plan.

    Planning allocates tens of thousands of short-lived containers and makes no
    reference cycles, so refcounting frees all of it; left on, the collector
    would run mid-plan and walk every long-lived object of the process (the
    problem, the service's state), which is most of the planner's tail latency.
    """
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def _greedy(
    problem: Problem, nodes: Mapping[str, str] | None = None, precisions: Mapping[str, str] | None = None, **_: object
) -> Plan:
    """The greedy plan; `nodes` / `precisions` pin models where they serve (`planner/online.py`)."""
    started = time.perf_counter()
    # (engines that cannot leave their GPUs serve where they are: the greedy pins them itself, `pinned_instances`)
    with cycle_collection_paused():
        target = plan_greedy(problem, nodes, precisions)
        plan = make_plan(
            problem,
            SolverName.GREEDY,
            target.placement,
            target.unserved,
            target.reasons,
            now=target.now,
            demand=target.demand,
        )
    plan.solve_seconds = time.perf_counter() - started
    return plan


def _search(problem: Problem, max_plans: int = MAX_PLANS, **_: object) -> Plan:
    started = time.perf_counter()
    with cycle_collection_paused():
        found = search_nodes(problem, max_plans)
        target = found.target
        plan = make_plan(
            problem,
            SolverName.SEARCH,
            target.placement,
            target.unserved,
            target.reasons,
            now=target.now,
            demand=target.demand,
        )
    plan.solve_seconds = time.perf_counter() - started
    plan.extra["search"] = {
        "greedy_objective": round(found.greedy_objective, 6),
        "plans": found.plans,
        "moves": found.moves,
    }
    return plan


class SolverRegistry:
    def __init__(self) -> None:
        self._solvers: dict[str, Callable[..., Plan]] = {}

    def register(self, name: str, solver: Callable[..., Plan]) -> None:
        if name in self._solvers:
            raise ValueError(f"solver {name!r} is registered already")
        self._solvers[name] = solver

    def get(self, name: str) -> Callable[..., Plan]:
        try:
            return self._solvers[name]
        except KeyError:
            raise ValueError(f"unknown solver {name!r}; choose one of: {', '.join(sorted(self._solvers))}") from None

    def names(self) -> list[str]:
        return sorted(self._solvers)


def planner_registry() -> SolverRegistry:
    """The planner's solvers; `planner_service.solver.registry.default_registry()` adds the MILP oracle."""
    registry = SolverRegistry()
    registry.register(SolverName.GREEDY, _greedy)
    registry.register(SolverName.SEARCH, _search)
    return registry
