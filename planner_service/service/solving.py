"""A replan's CPU-bound middle, as one pure function of a snapshot, run in this process or a worker process.

Between the snapshot a replan takes under the state lock and the install it makes under the lock again,
everything is a function of the snapshot: build the live problem, pin the engines, solve, weigh the plan
against staying put, and turn it into the operations to run (`PlanRequest` in, `PlanResult` out).
In a thread of the service that CPU holds the GIL against the event loop that answers the HTTP requests
(the interpreter hands the GIL over every 5 ms, so each await of the event loop waits behind the solve
for up to that long), so `serve` runs it in one worker process instead (`PlanWorker`); both give the same
plan for the same snapshot, because both run `plan_from`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.reduction import ForkingPickler
from types import MappingProxyType, ModuleType
from typing import Any, Protocol

from planner_service.planner.invariants import check_plan, outside_engine_groups
from planner_service.planner.online import (
    ACROSS_MARGIN_STARTS,
    engines_in,
    for_real,
    move_price,
    pins,
    staying_beats,
    staying_put,
    worth_adopting,
)
from planner_service.planner.plan import Plan
from planner_service.service.live import LiveState, Usage
from planner_service.solver.registry import solve

log = logging.getLogger(__name__)

ORPHAN_CHECK_SECONDS = 1.0  # how often the worker looks whether the service that started it is gone


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What a replan plans from, copied under the state lock."""

    state: LiveState
    next_model: Mapping[str, Mapping[str, float]]
    usage: Usage
    solver: str
    force: bool  # the plan is installed whatever it buys (forced, held-back moves due, or no plan yet)


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """A replan's plan and whether it is worth installing; or why the snapshot cannot be planned."""

    plan: Plan | None  # for real (stand-ins and their moves left out) when installed, else as solved
    adopt: bool  # worth its moves against staying put (`online.worth_adopting`)
    solves: tuple[tuple[str, float], ...] = ()  # (solver, seconds) of each solve, for the plan-duration metric
    warning: str | None = None  # the configured solver was not available: the greedy planned instead
    unplannable: str | None = None  # the live state itself cannot be planned (a `ScenarioError`'s message)
    broken: tuple[str, ...] = ()  # the invariants (planner/invariants.py) the plan as solved breaks: a planner bug


class PlanRunner(Protocol):
    def __call__(self, request: PlanRequest) -> PlanResult: ...


def plan_from(request: PlanRequest) -> PlanResult:
    """Plan `request`'s snapshot as the online rules say (`planner/online.py`: pinned engines for the greedy)."""
    solves: list[tuple[str, float]] = []
    warning = None

    def timed(solver: str, **options: object) -> Plan:
        started = time.perf_counter()
        plan = solve(problem, solver, **options)
        solves.append((solver, time.perf_counter() - started))
        return plan

    usage = request.usage
    try:
        problem = request.state.problem(request.next_model)
        try:
            # pins are the greedy's: the search and the MILP choose every node
            plan = timed(request.solver, **(_pins(problem, usage) if request.solver == "greedy" else {}))
        except ImportError as error:
            warning = f"solver {request.solver!r} is not available in this build ({error}); planned with 'greedy'"
            plan = timed("greedy", **_pins(problem, usage))
    except ValueError as error:  # ScenarioError included
        return PlanResult(None, False, tuple(solves), warning, unplannable=str(error))
    broken = tuple(check_plan(problem, plan.placement, plan.operations, plan.unserved))
    price = move_price(problem, plan, usage.rates, across_margin=ACROSS_MARGIN_STARTS)
    adopt = worth_adopting(problem, plan, usage.waiting, pending=usage.pending, price=price)
    if request.force and not adopt and staying_beats(problem, plan):
        # a forced replan stays put where that scores better and is sound: no move of it breaks an invariant,
        # and no model is left on GPUs its node's engines no longer cover
        stay = staying_put(problem, plan)
        sound = not check_plan(problem, stay.placement, stay.operations, stay.unserved)
        if sound and not outside_engine_groups(problem, stay.placement):
            plan, broken = stay, ()
    if request.force or adopt:
        plan = for_real(problem, plan)
    return PlanResult(plan, adopt, tuple(solves), warning, broken=broken)


def _pins(problem: Any, usage: Usage) -> dict[str, dict[str, str]]:
    """The greedy's `nodes` and `precisions`: engines that served within the planning horizon stay where
    they are, unless a request has waited for its model past the unpin delay (`online.pins`)."""
    engines = engines_in(problem, usage.last_used)
    nodes, precisions = pins(engines, usage.stuck, usage.now, problem.constants.horizon_seconds)
    return {"nodes": nodes, "precisions": precisions}


