"""The MILP oracle: the greedy's objective and constraints as an exact integer model (OR-Tools).

It decides the GPU tier: which group of GPUs serves each model at which
precision, which sessions' KV sits beside it, and how much of a MoE's routed
experts is on GPU. The lower tiers (host DRAM, NVMe) are then settled by the
greedy's own rule, the plan is built by `make_plan` (same operations, same
evaluator, the same engine model: planner/engine_*.py) and checked by
`check_plan`. The oracle returns the better, by the evaluator, of its
incumbent and the greedy plan (SCIP's and CP-SAT's warm start; CBC through
pywraplp takes no hint), a plan the checker refuses losing to a sound one.

Sets
    N nodes, G_n GPUs of node n, M models, P_m precisions of m (preferred first),
    S sessions, A_m sessions with a request to m in flight, D_m sessions with
    q(s,m) > 0 (the predictor's probability that s's next request goes to m).
    O_m candidate groups o = (node n_o, precision p_o, GPUs g_o ⊆ G_{n_o}):
        every non-empty subset of G_n (nodes of <= 4 GPUs; windows on larger
        ones), the group serving m now and the greedy's group, kept when
        |g_o| >= min_gpus, the even shard w_{m,p}/|g_o| fits each card, and
        the node holds a complete copy to load from (unless no shard grows).
        Where m's engine runs on fixed GPUs E_{m,n} of n, g_o = E_{m,n} only;
        none on a node that serves through engines none of which serves m.
        On a vLLM / SGLang node only groups its engine of m can come to run on
        from its state now (engines.may on the one transition that gets there,
        engine_instances.transition_between): an adopted engine offers only its own
        instance (a wake, or staying up), a stopped adopted one none.
    L_m ⊆ O_m the launched option: m's engine running now on a vLLM / SGLang
        node, kept as launched (same precision and GPUs); its KV pool
        pool_{m,g} (m's KV bytes on g now) and its GPU expert share
        ex_{m,g} (m's expert bytes on g now) are launch settings, fixed.
    Z adopted engines asleep now, or running and able to sleep, with their
        group H_a and instance option o_a (if offered): left asleep, each
        keeps R (its CUDA context, engines.holdings) on every g in H_a.
    P pinned models: an adopted engine running now that cannot leave its GPUs
        (no sleep mode; engine_instances.immovable).
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
                           experts; a chunk may spread over the node's GPUs, the greedy keeps it on one;
                           g ∈ E_{m,n} where m's engine runs on fixed GPUs)
    w_{m,o,r} ∈ {0,1}      on a vLLM / SGLang node, in place of y and v: fraction r of m's routed experts in
                           equal shares split_r,g on the GPUs of option o (one launch setting per instance)
    u_{m,g} ∈ Z>=0         MiB of those promoted onto g (above what g holds now)
    z_{m,g} ∈ Z>=0         MiB of m's KV on g beyond its launched engine's pool (o ∈ L_m, g ∈ g_o)
    t_{m,s,o} ∈ Z>=0       the prefill of s's predicted request both its KV on g_o and m's experts there would
                           spare, in PREFILL_STEPs (ms): claimed once too many

Constraints (one family per comment in `formulation.py`)
    (C1) HBM:       sum_o shard_{o,g} x + sum_k kvshard_{k,g} k + sum_m e_{m,n} v_{m,g}
                    + sum_{o in L} (pool_{m,g} + ex_{m,g}) x_{m,o} + sum_o MiB * z_o
                    + sum_{o on a vLLM / SGLang node, g in g_o} R x_{m,o}
                    + sum_{a in Z, g in H_a} R (1 - x_{m,o_a}) <= cap_g
                    (the k of a launched option count in C12 instead)
    (C2) one choice: off_m + sum_o x_{m,o} = 1
    (C3) waiting:   an active request whose KV is not on its model's GPUs pays
                    the unserved penalty U*w_s (objective terms on x and k)
    (C4) KV rides:  k_{m,s,o} <= x_{m,o}
    (C5) experts:   sum_r y_{m,n,c,r} <= sum_{o in class c of n} x_{m,o}
    (C6) promoted:  MiB * u_{m,g} >= e_{m,n} v_{m,g} - now_{m,g}   (e v <= now without a source)
    (C7) spread:    sum_{g in G_n} e_{m,n} v_{m,g} = sum_{c,r} bytes_r * y_{m,n,c,r}
    (C5e) engine:   sum_r w_{m,o,r} <= x_{m,o}; w's shares count in C1 and C9 on g_o
    (C6e) promoted: MiB * u_{m,g} >= sum_{o,r} split_r,g w_{m,o,r} - now_{m,g}   (w = 0 past now without a source)
    (C8) symmetry:  of two interchangeable GPUs (same node and card, both empty
                    now), the first in id order holds at least as many bytes
    (C9) per model: sum_{o on n_g} shard_{o,g} x + sum kvshard_{k,g} k + e_{m,n} v_{m,g}
                    <= cap_g * sum_{o of m on n_g} x_{m,o}   (for every model m and GPU g)
                    Implied by C1-C7 for integer values (nothing of m sits on a node that
                    does not serve it); it keeps the LP relaxation from spreading a
                    fractionally served model's experts and KV over whole cards. An
                    optional row: one of the two CBC processes runs without it.
    (C2') pinned:   x_{m,o} = 1 for m in P, o its running instance
    (C5') launched: o ∈ L_m takes no y (its expert share is ex, not a choice), so
                    C5 and C7 hold y = v = 0 on n_o while it is chosen
    (C10) residue:  the R (1 - x_{m,o_a}) terms of C1: a sleeping adopted engine
                    holds its context unless it wakes (a managed one stops where
                    its context does not fit: engine_targets.sleep_or_stop)
    (C13) context:  the R x_{m,o} terms of C1: every instance running after the plan
                    holds its CUDA context R (engines.holdings) on each GPU of its group,
                    beside its shard and pool; a wake's R x and C10's -R x cancel (the
                    sleeping context is the running one)
    (C11) pool:     pool_{m,g} + ex_{m,g} ride on x_{m,o} in C1 for o ∈ L_m
    (C12) within:   sum_{k on o} kvshard_{k,g} k <= pool_{m,g} x_{m,o} for o ∈ L_m: a launched
                    engine's KV stays within the pool it was launched with
                    (engine_holdings.launched_pools; the engine's LRU keeps the rest out)
    (C11w) woken:   for o ∈ W_m, the sleeping instance of m whose node reported its pool,
                    that pool rides on x_{m,o} in C1 and C12 holds with it (a wake maps the
                    pool back at its launched size: engine_holdings.woken_pools)
    (C5w) woken experts: for the sleeping instance of a MoE whose node reported its launched
                    GPU expert share (Problem.asleep_expert_fractions, engine_holdings.launched_experts),
                    its wake's option has one w, that share, and w_{m,o} = x_{m,o}: a wake maps
                    back what the sleep offloaded, the share included; an unreported share is
                    chosen as any new option's
    (C14) overlap:  t_{m,s,o} >= sum_r P_{s,r} y_r - max_r P_{s,r} (1 - k_{m,s,o}), over the y (or w) of o's
                    class, P_{s,r} the prefill seconds fraction r spares s's predicted request (rounded
                    to the step): a request whose KV is on the GPUs re-prefills nothing, so its experts
                    there spare it nothing either
    (C12') new pool: for o ∉ L_m ∪ W_m on a vLLM / SGLang node, with least_o one request of
                    the model's maximum context per GPU (engines.min_kv_pool_bytes_per_gpu):
                    least_o rides on x_{m,o} in C1 where all the KV o may hold fits in it;
                    else MiB * z_o + sum_{k on o} kvshard_{k,g_o} k >= least_o x_{m,o},
                    z_o <= ceil(least_o / MiB) x_{m,o}, and MiB * z_o counts in C1 on
                    every GPU of o: o's pool takes max(least_o, chosen KV)

Objective (seconds; every coefficient computed by the evaluator's functions)
    off_m:   sum_{s in D_m} w q (L_cold + V [L_cold > t_s]) + decode at f=0 + U * sum_{A_m} w
    x_{m,o}: warm tax of the weights + move_weight * shard promotion seconds + U * sum_{A_m} w
             + sum_{D_m} w q (L_kv + V [L_kv > t_s] + degraded) + W_m * decode(f=0)
             (L_kv of a MoE at no expert on GPU, as if no y were chosen; its active requests' at the
             share on the node's GPUs now, as the evaluator prices requests in flight)
    k:       warm tax of the KV - w q (L_kv + V [L_kv > t_s])
             (an active one: + w (L_now + V [L_now > t_s] + degraded) - U w)
    y:       warm tax of the chunks - W_m * (decode(0) - decode(f_r)) on the class's group
             + sum_{D_m} (w q (L_kv(f_r) + V [L_kv(f_r) > t_s]) - the same at f = 0): the predicted
             re-prefills the chunks spare (L_kv(f) exact at f = 0 and 1, linear between: the experts
             streamed over PCIe are, the CPU's part and a restore's crossover are not)
    t:       PREFILL_STEP
    u:       move_weight * copy seconds of one MiB from the node's best complete copy
    x_{m,o}, o ∈ L_m: + warm tax of ex, decode at f = sum ex / experts (not 0); its k
             carry the warm tax of the KV as any k (the evaluator taxes the bytes placed,
             not a pool's empty room); z carries none

Where the prices come from
    Every coefficient calls the evaluator's functions (objective.py, costs.py):
    promotion seconds are `objective.promote_seconds` of the option's own shards
    (and of one MiB of experts), arrival latency `_arrival_latency`, cold loads
    `cold_load`, KV `kv_ready`, the tax `costs.gpu_hold_cost`, MoE decode
    `costs.decode_slowdown_seconds`. A change of those prices (engine
    transitions priced by domain/engines.py) reaches the model with no change
    here, as long as it stays a function of one model's group. Not in the
    model: a price on the step of an instance the plan takes off or changes
    (its stop, sleep or restart, and whether engine_target makes it a level-1
    or level-2 sleep or a stop); `evaluate` of the decoded plan
    (`milp_plan_objective`) counts whatever the evaluator counts for those.

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
    * Engine nodes: a launched engine's pool is fixed (engine_holdings.launched_pools): its room is held and
      the KV chosen on each of its GPUs stays within it (C12); the engine keeps every session's KV of its
      pool, so a k = 0 there underprices what the plan holds (the decoded plan keeps it and `evaluate`
      credits it). A new engine's pool takes max(its minimum, the KV chosen) on each GPU, exact with z
      (C12'), where the minimum is one request of the model's maximum context (engine_holdings.kv_pools).
    * An active request whose KV is not beside its served model waits: U,
      as the evaluator charges it. W_m (the decode weight) counts it anyway,
      so the model overprices such a plan by w * its decode slowdown.

Bound and gap
    `bound` is the solver's best bound on the model objective, in the
    evaluator's seconds (CP-SAT's integer objective divided back by its
    scale; solver tolerances may put it ~1e-6 relative too high), so
    gap = (objective - bound) / objective, clamped at 0. It bounds every plan
    in the candidate space, not plans outside it (other groups, partial KV,
    other expert fractions, other lower tiers). A CBC run stopped at the
    deadline reports the LP relaxation's optimum instead (a weaker bound).

Solving (`backends.py`)
    The default is CBC through pywraplp, with `workers` (default 2) CBC
    processes side by side on the same model, one with the optional C9 rows
    and one without; the first to prove optimality wins and the others are
    stopped, otherwise the best incumbent and the best bound are kept (every
    variant bounds the same optimum). `seed` permutes the order of columns and
    rows (CBC takes no seed through pywraplp; the order steers its search).
    The time limit is wall clock: CBC's own limit counts CPU seconds (a 10 s
    limit took 15 s of wall time beside one other job), so each process gets
    90 % of the budget in CPU seconds and is killed at the deadline; a run
    stopped that way is a `timeout` whose plan is the greedy's and whose
    bound is the LP relaxation's. pywraplp's CBC ignores solution hints, so
    the greedy plan enters only as the fallback the oracle compares against.

Choice of solver (measured on this machine: 2 cores shared with other jobs,
so wall times swing 1-3x; random_scenario(default_rng(s), 16, 7, 100),
s = 1..10; 60 s limit; CPU seconds of the solver unless "wall")

    CBC, one process, no C9    all 10 optimal; wall 5.8-40 s (median 13)
    CBC with C9 rows           root gap 1.5-9.3 % (3.0-9.4 % without), but the
                               search slower on 7 of 10 seeds (both stopping at
                               a 1 % gap): CPU 5-50 s against 4-28 s, and seed
                               2 still at a 1.6 % gap after 60 CPU s
    CBC + objective cutoff     the greedy's value as a row (for the ignored
                               hint): seed 8 46 -> 8 s wall, seed 4 not solved
                               in 60 s (was 38 s); dropped
    column/row order           the same model, three orders: seed 2 13.5 /
                               19.4 / 29.3 CPU s, seed 4 19.3 / 27.7 / 42.0,
                               so two processes cut the tail
    SCIP (greedy hint)         seed 2 optimal in 54 s, seed 4 stopped at a
                               3.6 % gap, seed 7 optimal; with C9 seeds 2 and 4
                               stopped at 2.3 % and 12.7 %
    HiGHS (pywraplp)           crashes (SIGSEGV) when given a hint; without
                               one 21-49 s wall on seeds 1, 2, 3, 5, 6 (CBC:
                               6-29 s), and no solution at all on seed 4,
                               stopped by its limit
    CP-SAT, 2 workers          no LP-based worker, no useful bound (earlier
                               measurement: about -1e5 on the demo; with 8
                               workers it proved the demo in 1.4 s)

SCIP and CP-SAT stay available as `backend="scip"` (greedy hint, stops on
the wall clock itself) and `backend="cpsat"` (objective in integer
nanoseconds, `workers` threads).
"""

