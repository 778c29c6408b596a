"""Test doubles and helpers shared across test folders (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planner_service.domain.predictions import problem_from_scenario
from planner_service.planner.greedy import plan_greedy
from planner_service.planner.invariants import check_plan
from planner_service.planner.plan import Plan, make_plan
from planner_service.solver.gap import random_scenarios

TINY_SCENARIO = Path(__file__).parent / "service" / "tiny_scenario.json"


class FakeClock:
    """A clock tests move by hand instead of sleeping."""

    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class CallLog:
    """Records, in order, the calls of some methods of one live object (wrapped on the instance), so that a
    test can wait for what a background thread or a long-poll did instead of sleeping.

    `log.wait_for(lambda calls: ..., what="...")` blocks until the predicate holds over the list of
    `(method name, result)` pairs, or fails after `timeout` seconds: a bound against a hang, never a
    measurement."""

    def __init__(self, target: object, *names: str) -> None:
        self.calls: list[tuple[str, Any]] = []
        self._changed = threading.Condition()
        for name in names:
            setattr(target, name, self._wrap(name, getattr(target, name)))

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            with self._changed:
                self.calls.append((name, result))
                self._changed.notify_all()
            return result

        return recorded

    def names(self) -> list[str]:
        with self._changed:
            return [name for name, _ in self.calls]

    def wait_for(
        self, predicate: Callable[[list[tuple[str, Any]]], bool], *, what: str, timeout: float = 20.0
    ) -> list[tuple[str, Any]]:
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(self.calls), timeout):
                raise AssertionError(f"timed out waiting for {what}; calls so far: {[n for n, _ in self.calls]}")
            return list(self.calls)


def after_last(calls: list[tuple[str, Any]], name: str) -> list[tuple[str, Any]]:
    """The calls after the last call of `name` (all of them if there is none)."""
    positions = [i for i, (n, _) in enumerate(calls) if n == name]
    return calls[positions[-1] + 1 :] if positions else list(calls)


def greedy_gap_plan(seed: int, *, engines: bool) -> Plan:
    """The greedy's plan alone for one gap-study scenario (`statebudget gap`, demo-sized), checked sound."""
    ((_, drawn),) = random_scenarios(1, seed, 16, 7, 100, engines=engines)
    problem = problem_from_scenario(drawn)
    target = plan_greedy(problem)
    plan = make_plan(problem, "greedy", target.placement, target.unserved, target.reasons)
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    return plan
