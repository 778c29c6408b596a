"""A solver-independent integer linear model and the OR-Tools backends that solve it.

Kept free of the planner's imports so that the child process that runs CBC
(see `solve_model`) starts in a fraction of a second: it imports this module
and OR-Tools, nothing else.
"""

from __future__ import annotations

import math
import os
import pickle
import queue
import random
import resource
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from planner_service.wire.enums import MilpBackend

OBJECTIVE_SCALE = 1e9  # CP-SAT objective unit: nanoseconds
BACKENDS = tuple(MilpBackend)
DECODE_RESERVE_SECONDS = 0.25  # of the wall-clock limit, kept for turning the solution into a plan
MIP_GAP = 1e-4  # relative gap at which CBC and SCIP call a solution optimal (OR-Tools' default)
CBC_VARIANTS = ("tightened", "plain")  # worker i runs variant i: the model with / without its optional rows
CBC_COMMAND = ("-m", "planner_service.solver.backends")  # the interpreter's arguments that start a CBC process
CBC_CPU_SHARE = (
    0.9  # CBC's own limit counts CPU seconds: stop itself (and keep its incumbent) before the wall clock does
)


@dataclass
class IntModel:
    """min offset + sum cost[i] * v[i]  s.t.  lo <= sum a * v <= hi (integer a),  lb <= v <= ub,  v integer."""

    names: list[str] = field(default_factory=list)
    lb: list[int] = field(default_factory=list)
    ub: list[int] = field(default_factory=list)
    rows: list[tuple[dict[int, int], float, float]] = field(default_factory=list)
    cost: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    offset: float = 0.0
    optional_rows: list[int] = field(default_factory=list)  # valid inequalities: every integer solution meets them

    def without_optional_rows(self) -> IntModel:
        skip = set(self.optional_rows)
        rows = [r for i, r in enumerate(self.rows) if i not in skip]
        return IntModel(self.names, self.lb, self.ub, rows, self.cost, self.offset)

    def var(self, name: str, ub: int = 1, lb: int = 0, cost: float = 0.0) -> int:
        self.names.append(name)
        self.lb.append(int(lb))
        self.ub.append(int(ub))
        index = len(self.names) - 1
        if cost:
            self.cost[index] += cost
        return index

    def row(
        self, coeffs: Mapping[int, int], lo: float = -math.inf, hi: float = math.inf, *, optional: bool = False
    ) -> None:
        terms = {i: int(a) for i, a in coeffs.items() if a}
        if terms:
            if optional:
                self.optional_rows.append(len(self.rows))
            self.rows.append((terms, lo, hi))

    def value(self, assignment: Sequence[int]) -> float:
        return self.offset + math.fsum(c * assignment[i] for i, c in self.cost.items())

    def violated(self, assignment: Sequence[int]) -> list[str]:
        bad = [self.names[i] for i, v in enumerate(assignment) if not self.lb[i] <= v <= self.ub[i]]
        for terms, lo, hi in self.rows:
            total = sum(a * assignment[i] for i, a in terms.items())
            if not lo <= total <= hi:
                bad.append(f"row over {[self.names[i] for i in list(terms)[:3]]}: {total} not in [{lo}, {hi}]")
        return bad


class SolveStatus(StrEnum):
    OPTIMAL = "optimal"
    FEASIBLE = "feasible"  # an incumbent, optimality not proved
    TIMEOUT = "timeout"  # the time limit stopped the search
    INFEASIBLE = "infeasible"


PROVED = (SolveStatus.OPTIMAL, SolveStatus.INFEASIBLE)


@dataclass
class SolveResult:
    """What the solver said about the model, before any plan is built."""

    status: SolveStatus
    values: list[int] | None
    objective: float | None  # model objective of `values`
    bound: float | None
    seconds: float
    info: dict[str, Any] = field(default_factory=dict)


def solve_model(
    ilp: IntModel,
    *,
    time_limit_seconds: float,
    seed: int = 0,
    workers: int = 2,
    hint: Sequence[int] | None = None,
    backend: MilpBackend = MilpBackend.CBC,
) -> SolveResult:
    """Solve within `time_limit_seconds` of wall-clock time, whatever the backend.

    SCIP and CP-SAT stop on the wall clock themselves. CBC counts CPU seconds
    and cannot be interrupted through pywraplp (a 10 s limit took 15 s of wall
    time with one other job on the core), so `workers` CBC processes run the
    model variants of CBC_VARIANTS side by side, each with CBC_CPU_SHARE of the
    budget as its CPU limit; the first proof wins, and processes still running
    at the deadline are killed. With no CBC answer the result is a `timeout`
    without values (the caller keeps the greedy plan) and the LP relaxation's
    bound.
    """
    if backend == MilpBackend.CPSAT:
        return _solve_cpsat(ilp, time_limit_seconds, seed, workers, hint)
    if backend == MilpBackend.SCIP:
        return _solve_mpsolver(ilp, time_limit_seconds, seed, hint, "SCIP")
    if backend == MilpBackend.CBC:
        return _solve_cbc(ilp, time_limit_seconds, seed, workers)
    raise ValueError(f"unknown MILP backend {backend!r}; choose one of: {', '.join(BACKENDS)}")