def _proxy(entries: dict[Any, Any]) -> MappingProxyType[Any, Any]:
    return MappingProxyType(entries)


def _reduce_proxy(proxy: MappingProxyType[Any, Any]) -> tuple[Callable[..., Any], tuple[dict[Any, Any]]]:
    return _proxy, (dict(proxy),)


# the compiled problem's read-only mappings cross to the worker and back as plain dicts, read-only again there
ForkingPickler.register(MappingProxyType, _reduce_proxy)

# The modules the deployed build compiles with mypyc (setup.py's COMPILED): their frozen dataclasses refuse the
# attribute writes pickle restores an object with, so they cross by their constructor instead, in every build.
COMPILED_MODULES = tuple(
    importlib.import_module(f"planner_service.{name}")
    for name in (
        "domain.problem",
        "domain.state",
        "planner.costs",
        "planner.greedy",
        "planner.joint",
        "planner.lateness",
        "planner.objective",
        "planner.operations",
        "planner.residency",
    )
)


def _rebuild(cls: type[Any], fields: dict[str, Any]) -> Any:
    return cls(**fields)


def _reduce_frozen(obj: Any) -> tuple[Callable[..., Any], tuple[type[Any], dict[str, Any]]]:
    return _rebuild, (type(obj), {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init})


def frozen_dataclasses(modules: tuple[ModuleType, ...] = COMPILED_MODULES) -> list[type[Any]]:
    """The frozen dataclasses `modules` define."""
    return [
        cls
        for module in modules
        for cls in vars(module).values()
        if isinstance(cls, type)
        and cls.__module__ == module.__name__
        and dataclasses.is_dataclass(cls)
        and cls.__dataclass_params__.frozen  # type: ignore[attr-defined]  # set on every dataclass
    ]


for _cls in frozen_dataclasses():
    ForkingPickler.register(_cls, _reduce_frozen)


def _worker_started(parent: int) -> None:
    """In the worker: leave Ctrl-C to the service (it closes the worker), and exit once the service is gone
    (a SIGKILL leaves the worker waiting on a queue whose writing end it holds itself)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_CHECK_SECONDS)
        os._exit(0)

    threading.Thread(target=watch, name="statebudget-orphan-watch", daemon=True).start()


def _ready() -> int:
    return os.getpid()


class PlanWorker:
    """`plan_from` in one worker process (spawned: the service has threads, so no fork), started once.

    A worker that died (killed, out of memory) costs one replan planned in this process instead, and the
    next replan starts a new worker. Any other failure on the way (a snapshot that cannot be sent, say)
    plans in this process, as does every replan after it: the worker never makes a replan fail that would
    have succeeded without it."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._crosses = False  # a request went to the worker and back in this process's pickle once

    def start(self) -> int:
        """Start the worker and wait until it answers (its imports take a second); its pid."""
        pool = self._executor()
        if pool is None:
            raise RuntimeError("the planning worker was closed")
        return int(pool.submit(_ready).result())

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor | None:
        """The worker's pool, started if need be; None once closed."""
        with self._lock:
            if self._closed:
                return None
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    max_workers=1,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_worker_started,
                    initargs=(os.getpid(),),
                )
            return self._pool

    def __call__(self, request: PlanRequest) -> PlanResult:
        pool = self._executor()
        if pool is None:  # the service is stopping: a replan still asked for plans here
            return plan_from(request)
        if not self._crosses:
            # A request that cannot be unpickled kills the worker as it reads it, which would look like a death
            # at every replan (a frozen dataclass of a compiled module missing from `COMPILED_MODULES` would).
            # Tried here first, once: such a build plans in the service.
            try:
                ForkingPickler.loads(ForkingPickler.dumps(request))
            except (
                pickle.PicklingError,
                AttributeError,
                TypeError,
            ) as error:  # (FrozenInstanceError: an AttributeError)
                log.warning(
                    "a replan's snapshot does not pickle in this build (%s): replans plan in the service", error
                )
                self.close()
                return plan_from(request)
            self._crosses = True
        try:
            return pool.submit(plan_from, request).result()
        except BrokenProcessPool:
            log.warning("the planning worker process died; this replan plans in the service, the next in a new one")
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            return plan_from(request)
        except Exception:  # never a new way for a replan to fail: plan here, as without a worker
            log.exception("planning in the worker process failed; replans are solved in the service from now on")
            self.close()
            return plan_from(request)

    def close(self) -> None:
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
