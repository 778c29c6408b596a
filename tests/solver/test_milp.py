"""The MILP oracle on tiny clusters: known optima, a brute-force enumeration, and the greedy as a floor."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from types import MappingProxyType

import numpy as np
import pytest
from solver_cases import experts, gpu, held, model, node, problem_of, random_tiny, session, weights
from typer.testing import CliRunner

from planner_service.cli import app
from planner_service.domain.demo import demo_scenario
from planner_service.domain.generate import random_scenario
from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.problem import Problem
from planner_service.domain.state import Location, StateObject, Tier
from planner_service.domain.units import GIB
from planner_service.planner.greedy import Group, plan_greedy, split_evenly
from planner_service.planner.invariants import check_plan
from planner_service.planner.objective import evaluate
from planner_service.planner.plan import PlanStatus, make_plan
from planner_service.planner.residency import ResidencyIndex
from planner_service.solver import backends
from planner_service.solver.backends import lp_bound, solve_model
from planner_service.solver.formulation import build_formulation, settle
from planner_service.solver.gap import ratio
from planner_service.solver.milp import solve_milp
from planner_service.solver.registry import solve

STATUSES = {PlanStatus.OPTIMAL, PlanStatus.FEASIBLE, PlanStatus.TIMEOUT}
# Wall-clock limit for the tiny models: CBC proves them in well under a second of CPU, but the limit is wall
# time (a CBC process is started per solve), so a loaded test machine must not turn "optimal" into "timeout".
LIMIT = 60


def sound(problem: Problem, plan) -> None:
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []


def brute_force(problem: Problem) -> float:
    """The best objective over every GPU-tier choice of a one-node cluster of dense models.

    Each model: off, or its weights split evenly over any subset of the node's GPUs at any precision (when
    the node can load them); a model whose engine runs on fixed GPUs, over those alone; a model without an
    engine on a node that serves only its engines' models, off. Each session's KV: on the serving GPUs or not (active sessions' KV always goes
    with a served model when it fits; KV worth keeping must exist already at the serving precision). The
    lower tiers follow the greedy's rule; the evaluator prices the result.
    """
    now = ResidencyIndex.build(problem, problem.residency)
    (node_id,) = problem.nodes
    cards = sorted((problem.gpus[g] for g in problem.nodes[node_id].gpus), key=lambda g: g.id)
    models = sorted(problem.models)
    choices = []
    for m in models:
        spec = problem.models[m]
        options: list[Group | None] = [None]
        for p in spec.precisions:
            obj = StateObject.weights(m, p)
            has_source = now.complete(obj, node_id, Tier.NVME) or now.complete(obj, node_id, Tier.HOST)
            fixed = problem.nodes[node_id].engine_gpus.get(m)
            if not problem.nodes[node_id].can_serve(m):
                break  # no engine for it on the node: off
            for k in range(1, len(cards) + 1):
                for subset in itertools.combinations(cards, k):
                    if fixed is not None and tuple(g.id for g in subset) != fixed:
                        continue
                    shards = split_evenly(spec.weights_bytes[p], k)
                    grows = any(
                        b > now.placement.get((obj, Location.gpu(g.id)), 0) for g, b in zip(subset, shards, strict=True)
                    )
                    if all(b <= g.capacity_bytes for g, b in zip(subset, shards, strict=True)) and (
                        has_source or not grows
                    ):
                        options.append(Group(node_id, p, subset))
        choices.append(options)
    best = math.inf
    for pick in itertools.product(*choices):
        gpu_target: dict = {}
        groups = {}
        for m, group in zip(models, pick, strict=True):
            if group is None:
                continue
            groups[m] = group
            for g, b in zip(
                group.gpus, split_evenly(problem.models[m].weights_bytes[group.precision], len(group.gpus)), strict=True
            ):
                gpu_target[(StateObject.weights(m, group.precision), Location.gpu(g.id))] = b
        used = {g.id: 0 for g in cards}
        for (_, loc), b in gpu_target.items():
            used[loc.id] += b
        if any(used[g.id] > g.capacity_bytes for g in cards):
            continue
        kv_options = []
        for s in sorted(problem.sessions.values(), key=lambda s: s.id):
            for m, q in sorted(problem.next_model.get(s.id, {}).items()):
                group = groups.get(m)
                if group is None or q <= 0:
                    continue
                obj = StateObject.kv(m, s.id)
                current = now.serving.get(m)
                exists = s.id in now.kv_sessions.get(m, set()) and (
                    current is None or current.precision == group.precision
                )
                if (s.active and s.model == m) or exists:
                    kv_options.append((obj, group))
        for on in itertools.product((False, True), repeat=len(kv_options)):
            target = dict(gpu_target)
            load = dict(used)
            for flag, (obj, group) in zip(on, kv_options, strict=True):
                if flag:
                    for g, b in zip(group.gpus, split_evenly(problem.size_of(obj), len(group.gpus)), strict=True):
                        target[(obj, Location.gpu(g.id))] = b
                        load[g.id] += b
            if any(load[g.id] > g.capacity_bytes for g in cards):
                continue
            unserved = {s.id: "waits" for s in problem.sessions.values() if s.active and s.model not in groups}
            full = settle(problem, target, groups, unserved, {})
            best = min(best, evaluate(problem, full.placement)[0].total)
    return best


# -- hand-checked optima ----------------------------------------------------------


def test_keeps_the_model_more_requests_want_when_only_one_fits() -> None:
    # one 24 GiB card, two 16 GiB models: only one fits. Three sessions sit on "hot", one on "cold", so
    # the predictor sends most next requests to "hot": keeping it warm saves the most cold loads.
    problem = problem_of(
        [node("n0", gpu("g0", 24))],
        [model("hot", {"bf16": 16}), model("cold", {"bf16": 16})],
        [session("s1", "hot"), session("s2", "hot"), session("s3", "hot"), session("s4", "cold")],
        [held(weights("hot"), "nvme", "n0", 16 * GIB), held(weights("cold"), "nvme", "n0", 16 * GIB)],
    )
    plan = solve_milp(problem, time_limit_seconds=LIMIT)
    sound(problem, plan)
    assert plan.status is PlanStatus.OPTIMAL
    on_gpu = {obj.model for (obj, loc) in plan.placement if loc.tier is Tier.GPU}
    assert on_gpu == {"hot"}
    # the three candidate plans, priced by the evaluator: hot warm beats cold warm beats nothing warm
    values = {}
    for name in ("hot", "cold", None):
        gpu_target = {(StateObject.weights(name, "bf16"), Location.gpu("g0")): 16 * GIB} if name else {}
        groups = {name: Group("n0", "bf16", (problem.gpus["g0"],))} if name else {}
        values[name] = evaluate(problem, settle(problem, gpu_target, groups, {}, {}).placement)[0].total
    assert values["hot"] < values["cold"] < values[None]
    assert plan.objective.total == pytest.approx(values["hot"], rel=1e-9)
    assert plan.extra["bound"] == pytest.approx(values["hot"], rel=1e-6)


def test_serves_every_active_request_and_keeps_its_kv_beside_the_weights() -> None:
    # 8 GiB of weights + 2 x 1 GiB of KV on a 24 GiB card: serving both active sessions is the only way
    # to avoid 2 x 600 s x w of unserved penalty.
    problem = problem_of(
        [node("n0", gpu("g0", 24))],
        [model("m", {"bf16": 8})],
        [session("s1", "m", active=True), session("s2", "m", active=True, user="v")],
        [held(weights("m"), "nvme", "n0", 8 * GIB)],
    )
    plan = solve_milp(problem, time_limit_seconds=LIMIT)
    sound(problem, plan)
    assert plan.status is PlanStatus.OPTIMAL and plan.unserved == {}
    for sid in ("s1", "s2"):
        assert plan.placement[(StateObject.kv("m", sid), Location.gpu("g0"))] == GIB
    assert plan.objective.unserved == 0.0


def test_falls_back_to_the_degraded_precision_when_the_preferred_one_cannot_fit() -> None:
    # the active model needs 30 GiB at bf16 (no 24 GiB card holds it) or 8 GiB at int4.
    problem = problem_of(
        [node("n0", gpu("g0", 24))],
        [model("m", {"bf16": 30, "int4": 8})],
        [session("s1", "m", active=True, slo="blocking")],
        [held(weights("m", "bf16"), "nvme", "n0", 30 * GIB), held(weights("m", "int4"), "nvme", "n0", 8 * GIB)],
    )
    plan = solve_milp(problem, time_limit_seconds=LIMIT)
    sound(problem, plan)
    assert plan.placement[(StateObject.weights("m", "int4"), Location.gpu("g0"))] == 8 * GIB
    assert plan.objective.degraded_precision > 0 and plan.objective.unserved == 0.0


def test_moe_expert_fraction_is_the_best_breakpoint() -> None:
    # A MoE with 64 GiB of routed experts in 16 chunks of 4 GiB, served on a 48 GiB card beside 8 GiB of
    # weights and 1 GiB of KV: at most 9 chunks fit. The oracle's fraction is the best over 0..9 chunks.
    moe = model(
        "moe", {"bf16": 8}, experts_bytes=64 * GIB, expert_bytes=GIB // 4, active_expert_bytes_per_token=2 * GIB
    )
    problem = problem_of(
        [{**node("n0", gpu("g0", 48)), "capabilities": ["partial_experts", "kv_offload", "weights_offload"]}],
        [moe],
        [session("s1", "moe", active=True)],
        [held(weights("moe"), "nvme", "n0", 8 * GIB), held(experts("moe"), "nvme", "n0", 64 * GIB)],
    )
    plan = solve_milp(problem, time_limit_seconds=LIMIT)
    sound(problem, plan)
    assert plan.status is PlanStatus.OPTIMAL
    chosen = plan.placement.get((StateObject.experts("moe"), Location.gpu("g0")), 0)
    assert chosen % (4 * GIB) == 0
    base = {
        (StateObject.weights("moe", "bf16"), Location.gpu("g0")): 8 * GIB,
        (StateObject.kv("moe", "s1"), Location.gpu("g0")): GIB,
    }
    groups = {"moe": Group("n0", "bf16", (problem.gpus["g0"],))}
    values = []
    for chunks in range(10):
        target = dict(base)
        if chunks:
            target[(StateObject.experts("moe"), Location.gpu("g0"))] = chunks * 4 * GIB
        values.append(evaluate(problem, settle(problem, target, groups, {}, {}).placement)[0].total)
    assert plan.objective.total == pytest.approx(min(values), rel=1e-9)
    assert chosen == 4 * GIB * int(np.argmin(values))


def test_neither_solver_puts_experts_where_no_copy_can_fill_them() -> None:
    # The MoE's routed experts sit only on n1's NVMe; its weights only on n0's. Serving it on n0, no operation
    # could fill expert chunks there (no copy on n0): the greedy (fixed) and the oracle both keep experts off n0.
    moe = model(
        "moe", {"bf16": 8}, experts_bytes=64 * GIB, expert_bytes=GIB // 4, active_expert_bytes_per_token=2 * GIB
    )
    caps = ["partial_experts", "kv_offload", "weights_offload"]
    problem = problem_of(
        [{**node("n0", gpu("g0", 48)), "capabilities": caps}, {**node("n1", gpu("h0", 24)), "capabilities": caps}],
        [moe],
        [session("s1", "moe", active=True)],
        [held(weights("moe"), "nvme", "n0", 8 * GIB), held(experts("moe"), "nvme", "n1", 64 * GIB)],
    )
    target = plan_greedy(problem)
    greedy = make_plan(problem, "greedy", target.placement, target.unserved, target.reasons)
    sound(problem, greedy)
    plan = solve_milp(problem, time_limit_seconds=LIMIT)
    sound(problem, plan)
    assert plan.extra["milp"]["greedy_objective"] == round(greedy.objective.total, 6)  # its warm start, reachable
    assert plan.objective.total <= greedy.objective.total + 1e-9
    assert plan.unserved == {} and greedy.unserved == {}
    for placed in (greedy.placement, plan.placement):
        assert not any(obj.kind == "experts" and loc.tier is Tier.GPU for obj, loc in placed)


# -- brute force on tiny random scenarios -------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_milp_matches_brute_force_on_tiny_random_scenarios(seed: int) -> None:
    rng = np.random.default_rng(seed)
    problem = random_tiny(rng, gpus=2, models=int(rng.integers(2, 4)), sessions=int(rng.integers(2, 5)))
    best = brute_force(problem)
    plan = solve_milp(problem, time_limit_seconds=LIMIT)
    sound(problem, plan)
    details = plan.extra["milp"]
    assert plan.status is PlanStatus.OPTIMAL
    assert details["model_objective"] == pytest.approx(best, rel=1e-6, abs=1e-6)
    # the model's value is what the evaluator says of the plan it decodes to
    assert details["milp_plan_objective"] == pytest.approx(details["model_objective"], rel=1e-9, abs=1e-9)
    assert plan.objective.total <= details["greedy_objective"] + 1e-6  # greedy_objective is rounded to 6 places


@pytest.mark.parametrize("seed", range(4))
def test_milp_matches_brute_force_with_an_engine_on_fixed_gpus(seed: int) -> None:
    # the node serves through its engines: one model's on fixed GPUs, another model without one
    rng = np.random.default_rng(100 + seed)
    base = random_tiny(rng, gpus=3, models=3, sessions=int(rng.integers(2, 5)))
    model_id, other, _ = rng.permutation(sorted(base.models)).tolist()
    cards = sorted(base.nodes["n0"].gpus)
    fixed = tuple(sorted(rng.choice(cards, size=int(rng.integers(1, len(cards) + 1)), replace=False).tolist()))
    node = dataclasses.replace(
        base.nodes["n0"], serves=frozenset(base.models) - {other}, engine_gpus=MappingProxyType({model_id: fixed})
    )
    problem = dataclasses.replace(base, nodes=MappingProxyType({"n0": node}))
    best = brute_force(problem)
    plan = solve_milp(problem, time_limit_seconds=LIMIT)
    sound(problem, plan)
    assert plan.status is PlanStatus.OPTIMAL
    assert plan.extra["milp"]["model_objective"] == pytest.approx(best, rel=1e-6, abs=1e-6)
    serving = ResidencyIndex.build(problem, plan.placement).serving
    assert model_id not in serving or tuple(g.id for g in serving[model_id].gpus) == fixed
    assert other not in serving


def test_model_objective_is_the_evaluators_on_the_demo_hint() -> None:
    # the greedy's plan, written as an assignment of the model's variables, is priced as the evaluator prices it
    problem = problem_from_scenario(demo_scenario())
    target = plan_greedy(problem)
    form = build_formulation(problem, target.groups)
    start = form.hint(target)
    assert form.ilp.violated(start) == []
    greedy = make_plan(problem, "greedy", target.placement, target.unserved, target.reasons)
    assert form.ilp.value(start) == pytest.approx(greedy.objective.total, rel=1e-6)
    assert form.unavoidable <= greedy.objective.total


# -- the oracle against the greedy ------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_oracle_is_never_worse_than_greedy(seed: int) -> None:
    problem = problem_from_scenario(random_scenario(np.random.default_rng(seed), 4, 3, 12))
    greedy = solve(problem)
    plan = solve(problem, "milp", time_limit_seconds=3, seed=0, workers=2)
    sound(problem, greedy)
    sound(problem, plan)
    assert plan.solver == "milp" and plan.status in STATUSES
    assert plan.objective.total <= greedy.objective.total + 1e-9
    assert set(plan.extra) >= {"bound", "gap", "milp"}
    if plan.extra["bound"] is not None:
        assert plan.extra["bound"] <= plan.objective.total * (1 + 1e-6) + 1e-6  # solver tolerances
        assert 0 <= plan.extra["gap"]


def test_gap_ratio_counts_nothing_avoidable_as_one() -> None:
    assert ratio(10.0, 10.0, 10.0) == 1.0
    assert ratio(12.0, 11.0, 10.0) == pytest.approx((2.001) / (1.001))
    assert ratio(9.0, 9.0, 10.0) == 1.0  # below the bound on both sides: clamped


# -- the command line -------------------------------------------------------------------


def test_cli_plan_milp_and_gap_print_json() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["plan", "--solver", "milp", "--time-limit", "4", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["solver"] == "milp" and data["status"] in {s.value for s in STATUSES}
    greedy = json.loads(runner.invoke(app, ["plan", "--json"]).stdout)
    assert data["objective"] <= greedy["objective"] + 1e-6  # warm-started from the greedy: never worse
    if data["bound"] is not None:
        # (the solver's bound and the evaluator's objective are each rounded: equal within 1e-7 of the objective)
        assert data["bound"] <= data["objective"] * (1 + 1e-7) + 1e-6
        expected_gap = max(0.0, data["objective"] - data["bound"]) / max(abs(data["objective"]), 1e-9)
        assert data["gap"] == pytest.approx(expected_gap, abs=1e-5)
    result = runner.invoke(
        app,
        [
            "gap",
            "--scenarios",
            "2",
            "--seed",
            "3",
            "--gpus",
            "4",
            "--models",
            "3",
            "--sessions",
            "8",
            "--time-limit",
            "2",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["scenarios"] == 2 and len(summary["per_scenario"]) == 2
    assert {
        "median_ratio",
        "p95_ratio",
        "max_ratio",
        "milp_optimal_fraction",
        "milp_gap_within_1pct_fraction",
        "milp_max_seconds",
    } <= set(summary)
    assert all(row["ratio"] >= 1.0 - 1e-9 for row in summary["per_scenario"])
    assert all(
        {"milp_status", "gap", "milp_seconds", "milp_cpu_seconds"} <= set(row) for row in summary["per_scenario"]
    )


def test_gap_prints_its_table_whole_at_80_columns() -> None:
    result = CliRunner().invoke(
        app,
        [
            "gap",
            "--scenarios",
            "1",
            "--seed",
            "3",
            "--gpus",
            "4",
            "--models",
            "3",
            "--sessions",
            "8",
            "--time-limit",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    header = next(line for line in result.output.splitlines() if "scenario" in line and "greedy" in line)
    assert header.split() == [
        "scenario",
        "greedy",
        "MILP",
        "status",
        "gap",
        "MILP",
        "s",
        "unavoidable",
        "ratio",
        "search",
    ]


# -- the backends ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_optional_rows_change_no_optimum_and_the_lp_bounds_it(seed: int) -> None:
    # C9 rows are valid inequalities: the model with and without them has the same optimum, and both CBC
    # variants (run side by side with two workers) agree; the LP relaxation is a bound below it
    rng = np.random.default_rng(100 + seed)
    problem = random_tiny(rng, gpus=2, models=3, sessions=4)
    target = plan_greedy(problem)
    form = build_formulation(problem, target.groups)
    assert form.ilp.optional_rows, "every model on GPU has a C9 row per card"
    assert form.ilp.violated(form.hint(target)) == []
    tightened = solve_model(form.ilp, time_limit_seconds=LIMIT, workers=1)
    plain = solve_model(form.ilp.without_optional_rows(), time_limit_seconds=LIMIT, workers=1)
    both = solve_model(form.ilp, time_limit_seconds=LIMIT, workers=2, seed=seed)
    assert tightened.status == plain.status == both.status == "optimal"
    assert plain.objective == pytest.approx(tightened.objective, rel=1e-6, abs=1e-6)
    assert both.objective == pytest.approx(tightened.objective, rel=1e-6, abs=1e-6)
    assert lp_bound(form.ilp) <= tightened.objective + 1e-6
    assert lp_bound(form.ilp.without_optional_rows()) <= lp_bound(form.ilp) + 1e-6


def test_cbc_is_stopped_at_the_wall_clock_limit_and_the_greedy_plan_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    # a CBC process that never answers (here: one that sleeps) is stopped at the limit; the result is a
    # timeout with the LP relaxation's bound, and the oracle returns the greedy's plan
    monkeypatch.setattr(backends, "CBC_COMMAND", ("-c", "import time; time.sleep(60)"))
    problem = problem_from_scenario(random_scenario(np.random.default_rng(0), 4, 3, 12))
    form = build_formulation(problem, plan_greedy(problem).groups)
    result = solve_model(form.ilp, time_limit_seconds=0.5, workers=2)
    assert result.status == "timeout" and result.values is None
    assert result.bound == pytest.approx(lp_bound(form.ilp))
    assert result.info["stopped"] == "at the wall-clock limit"
    plan = solve_milp(problem, time_limit_seconds=1.0)
    sound(problem, plan)
    assert plan.status is PlanStatus.TIMEOUT and plan.extra["milp"]["plan_from"] == "greedy"
    assert plan.objective.total == pytest.approx(plan.extra["milp"]["greedy_objective"], abs=1e-6)
    assert plan.extra["bound"] <= plan.objective.total + 1e-6


def test_a_failing_cbc_process_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "CBC_COMMAND", ("-c", "import sys; sys.exit('no CBC here')"))
    problem = problem_from_scenario(random_scenario(np.random.default_rng(0), 4, 3, 12))
    form = build_formulation(problem)
    with pytest.raises(RuntimeError, match="no CBC here"):
        solve_model(form.ilp, time_limit_seconds=LIMIT, workers=2)