from __future__ import annotations

import math
import time
from typing import Any

from planner_service.domain.problem import Problem
from planner_service.planner.greedy import TargetPlan, plan_greedy
from planner_service.planner.invariants import check_plan
from planner_service.planner.plan import Plan, PlanStatus, make_plan
from planner_service.solver.backends import DECODE_RESERVE_SECONDS, SolveResult, SolveStatus, solve_model
from planner_service.solver.formulation import Formulation, build_formulation, decode
from planner_service.wire.enums import MilpBackend

__all__ = ["SolveResult", "solve_milp", "solve_model"]

_STATUS = {
    SolveStatus.OPTIMAL: PlanStatus.OPTIMAL,
    SolveStatus.FEASIBLE: PlanStatus.FEASIBLE,
    SolveStatus.TIMEOUT: PlanStatus.TIMEOUT,
    SolveStatus.INFEASIBLE: PlanStatus.INFEASIBLE,
}


def solve_milp(
    problem: Problem,
    *,
    time_limit_seconds: float = 60.0,
    seed: int = 0,
    workers: int = 2,
    hint: TargetPlan | None = None,
    backend: MilpBackend = MilpBackend.CBC,
) -> Plan:
    """Plan exactly within the candidate space; never worse (by the evaluator) than the greedy plan it starts from."""
    started = time.perf_counter()
    greedy_target = hint if hint is not None else plan_greedy(problem)
    greedy: Plan | None = None
    greedy_errors: list[str] = []
    try:
        greedy = make_plan(problem, "greedy", greedy_target.placement, greedy_target.unserved, greedy_target.reasons)
        greedy_errors = check_plan(problem, greedy.placement, greedy.operations, greedy.unserved)
    except ValueError:
        pass  # the greedy's target cannot be reached (e.g. expert chunks on a node with no copy to load from)
    form = build_formulation(problem, greedy_target.groups)
    start = form.hint(greedy_target)
    built = time.perf_counter() - started
    result = solve_model(
        form.ilp,
        time_limit_seconds=max(0.1, time_limit_seconds - built - DECODE_RESERVE_SECONDS),
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
        # a sound plan beats one the checker refuses, whatever their objectives
        if not errors and (greedy is None or greedy_errors or candidate.objective.total <= greedy.objective.total):
            plan, source = candidate, "milp"
    if plan is None:
        raise ValueError(
            f"the MILP found no sound plan ({result.status}; {'; '.join(errors[:3])}) and the greedy's is unreachable"
        )
    plan.solver = "milp"
    plan.status = _STATUS[result.status]
    plan.solve_seconds = time.perf_counter() - started
    plan.extra = _extra(form, result, plan, greedy, source, errors, start, decoded)
    plan.extra["milp"]["greedy_invariant_errors"] = greedy_errors[:5]
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
            "plan_from": source,  # "milp", or "greedy" when the greedy plan is sound and evaluates no worse
            "model_objective": None if result.objective is None else round(result.objective, 6),
            "milp_plan_objective": None if decoded is None else round(decoded, 6),  # the evaluator on the solver's plan
            "greedy_objective": None if greedy is None else round(greedy.objective.total, 6),  # null: unreachable
            "greedy_model_objective": round(form.ilp.value(start), 6),
            "unavoidable": round(form.unavoidable, 6),
            "solver_seconds": round(result.seconds, 6),
            "solver_cpu_seconds": result.info.get("cpu_seconds"),  # CBC's own CPU time (its child process)
            "variables": len(form.ilp.names),
            "constraints": len(form.ilp.rows),
            "invariant_errors": errors[:5],
        },
    }
