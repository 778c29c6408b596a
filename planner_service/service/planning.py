"""Planning from the live state: snapshots, the online rules' inputs, solves, compare-and-swap installs."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from planner_service.domain.problem import Problem
from planner_service.domain.scenario import (
    ScenarioError,
)
from planner_service.domain.state import (
    Location,
    StateObject,
)
from planner_service.planner.online import (
    engines_in,
    for_real,
    pins,
    worth_adopting,
)
from planner_service.planner.operations import apply_operations
from planner_service.planner.plan import Plan
from planner_service.service.errors import (
    Conflict,
    SolverUnavailable,
)
from planner_service.service.live import (
    PLAN_ATTEMPTS,
    Live,
    Usage,
)
from planner_service.service.queues import Queues
from planner_service.service.records import OpRecord, OpState
from planner_service.solver.registry import solve

log = logging.getLogger(__name__)


class Planning:
    """Planning from the live state: snapshots, the online rules' inputs, solves, compare-and-swap installs."""

    def __init__(self, live: Live, queues: Queues) -> None:
        self.live = live
        self.queues = queues

    def planning_snapshot(
        self, *, stand_ins: bool = False
    ) -> tuple[dict[str, Any], dict[str, dict[str, float]], list[OpRecord]]:
        """Scenario JSON whose residency is the confirmed placement plus what leased operations will do
        (and, for the planning loop, whose sessions include stand-ins for the recent load)."""
        inflight = self.live.inflight()
        residency = apply_operations(self.live.placement, [r.op for r in inflight])
        data = self.live.scenario_data(residency)
        if stand_ins:
            data["sessions"] += self._stand_ins(data)
        return data, self.live.next_model(data, self.live.clock()), inflight

    def _stand_ins(self, data: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Stand-in active sessions for the recent load beyond the requests in flight (`online.RecentLoad`)."""
        models = {m["id"] for m in data["models"]}
        in_flight: dict[str, int] = defaultdict(int)
        for session in data["sessions"]:
            in_flight[session["model"]] += session["active"]
        return [
            {
                "id": s.id,
                "user": s.user,
                "slo": s.slo.value,
                "model": s.model,
                "active": True,
                "context_tokens": s.context_tokens,
            }
            for s in self.live.load.stand_ins(self.live.clock(), in_flight)
            if s.model in models
        ]

    def _usage(self) -> Usage:
        """When each model last ran, which wait past the unpin delay, which wait not served anywhere, and
        whether the current plan has operations not leased yet."""
        now = self.live.clock()
        waiting = [
            (s.model, now - s.waiting_since)
            for s in self.live.sessions.values()
            if s.active and s.waiting_since is not None
        ]
        return Usage(
            now,
            dict(self.live.last_used),
            {model for model, waited in waiting if waited > self.live.settings.unpin_after_seconds},
            {model for model, _ in waiting if model not in self.live.serving},
            any(self.live.ops[i].state is OpState.QUEUED for i in self.live.open_ops),
        )

    @staticmethod
    def _pins(problem: Problem, usage: Usage) -> dict[str, dict[str, str]]:
        """The greedy's `nodes` and `precisions`: engines that served within the planning horizon stay where
        they are, unless a request has waited for its model past the unpin delay (`online.pins`)."""
        engines = engines_in(problem, usage.last_used)
        nodes, precisions = pins(engines, usage.stuck, usage.now, problem.constants.horizon_seconds)
        return {"nodes": nodes, "precisions": precisions}

    def _solve(self, problem: Problem, solver: str, **options: object) -> Plan:
        started = time.perf_counter()
        try:
            plan = solve(problem, solver, **options)
        except ImportError as error:
            raise SolverUnavailable(
                f"solver {solver!r} is not available in this build ({error}); use solver 'greedy'"
            ) from None
        self.live.metrics.plan_duration.labels(solver).observe(time.perf_counter() - started)
        return plan

    def replan(self, *, force: bool = False) -> dict[str, Any]:
        """Plan from the live state as the online rules say (`planner/online.py`: stand-ins for the recent
        load, pinned engines); install a new epoch when the target changed and is worth its moves, or
        when there is no plan yet (always when `force`)."""
        self.live.require_ready()
        with self.live.plan_lock:
            for _ in range(PLAN_ATTEMPTS):
                with self.live.change():
                    self.queues.expire_and_write()
                    data, next_model, _ = self.planning_snapshot(stand_ins=True)
                    usage = self._usage()
                    basis = self._basis()
                    held_due = self.live.held_until is not None and usage.now >= self.live.held_until
                    force = force or self.live.force_replan or held_due
                    self.live.urgent.clear()
                try:
                    problem = self.live.compile(data, next_model)
                except ScenarioError as error:
                    # the operations in flight would overfill a location: nothing may be planned on top of
                    # them (a plan from the confirmed placement alone would repeat their moves); they finish,
                    # fail or expire, and the replan that follows sees where they left the cluster
                    raise Conflict(f"the state in flight cannot be planned until it lands: {error}") from None
                try:
                    try:
                        # pins are the greedy's: the search and the MILP choose every node
                        pinned = self._pins(problem, usage) if self.live.settings.solver == "greedy" else {}
                        plan = self._solve(problem, self.live.settings.solver, **pinned)
                    except SolverUnavailable as error:
                        log.warning("%s; the planning loop falls back to greedy", error.message)
                        plan = self._solve(problem, "greedy", **self._pins(problem, usage))
                except ValueError as error:  # ScenarioError included: the live state itself cannot be planned
                    raise Conflict(f"the live state cannot be planned: {error}") from None
                adopt = worth_adopting(problem, plan, usage.waiting, pending=usage.pending)
                if not force and self.live.plan_doc is not None and not adopt:
                    self.live.metrics.replans.labels("kept").inc()
                    return {"epoch": self.live.epoch, "changed": False}  # staying put is the better deal
                plan = for_real(problem, plan)
                with self.live.change():
                    if self._basis() != basis:
                        continue  # operations went in flight, landed elsewhere or failed while solving: again
                    if not force and self.live.plan_doc is not None and plan.placement == self.live.plan_placement:
                        self.live.metrics.replans.labels("unchanged").inc()
                        return {"epoch": self.live.epoch, "changed": False}
                    self.queues.install(plan, self.live.inflight())  # the same landing place, maybe other operations
                    self.live.metrics.replans.labels("installed").inc()
                    self.live.force_replan = False
                    epoch = self.live.epoch
                break
            else:
                # never installed over a state it was not planned from: the planning loop tries again soon
                self.live.metrics.replans.labels("stale").inc()
                log.info("the state moved during each of %d solves; replanning after the debounce", PLAN_ATTEMPTS)
                self.live.wake(force=force)
                return {"epoch": self.live.epoch, "changed": False}
        self.live.notify()
        return {"epoch": epoch, "changed": True}

    def _basis(self) -> tuple[frozenset[tuple[tuple[StateObject, Location], int]], int]:
        """What a plan is safe against: where the confirmed placement will be once the operations in flight
        land (an operation that lands changes nothing here; one leased, failed or expired since does), and
        the hardware and catalog. Sessions and demand may move on: the next replan catches up with them."""
        landing = apply_operations(self.live.placement, [r.op for r in self.live.inflight()])
        return frozenset(landing.items()), self.live.topology_changes

    def solve(self, problem: Problem, solver: str, **options: object) -> Plan:
        """Solve and time one problem (the planning-duration histogram counts it)."""
        return self._solve(problem, solver, **options)
