"""The MILP oracle: the greedy's objective and constraints as an exact integer model (OR-Tools).

It decides the GPU tier: which group of GPUs serves each model at which
precision, which sessions' KV sits beside it, and how much of a MoE's routed
experts is on GPU. The lower tiers (host DRAM, NVMe) are then settled by the
greedy's own rule, the plan is built by `make_plan` (same operations, same
evaluator) and checked by `check_plan`. The oracle returns the better, by the
evaluator, of its incumbent and the greedy plan it was warm-started from.

Sets
    N nodes, G_n GPUs of node n, M models, P_m precisions of m (preferred first),
    S sessions, A_m sessions with a request to m in flight, D_m sessions with
    q(s,m) > 0 (the predictor's probability that s's next request goes to m).
    O_m candidate groups o = (node n_o, precision p_o, GPUs g_o ⊆ G_{n_o}):
        every non-empty subset of G_n (nodes of <= 4 GPUs; windows on larger
        ones), the group serving m now and the greedy's group, kept when
        |g_o| >= min_gpus, the even shard w_{m,p}/|g_o| fits each card, and
        the node holds a complete copy to load from (unless no shard grows).
    K_{m,o} sessions whose KV may sit on g_o: A_m, plus s in D_m whose KV for
        m exists on n_o now, when p_o does not invalidate it (a precision
        change drops KV, as the greedy does).
    R_{m,n} expert fractions: r regular chunks plus optionally the tail, the
        greedy's chunk breakpoints (16 chunks, or whole with no partial_experts).
    C_{m,n} decode classes: groups of n with the same sum of h2d bandwidth.

Variables
    off_m ∈ {0,1}          no group serves m
    x_{m,o} ∈ {0,1}        m's weights split evenly over g_o at p_o
    k_{m,s,o} ∈ {0,1}      s's whole KV for m split evenly over g_o
    y_{m,n,c,r} ∈ {0,1}    fraction r of m's routed experts on n's GPUs, m served by a class-c group of n
    v_{m,g} ∈ Z>=0         m's routed experts on GPU g, in units e_{m,n} (gcd of the chunk sizes, whole
                           experts; a chunk may spread over the node's GPUs, the greedy keeps it on one)
    u_{m,g} ∈ Z>=0         MiB of those promoted onto g (above what g holds now)

Constraints (one family per comment in `formulation.py`)
    (C1) HBM:       sum_o shard_{o,g} x + sum_k kvshard_{k,g} k + sum_m e_{m,n} v_{m,g} <= cap_g
    (C2) one choice: off_m + sum_o x_{m,o} = 1
    (C3) waiting:   an active request whose KV is not on its model's GPUs pays
                    the unserved penalty U*w_s (objective terms on x and k)
    (C4) KV rides:  k_{m,s,o} <= x_{m,o}
    (C5) experts:   sum_r y_{m,n,c,r} <= sum_{o in class c of n} x_{m,o}
    (C6) promoted:  MiB * u_{m,g} >= e_{m,n} v_{m,g} - now_{m,g}   (e v <= now without a source)
    (C7) spread:    sum_{g in G_n} e_{m,n} v_{m,g} = sum_{c,r} bytes_r * y_{m,n,c,r}
    (C8) symmetry:  of two interchangeable GPUs (same node and card, both empty
                    now), the first in id order holds at least as many bytes

Objective (seconds; every coefficient computed by the evaluator's functions)
    off_m:   sum_{s in D_m} w q (L_cold + V [L_cold > t_s]) + decode at f=0 + U * sum_{A_m} w
    x_{m,o}: warm tax of the weights + move_weight * shard promotion seconds + U * sum_{A_m} w
             + sum_{D_m} w q (L_kv + V [L_kv > t_s] + degraded) + W_m * decode(f=0)
    k:       warm tax of the KV - w q (L_kv + V [L_kv > t_s])
             (an active one: + w (L_now + V [L_now > t_s] + degraded) - U w)
    y:       warm tax of the chunks - W_m * (decode(0) - decode(f_r)) on the class's group
    u:       move_weight * copy seconds of one MiB from the node's best complete copy

How the non-linear parts are made linear
    * min(restore, re-prefill) and the violation indicator [L > target]: for a
      fixed choice (group, KV on GPU or not) the latency is a constant, so both
      are precomputed per (session, model, group) and ride on x and k; no big-M.
    * MoE slowdown: hit(f) = f**skew is concave; y picks one breakpoint and
      carries the exact slowdown there, per decode class (the slowdown divides
      by the group's summed h2d), so the product group x fraction stays exact.
    * Transfers: the evaluator prices each GPU's link on its own (shards move
      in parallel; NVMe reads summed per load), so a group's load time is a
      constant of the group, and expert promotion is linear in u.
    * Lower tiers are not variables: prices of an off model and of KV left
      below GPU come from the greedy's lower-tier rule applied with the GPUs
      empty; the decision is then settled exactly by that rule. Host DRAM
      contention between models (and the group that prices a KV demotion)
      is all this can misprice; the plan reports `milp.model_objective`
      next to `milp.milp_plan_objective`, the evaluator's value of it.
    * An active request whose KV is not beside its served model waits: U,
      as the evaluator charges it. W_m (the decode weight) counts it anyway,
      so the model overprices such a plan by w * its decode slowdown.

Bound and gap
    `bound` is the solver's best bound on the model objective, in the
    evaluator's seconds (CP-SAT's integer objective divided back by its
    scale; solver tolerances may put it ~1e-6 relative too high), so
    gap = (objective - bound) / objective, clamped at 0. It bounds every plan
    in the candidate space, not plans outside it (other groups, partial KV,
    other expert fractions, other lower tiers); null when the solver has none.

Choice of solver (measured on this machine: 2 cores; same model, greedy
hint, 20 s limit; "incumbent / bound", model objective in seconds; seeds
3 and 5 measured before the symmetry rows C8 were added)

    scenario                      CBC                    SCIP                   CP-SAT (8 workers)
    demo (16 GPUs, 10 sessions)   optimal 265.65 in 0.8 s optimal 265.65 in 1.1 s optimal 265.65 in 1.4 s
    random seed 1 (100 sessions)  optimal 4698.5 in 25 s  5306 / 4047 (timeout)   5481 / 4006 (timeout)
    random seed 2                 4448 / 3774 (33 s)      4967 / 4145             4961 / -30122
    random seed 3                 optimal 4894.7 in 8 s   4894.7 / 4641           4968.8 / 4493
    random seed 4                 4283 / 3228 (32 s)      9381 / 3315             6859 / -2081
    random seed 5                 3427 / 3158 (47 s)      3898 / 3189             4562 / 3168

CBC (through pywraplp) finds the best incumbent on every case and is the
only one to prove optimality on the random ones, so it is the default.
At 45 s SCIP got 4461 / 7743 / optimal 3371.6 on seeds 2 / 4 / 5: better
bounds, worse incumbents on the hardest case. CBC's costs: it overruns the
time limit (a 15 s limit took a median 36 s of wall time, max 54 s, over the
50-scenario gap study; a 60 s limit took 66 s and 105 s on seeds 4 and 2;
SCIP and CP-SAT stop on time), it ignores the warm start hint (the greedy
plan still bounds the result, see above), and this OR-Tools build
runs it single-threaded with no seed (`seed` reaches SCIP and CP-SAT,
`workers` CP-SAT only). CP-SAT with 2 workers runs no LP-based worker and
reports a useless bound (about -1e5 on the demo; 8 workers prove the demo in
1.4 s). Both stay available as `backend="scip"` and `backend="cpsat"` (its
objective scaled to integer nanoseconds).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from planner_service.domain.problem import Problem
from planner_service.planner.greedy import TargetPlan, plan_greedy
from planner_service.planner.invariants import check_plan
from planner_service.planner.plan import Plan, PlanStatus, make_plan
from planner_service.solver.formulation import Formulation, IntModel, build_formulation, decode

OBJECTIVE_SCALE = 1e9  # CP-SAT objective unit: nanoseconds


@dataclass
class SolveResult:
    """What the solver said about the model, before any plan is built."""

    status: str  # optimal | feasible | timeout | infeasible
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
    backend: str = "cbc",
) -> SolveResult:
    if backend == "cpsat":
        return _solve_cpsat(ilp, time_limit_seconds, seed, workers, hint)
    if backend in ("scip", "cbc"):
        return _solve_mpsolver(ilp, time_limit_seconds, seed, workers, hint, backend.upper())
    raise ValueError(f"unknown MILP backend {backend!r}; choose one of: cbc, cpsat, scip")


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
        status = "optimal"
    elif code == cp_model.INFEASIBLE:
        status = "infeasible"
    else:
        status = "timeout" if seconds >= 0.95 * limit else "feasible"
    bound = solver.best_objective_bound / OBJECTIVE_SCALE + ilp.offset if code != cp_model.INFEASIBLE else None
    info = {"backend": "cpsat", "solver_status": solver.status_name(code), "branches": solver.num_branches}
    return SolveResult(status, values, ilp.value(values) if values else None, bound, seconds, info)


def _solve_mpsolver(ilp: IntModel, limit: float, seed: int, workers: int, hint: Sequence[int] | None, name: str) -> SolveResult:
    from ortools.linear_solver import pywraplp  # OR-Tools loads only when the oracle runs

    solver = pywraplp.Solver.CreateSolver(name)
    if solver is None:
        raise ValueError(f"OR-Tools was built without {name}")
    xs = [solver.IntVar(lb, ub, n) for n, lb, ub in zip(ilp.names, ilp.lb, ilp.ub, strict=True)]
    inf = solver.infinity()
    for terms, lo, hi in ilp.rows:
        scale = max(abs(a) for a in terms.values())  # byte rows become fractions of their largest term
        row = solver.RowConstraint(lo / scale if lo > -math.inf else -inf, hi / scale if hi < math.inf else inf)
        for i, a in terms.items():
            row.SetCoefficient(xs[i], a / scale)
    objective = solver.Objective()
    for i, c in ilp.cost.items():
        objective.SetCoefficient(xs[i], c)
    objective.SetOffset(ilp.offset)
    objective.SetMinimization()
    solver.SetTimeLimit(int(max(0.1, limit) * 1000))
    if name == "SCIP":
        solver.SetSolverSpecificParametersAsString(f"randomization/randomseedshift = {seed}\n")
    if hint is not None:
        solver.SetHint(xs, [float(v) for v in hint])
    started = time.perf_counter()
    code = solver.Solve()
    seconds = time.perf_counter() - started
    found = code in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE)
    values = [int(round(x.solution_value())) for x in xs] if found else None
    if code == pywraplp.Solver.OPTIMAL:
        status = "optimal"
    elif code == pywraplp.Solver.INFEASIBLE:
        status = "infeasible"
    else:
        status = "timeout" if seconds >= 0.95 * limit else "feasible"
    bound = objective.BestBound() if found else None
    info = {"backend": name.lower(), "solver_status": int(code)}
    return SolveResult(status, values, ilp.value(values) if values else None, bound, seconds, info)


_STATUS = {
    "optimal": PlanStatus.OPTIMAL,
    "feasible": PlanStatus.FEASIBLE,
    "timeout": PlanStatus.TIMEOUT,
    "infeasible": PlanStatus.INFEASIBLE,
}


def solve_milp(
    problem: Problem,
    *,
    time_limit_seconds: float = 60.0,
    seed: int = 0,
    workers: int = 2,
    hint: TargetPlan | None = None,
    backend: str = "cbc",
) -> Plan:
    """Plan exactly within the candidate space; never worse (by the evaluator) than the greedy plan it starts from."""
    started = time.perf_counter()
    greedy_target = hint if hint is not None else plan_greedy(problem)
    greedy: Plan | None = None
    try:
        greedy = make_plan(problem, "greedy", greedy_target.placement, greedy_target.unserved, greedy_target.reasons)
    except ValueError:
        pass  # the greedy's target cannot be reached (e.g. expert chunks on a node with no copy to load from)
    form = build_formulation(problem, greedy_target.groups)
    start = form.hint(greedy_target)
    built = time.perf_counter() - started
    result = solve_model(
        form.ilp,
        time_limit_seconds=max(0.1, time_limit_seconds - built),
        seed=seed,
        workers=workers,
        hint=start,
        backend=backend,
    )
    plan, source, errors, decoded = greedy, "greedy", [], None
    if result.values is not None:
        target = decode(form, result.values)
        candidate = make_plan(problem, "milp", target.placement, target.unserved, target.reasons)
        decoded = candidate.objective.total
        errors = check_plan(problem, candidate.placement, candidate.operations, candidate.unserved)
        if not errors and (greedy is None or candidate.objective.total <= greedy.objective.total):
            plan, source = candidate, "milp"
    if plan is None:
        raise ValueError(f"the MILP found no sound plan ({result.status}; {'; '.join(errors[:3])}) and the greedy's is unreachable")
    plan.solver = "milp"
    plan.status = _STATUS[result.status]
    plan.solve_seconds = time.perf_counter() - started
    plan.extra = _extra(form, result, plan, greedy, source, errors, start, decoded)
    return plan


def _extra(
    form: Formulation,
    result: SolveResult,
    plan: Plan,
    greedy: Plan | None,
    source: str,
    errors: list[str],
    start: list[int],
    decoded: float | None,
) -> dict[str, Any]:
    objective = plan.objective.total
    gap = None
    if result.bound is not None and math.isfinite(result.bound):
        gap = max(0.0, objective - result.bound) / max(abs(objective), 1e-9)
    return {
        "bound": None if result.bound is None else round(result.bound, 6),
        "gap": None if gap is None else round(gap, 6),
        "milp": {
            "backend": result.info.get("backend"),
            "solver_status": result.info.get("solver_status"),
            "plan_from": source,  # "milp", or "greedy" when the greedy plan evaluates no worse
            "model_objective": None if result.objective is None else round(result.objective, 6),
            "milp_plan_objective": None if decoded is None else round(decoded, 6),  # the evaluator on the solver's plan
            "greedy_objective": None if greedy is None else round(greedy.objective.total, 6),  # null: unreachable
            "greedy_model_objective": round(form.ilp.value(start), 6),
            "unavoidable": round(form.unavoidable, 6),
            "solver_seconds": round(result.seconds, 6),
            "variables": len(form.ilp.names),
            "constraints": len(form.ilp.rows),
            "invariant_errors": errors[:5],
        },
    }