def _solve_cpsat(ilp: IntModel, limit: float, seed: int, workers: int, hint: Sequence[int] | None) -> SolveResult:
    from ortools.sat.python import cp_model  # OR-Tools loads only when the oracle runs

    model = cp_model.CpModel()
    xs = [model.new_int_var(lb, ub, name) for name, lb, ub in zip(ilp.names, ilp.lb, ilp.ub, strict=True)]
    for terms, lo, hi in ilp.rows:
        expr = sum(a * xs[i] for i, a in terms.items())
        if lo == hi:
            model.add(expr == int(lo))
            continue
        if lo > -math.inf:
            model.add(expr >= math.ceil(lo))
        if hi < math.inf:
            model.add(expr <= math.floor(hi))
    model.minimize(sum(round(c * OBJECTIVE_SCALE) * xs[i] for i, c in ilp.cost.items() if round(c * OBJECTIVE_SCALE)))
    if hint is not None:
        for var, value in zip(xs, hint, strict=True):
            model.add_hint(var, int(value))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.1, limit)
    solver.parameters.num_workers = max(1, workers)
    solver.parameters.random_seed = seed
    started = time.perf_counter()
    code = solver.solve(model)
    seconds = time.perf_counter() - started
    values = [int(solver.value(x)) for x in xs] if code in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None
    if code == cp_model.OPTIMAL:
        status = SolveStatus.OPTIMAL
    elif code == cp_model.INFEASIBLE:
        status = SolveStatus.INFEASIBLE
    else:
        status = SolveStatus.TIMEOUT if seconds >= 0.95 * limit else SolveStatus.FEASIBLE
    bound = solver.best_objective_bound / OBJECTIVE_SCALE + ilp.offset if code != cp_model.INFEASIBLE else None
    info = {"backend": MilpBackend.CPSAT, "solver_status": solver.status_name(code), "branches": solver.num_branches}
    return SolveResult(status, values, ilp.value(values) if values else None, bound, seconds, info)


def _solve_mpsolver(
    ilp: IntModel, limit: float, seed: int, hint: Sequence[int] | None, name: str, gap: float = MIP_GAP
) -> SolveResult:
    from ortools.linear_solver import pywraplp  # OR-Tools loads only when the oracle runs

    solver = pywraplp.Solver.CreateSolver(name)
    if solver is None:
        raise ValueError(f"OR-Tools was built without {name}")
    columns, rows = list(range(len(ilp.names))), list(ilp.rows)
    if name == "CBC" and seed:
        # CBC takes no seed through pywraplp; the order of columns and rows steers its search instead
        shuffle = random.Random(seed)
        shuffle.shuffle(columns)
        shuffle.shuffle(rows)
    created = {i: solver.IntVar(ilp.lb[i], ilp.ub[i], ilp.names[i]) for i in columns}
    xs = [created[i] for i in range(len(ilp.names))]
    _write(solver, ilp, xs, rows)
    solver.SetTimeLimit(int(max(0.1, limit) * 1000))
    if name == "SCIP":
        solver.SetSolverSpecificParametersAsString(f"randomization/randomseedshift = {seed}\n")
    if hint is not None:
        solver.SetHint(xs, [float(v) for v in hint])  # SCIP starts from it; pywraplp's CBC ignores hints
    parameters = pywraplp.MPSolverParameters()
    parameters.SetDoubleParam(pywraplp.MPSolverParameters.RELATIVE_MIP_GAP, gap)
    started = time.perf_counter()
    code = solver.Solve(parameters)
    seconds = time.perf_counter() - started
    found = code in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE)
    values = [round(x.solution_value()) for x in xs] if found else None
    bound = solver.Objective().BestBound() if found else None
    if code == pywraplp.Solver.OPTIMAL:
        status = SolveStatus.OPTIMAL
    elif code == pywraplp.Solver.INFEASIBLE:
        status = SolveStatus.INFEASIBLE
    else:
        status = SolveStatus.TIMEOUT if seconds >= 0.95 * limit else SolveStatus.FEASIBLE
    info = {"backend": MilpBackend(name.lower()), "solver_status": int(code)}
    return SolveResult(status, values, ilp.value(values) if values else None, bound, seconds, info)


