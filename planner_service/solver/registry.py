"""Every solver by name: the planner's greedy and search, and the MILP oracle.

The oracle registers itself here, a layer above the planner, and imports
OR-Tools only when it is asked for a plan.
"""

from __future__ import annotations

from typing import Any

from planner_service.domain.problem import Problem
from planner_service.planner.plan import Plan
from planner_service.planner.registry import SolverName, SolverRegistry, planner_registry


def _milp(problem: Problem, **options: Any) -> Plan:  # `solve_milp`'s keywords, checked by its signature
    from planner_service.solver.milp import solve_milp  # OR-Tools loads only when the oracle is used

    return solve_milp(problem, **options)


def default_registry() -> SolverRegistry:
    registry = planner_registry()
    registry.register(SolverName.MILP, _milp)
    return registry


def solve(problem: Problem, solver: str = SolverName.GREEDY, **options: object) -> Plan:
    return default_registry().get(solver)(problem, **options)
