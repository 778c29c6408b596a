"""Planning from the live state: snapshots, the online rules' inputs, solves, compare-and-swap installs."""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections import defaultdict
from typing import Any

from planner_service.domain.problem import Problem, Session
from planner_service.domain.state import (
    Location,
    StateObject,
)
from planner_service.planner.plan import Plan
from planner_service.service.errors import (
    Conflict,
    SolverUnavailable,
)
from planner_service.service.landing import LandedEngines, Landing, land, land_engines
from planner_service.service.live import (
    PLAN_ATTEMPTS,
    Live,
    LiveState,
    Usage,
)
from planner_service.service.queues import Queues, plan_document
from planner_service.service.records import OpRecord, OpState
from planner_service.service.solving import PlanRequest, PlanRunner, plan_from
from planner_service.solver.registry import solve

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Turn:
    """One replan that callers wait for: the one that runs it, and those that joined it while it waited."""

    force: bool
    joined: int = 0  # callers that wait for it without running it
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    result: dict[str, Any] | None = None
    error: BaseException | None = None

    def wait(self) -> dict[str, Any]:
        self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


class _Gate:
    """At most one replan in flight and one pending; a caller that finds one pending joins it."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._running = False
        self._pending: _Turn | None = None

    def enter(self, *, force: bool) -> tuple[_Turn, bool]:
        """The turn to wait for, and whether this caller runs it (False: it joined the pending one)."""
        with self._changed:
            if self._pending is not None:
                self._pending.force = self._pending.force or force  # it has not started: it plans as forced
                self._pending.joined += 1
                return self._pending, False
            turn = _Turn(force)
            if self._running:
                self._pending = turn
                while self._running:
                    self._changed.wait()
                self._pending = None
            self._running = True
            return turn, True

    def leave(self, turn: _Turn) -> None:
        with self._changed:
            self._running = False
            turn.done.set()
            self._changed.notify_all()


class Planning:
    """Planning from the live state: snapshots, the online rules' inputs, solves, compare-and-swap installs."""

    def __init__(self, live: Live, queues: Queues, runner: PlanRunner = plan_from) -> None:
        self.live = live
        self.queues = queues
        self.runner = runner  # the solve between snapshot and install: here, or in a worker process (`solving.py`)
        self._gate = _Gate()
        self._answered: frozenset[tuple[str, str]] = frozenset()  # `_waiting()` when the last replan decided

    def planning_snapshot(
        self, *, stand_ins: bool = False
    ) -> tuple[LiveState, dict[str, dict[str, float]], list[OpRecord]]:
        """The live state whose residency is where the confirmed placement lands once the leased operations do,
        each as far as it fits, and whose engines are in the states their steps leave them in (`landing.py`;
        and, for the planning loop, whose sessions include stand-ins for the recent load), its sessions'
        predicted next models and the leased operations."""
        inflight = self.live.inflight()
        landing = self.landing(inflight)
        if landing.capped:
            log.warning(
                "operations in flight do not fit beside the confirmed state; planned as landing only what fits: %s",
                ", ".join(sorted(landing.capped)),
            )
        state = self.live.state(landing.placement)
        reported = LandedEngines(
            dict(state.observed_engines), dict(state.asleep_expert_fractions), dict(state.engine_pools)
        )
        engines = land_engines(reported, inflight)
        state = dataclasses.replace(
            state,
            observed_engines=engines.observed,
            asleep_expert_fractions=engines.expert_fractions,
            engine_pools=engines.pools,
        )
        if stand_ins:
            state = dataclasses.replace(state, sessions=(*state.sessions, *self._stand_ins(state)))
        return state, self.live.next_model(state.sessions, self.live.clock()), inflight

    def _stand_ins(self, state: LiveState) -> list[Session]:
        """Stand-in active sessions for the recent load beyond the requests in flight (`online.RecentLoad`)."""
        in_flight: dict[str, int] = defaultdict(int)
        for session in state.sessions:
            in_flight[session.model] += session.active
        return [s for s in self.live.load.stand_ins(self.live.clock(), in_flight) if s.model in state.catalog.models]

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
            self.live.load.rates(now),
        )

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
        when there is no plan yet (always when `force`).

        At most one replan runs and one waits: a caller that finds one waiting joins it and gets its answer
        (that replan starts after the caller asked, so it plans from a state at least as new; a forced caller
        makes it forced). `statebudget_replan_duration_seconds` times the whole call, waits included."""
        self.live.require_ready()
        started = time.perf_counter()
        outcome = "failed"
        try:
            turn, runs = self._gate.enter(force=force)
            if not runs:
                outcome = "joined"
                return turn.wait()
            try:
                result, outcome = self._replan(force=turn.force)
                turn.result = result
            except BaseException as error:
                turn.error = error
                raise
            finally:
                self._gate.leave(turn)  # those who joined get the answer or the error
            return result
        finally:
            self.live.metrics.replan_duration.labels(outcome).observe(time.perf_counter() - started)

    def covers_waiting(self) -> bool:
        """Whether the last replan already answered every request that waits for a model served nowhere: each
        such session waited for that model when it planned, and nothing else asks for a replan. The planning
        loop then skips the replan those requests woke it for: a burst of requests for a model costs one
        replan after the debounce, not one per request, and a session that asks again for the model it waits
        for costs none (`statebudget_replan_duration_seconds{outcome="covered"}` counts the skips)."""
        self.live.require_ready()
        started = time.perf_counter()
        with self.live.change():
            now = self.live.clock()
            held_due = self.live.held_until is not None and now >= self.live.held_until
            forced = self.live.force_replan or held_due or self.live.plan is None
            covered = not forced and self._waiting() <= self._answered
        if covered:
            self.live.metrics.replan_duration.labels("covered").observe(time.perf_counter() - started)
        return covered

    def _waiting(self) -> frozenset[tuple[str, str]]:
        """(session, model) of the requests in flight for a model served nowhere."""
        return frozenset(
            (s.id, s.model)
            for s in self.live.sessions.values()
            if s.active and s.waiting_since is not None and s.model not in self.live.serving
        )

    def _replan(self, *, force: bool) -> tuple[dict[str, Any], str]:
        """One replan (the gate lets one run at a time): its answer and its outcome."""
        with self.live.plan_lock:
            for _ in range(PLAN_ATTEMPTS):
                with self.live.change():
                    self.queues.expire_and_write()
                    state, next_model, _ = self.planning_snapshot(stand_ins=True)
                    usage = self._usage()
                    waiting = self._waiting()
                    basis = self._basis()
                    held_due = self.live.held_until is not None and usage.now >= self.live.held_until
                    force = force or self.live.force_replan or held_due
                    force_all = force or self.live.plan is None  # installed whatever it buys
                    self.live.urgent.clear()
                result = self.runner(PlanRequest(state, next_model, usage, self.live.settings.solver, force_all))
                for solver, seconds in result.solves:
                    self.live.metrics.plan_duration.labels(solver).observe(seconds)
                if result.warning is not None:
                    log.warning("%s", result.warning)
                if result.plan is None:  # the live state itself cannot be planned
                    raise Conflict(f"the live state cannot be planned: {result.unplannable}")
                self._count_broken(result.broken)
                if not force_all and not result.adopt:
                    self.live.metrics.replans.labels("kept").inc()
                    self._answered = waiting
                    return {"epoch": self.live.epoch, "changed": False}, "kept"  # staying put is the better deal
                plan = result.plan
                document = plan_document(plan)  # its placement serialized before the lock, not under it
                with self.live.change():
                    if self._basis() != basis:
                        continue  # operations went in flight, landed elsewhere or failed while solving: again
                    if not force and self.live.plan is not None and plan.placement == self.live.plan_placement:
                        self.live.metrics.replans.labels("unchanged").inc()
                        self._answered = waiting
                        return {"epoch": self.live.epoch, "changed": False}, "unchanged"
                    # the same landing place, maybe other operations
                    inflight = self.live.inflight()
                    touched = self.queues.install(plan, inflight, self.landing(inflight).capped, document)
                    self.live.metrics.replans.labels("installed").inc()
                    self._answered = waiting
                    self.live.force_replan = False
                    epoch = self.live.epoch
                break
            else:
                # never installed over a state it was not planned from: the planning loop tries again soon
                self.live.metrics.replans.labels("stale").inc()
                log.info("the state moved during each of %d solves; replanning after the debounce", PLAN_ATTEMPTS)
                self.live.wake(force=force)
                return {"epoch": self.live.epoch, "changed": False}, "stale"
        self.live.notify(touched)
        return {"epoch": epoch, "changed": True}, "installed"

    def _count_broken(self, broken: tuple[str, ...]) -> None:
        """Count and log what the plan breaks of planner/invariants.py (a planner bug, which the property and
        soak tests hold at zero): the plan is still installed, as the state it plans from may itself be one
        no plan can make sound (operations in flight landed only as far as they fit, say), and a planning loop
        that installs nothing would hold every node where it is."""
        for sentence in broken:  # the kind: the sentence's first word (capacity, engine, active, order, ...)
            self.live.metrics.plan_invariant_violations.labels(re.findall(r"^[a-z]*", sentence)[0]).inc()
        if broken:
            log.error("the plan breaks %d invariant(s), first: %s", len(broken), "; ".join(broken[:3]))

    def landing(self, inflight: list[OpRecord]) -> Landing:
        """Where the confirmed placement lands once `inflight` does, each operation as far as it fits."""
        self.live.refresh_sizes()  # capacities, and the sizes of the sessions that events created since
        assert self.live.sizes is not None
        return land(self.live.placement, inflight, self.live.sizes)

    def _basis(self) -> tuple[frozenset[tuple[tuple[StateObject, Location], int]], int]:
        """What a plan is safe against: where the confirmed placement will be once the operations in flight
        land (an operation that lands changes nothing here; one leased, failed or expired since does), and
        the hardware and catalog. Sessions and demand may move on: the next replan catches up with them."""
        return frozenset(self.landing(self.live.inflight()).placement.items()), self.live.topology_changes

    def solve(self, problem: Problem, solver: str, **options: object) -> Plan:
        """Solve and time one problem (the planning-duration histogram counts it)."""
        return self._solve(problem, solver, **options)