def _solve_cbc(ilp: IntModel, limit: float, seed: int, workers: int) -> SolveResult:
    started = time.perf_counter()
    deadline = started + max(0.1, limit)
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    answers: queue.Queue[tuple[str, int, bytes, bytes]] = queue.Queue()
    children: list[subprocess.Popen[bytes]] = []
    for variant in CBC_VARIANTS[: max(1, workers)]:
        # a fresh interpreter, not a fork: the service may call the oracle from a threaded process
        child = subprocess.Popen(
            [sys.executable, *CBC_COMMAND],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        model = ilp if variant == "tightened" else ilp.without_optional_rows()
        request = pickle.dumps((model, CBC_CPU_SHARE * max(0.1, limit), seed))
        threading.Thread(target=_collect, args=(child, variant, request, answers), daemon=True).start()
        children.append(child)
    results: dict[str, SolveResult] = {}
    failures: list[str] = []
    while len(results) + len(failures) < len(children):
        try:
            variant, code, out, errors = answers.get(timeout=max(0.0, deadline - time.perf_counter()))
        except queue.Empty:
            break  # the wall-clock limit: children still running are stopped below
        if code != 0 or not out:
            failures.append(
                f"{variant}: exit {code}: {' / '.join(errors.decode(errors='replace').strip().splitlines()[-2:])}"
            )
            continue
        results[variant] = SolveResult(**pickle.loads(out))
        if results[variant].status in PROVED:
            break  # proved: the other variant has nothing to add
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait()
    seconds = time.perf_counter() - started
    if not results and len(failures) == len(children):
        raise RuntimeError(f"the CBC process failed ({'; '.join(failures)})")
    proved = [r for r in results.values() if r.status in PROVED]
    found = [r for r in results.values() if r.values is not None]
    best = proved[0] if proved else min(found, key=lambda r: r.objective or math.inf, default=None)
    # the optional rows cut off no integer solution, so every variant's bound holds for the same optimum
    bounds = [r.bound for r in results.values() if r.bound is not None]
    bound = best.bound if proved and best is not None else (max(bounds) if bounds else None)
    info: dict[str, Any] = {"backend": MilpBackend.CBC, "variants": {v: r.status for v, r in results.items()}}
    if best is not None:
        info["solver_status"] = best.info.get("solver_status")
        info["solved_by"] = next(v for v, r in results.items() if r is best)
    if not proved and len(results) + len(failures) < len(children):
        info["stopped"] = "at the wall-clock limit"
    if bound is None:
        bound = info["lp_bound"] = lp_bound(ilp)  # no CBC answer in time: the LP relaxation still bounds the optimum
    info["cpu_seconds"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - cpu_before, 3)
    if best is None:
        return SolveResult(SolveStatus.TIMEOUT, None, None, bound, seconds, info)
    stopped = "stopped" in info or any(
        r.status is SolveStatus.TIMEOUT for r in results.values()
    )  # by the clock or CBC's own limit
    status = best.status if proved else (SolveStatus.TIMEOUT if stopped else SolveStatus.FEASIBLE)
    return SolveResult(status, best.values, best.objective, bound, seconds, info)


def _collect(
    child: subprocess.Popen[bytes], variant: str, request: bytes, answers: queue.Queue[tuple[str, int, bytes, bytes]]
) -> None:
    try:
        out, errors = child.communicate(request)
    except (OSError, ValueError) as error:  # killed at the deadline while still reading its request
        out, errors = b"", str(error).encode()
    answers.put((variant, child.returncode, out, errors))


def _child_main() -> None:
    """A CBC process: a pickled (model, CPU-second limit, seed) on stdin, the pickled result on stdout."""
    ilp, limit, seed = pickle.loads(sys.stdin.buffer.read())
    result = _solve_mpsolver(ilp, limit, seed, None, "CBC")
    sys.stdout.buffer.write(pickle.dumps(asdict(result)))
    sys.stdout.buffer.flush()


def _write(solver: Any, ilp: IntModel, xs: Sequence[Any], rows: Sequence[tuple[dict[int, int], float, float]]) -> None:
    """Put `rows` (each scaled by its largest coefficient: byte rows become fractions) and the objective of
    `ilp` into a pywraplp solver whose variables are `xs`."""
    inf = solver.infinity()
    for terms, lo, hi in rows:
        scale = max(abs(a) for a in terms.values())
        row = solver.RowConstraint(lo / scale if lo > -math.inf else -inf, hi / scale if hi < math.inf else inf)
        for i, a in terms.items():
            row.SetCoefficient(xs[i], a / scale)
    objective = solver.Objective()
    for i, c in ilp.cost.items():
        objective.SetCoefficient(xs[i], c)
    objective.SetOffset(ilp.offset)
    objective.SetMinimization()


def lp_bound(ilp: IntModel) -> float | None:
    """The LP relaxation's optimum (GLOP): a bound on every solution of the model."""
    from ortools.linear_solver import pywraplp

    solver = pywraplp.Solver.CreateSolver("GLOP")
    xs = [solver.NumVar(lb, ub, n) for n, lb, ub in zip(ilp.names, ilp.lb, ilp.ub, strict=True)]
    _write(solver, ilp, xs, ilp.rows)
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        return None
    return float(solver.Objective().Value())


if __name__ == "__main__":
    from planner_service.solver import backends  # noqa: PLW0406 -- by its module name, so the pickles name the right classes

    backends._child_main()
