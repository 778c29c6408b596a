"""The planner prices engine transitions with the engine model (planner/engine_costs.py, domain/engines.py):
a cold start, a wake and a restart cost in the objective what they cost on the engine, so a start or a
restart must pay for itself."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

import pytest
from tiny_clusters import gpu, held, model, node, on_gpu, on_host, on_nvme, plan_for, scenario, session, weights

from planner_service.domain.engines import EngineConstants, EngineState, Transition
from planner_service.domain.exceeds import exceeds_scenario
from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.problem import Problem, Session
from planner_service.domain.scenario import Slo, parse_scenario
from planner_service.domain.state import Location, StateObject
from planner_service.domain.units import GIB
from planner_service.planner.invariants import check_plan
from planner_service.planner.objective import cold_load
from planner_service.planner.plan import Plan
from planner_service.planner.residency import ResidencyIndex
from planner_service.solver.registry import solve

VLLM = {"kind": "vllm", "features": ["lmcache", "sleep_mode", "dev_mode"]}
C = EngineConstants()


def transitions(plan: Plan) -> set[Transition]:
    return {op.engine.transition for op in plan.operations if op.engine is not None}


# -- a cold start and a wake, by hand (README, "Engines as they are": the worked examples) --------------------


def llama_on_one_l40(residency: list[dict[str, Any]]) -> Problem:
    """One node, one L40 (2 GiB reserved), Llama-3.1-8B bf16 in a vLLM engine fixed on it; the node's default
    Gen4 NVMe (7 GB/s) and the L40 preset's 24 GB/s host-to-device link (perf_anchors.md §0)."""
    card = {"id": "g0", "type": "l40", "reserved_bytes": 2 * GIB}
    data = {
        "cluster": {
            "nodes": [
                {
                    "id": "n0",
                    "host_dram_bytes": 512 * GIB,
                    "nvme_bytes": 4096 * GIB,
                    "gpus": [card],
                    "engines": [{"model": "llama", "gpus": ["g0"], **VLLM}],
                }
            ]
        },
        "models": [{"id": "llama", "preset": "llama-3.1-8b-instruct", "precisions": ["bf16"]}],
        "sessions": [],
        "residency": residency,
    }
    return problem_from_scenario(parse_scenario(data))


LLAMA_BYTES = 16_060_522_496  # Llama-3.1-8B at bf16 (the preset's dense weight bytes; README worked examples)


def test_a_cold_load_onto_a_stopped_engine_is_the_readmes_cold_start() -> None:
    # cold_start_fixed + max(checkpoint / nvme, shard / h2d) = 30 + max(16,060,522,496 B / 7 GB/s, 0.67) = 32.29;
    # 30 s: perf_anchors.md §1, "a full reload is 30–100+ s per switch" (the low end)
    problem = llama_on_one_l40([held(weights("llama"), on_nvme("n0"), LLAMA_BYTES)])
    now = ResidencyIndex.build(problem, problem.residency)
    cold = cold_load(problem, now, problem.models["llama"], now)
    assert cold.seconds == pytest.approx(30 + LLAMA_BYTES / 7e9, abs=1e-6)
    assert cold.seconds == pytest.approx(32.29, abs=0.005)
    assert C.cold_start_fixed_seconds == 30.0


def test_a_cold_load_onto_an_engine_asleep_at_level_1_is_a_wake() -> None:
    # its weights in host RAM with its group fixed: asleep at level 1 (the host copy is its backup), so
    # wake_fixed + shard / h2d = 0.1 + 16,060,522,496 B / 24 GB/s; perf_anchors.md §1, "Level 1: 0.1–6 s"
    problem = llama_on_one_l40(
        [held(weights("llama"), on_nvme("n0"), LLAMA_BYTES), held(weights("llama"), on_host("n0"), LLAMA_BYTES)]
    )
    now = ResidencyIndex.build(problem, problem.residency)
    cold = cold_load(problem, now, problem.models["llama"], now)
    assert cold.seconds == pytest.approx(0.1 + LLAMA_BYTES / 24e9, abs=1e-6)


# -- a demand shift that pays for a restart, and one that does not ---------------------------------------------


def degraded_a(sessions: int) -> dict[str, Any]:
    """One 26 GiB card whose vLLM engine serves a at fp8 (8 GiB, a degraded precision) with one request in
    flight; bf16 (16 GiB) fits too, but only a restart (stop + cold start) serves it, and the request in
    flight waits for it. `sessions` sessions of a in all: each request served at fp8 costs
    `degraded_precision_seconds`."""
    engines = [{"model": "a", "gpus": ["g0"], **VLLM}]
    return scenario(
        [{**node("n0", gpu("g0", 26)), "engines": engines}],
        [model("a", {"bf16": 16, "fp8": 8})],
        [session("s0", "a", active=True, tokens=4096), *(session(f"s{i}", "a") for i in range(1, sessions))],
        [
            held(weights("a", "fp8"), on_gpu("g0"), 8 * GIB),
            held(weights("a"), on_nvme("n0"), 16 * GIB),
            held(weights("a", "fp8"), on_nvme("n0"), 8 * GIB),
        ],
    )


def test_a_demand_shift_worth_less_than_a_restart_gets_none() -> None:
    # five sessions' degraded requests save a few seconds at bf16; the restart costs the request in flight
    # stop_fixed + cold_start_fixed = 32 s of waiting (and a violation of its 5 s target): no restart
    # (priced at a copy and a 0.3 s overhead, the restart was planned)
    problem, plan = plan_for(degraded_a(5))
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    assert Transition.RESTART not in transitions(plan)
    assert (StateObject.weights("a", "fp8"), Location.gpu("g0")) in plan.placement


def test_a_demand_shift_that_pays_for_a_restart_gets_one_priced_as_a_restart() -> None:
    # eighty sessions' degraded requests pay for it
    problem, plan = plan_for(degraded_a(80))
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    restart = next(op.engine for op in plan.operations if op.engine and op.engine.transition is Transition.RESTART)
    assert restart.previous is not None and (restart.previous.precision, restart.instance.precision) == ("fp8", "bf16")
    # the objective charges the restart's fixed part with its copy: the moves term is move_weight x the
    # seconds spent, stop_fixed + cold_start_fixed + the 16 GiB copy, read from the node's default 7 GB/s NVMe
    # (slower than the card's 20 GB/s link)
    copy = max(16 * GIB / 7e9, 16 * GIB / 20e9)
    moves = problem.constants.move_weight * (C.stop_fixed_seconds + C.cold_start_fixed_seconds + copy)
    assert plan.objective.moves == pytest.approx(moves, rel=1e-9)


# -- the catalog that exceeds HBM: engines start, sleep and wake ----------------------------------------------

SMALL = ("planner", "coder", "longctx", "summarizer", "vision")  # 255 GB at native precision
LARGE = ("reasoner", "air")  # the MoEs: 684 GB, more than the HBM at native precision


def with_demand(problem: Problem, models: tuple[str, ...]) -> Problem:
    """Three interactive sessions on every model of the catalog; those on `models` are the ones with requests
    (one in flight each model), all of them sure to go on with their model."""
    sessions: dict[str, Session] = {}
    for m in (*SMALL, *LARGE):
        for i in range(3):
            sid = f"{m}-{i}"
            sessions[sid] = Session(sid, "u", Slo.INTERACTIVE, m, m in models and i == 0, 4096)
    next_model = {sid: {s.model: 1.0} for sid, s in sessions.items() if s.model in models}
    return dataclasses.replace(problem, sessions=MappingProxyType(sessions), next_model=MappingProxyType(next_model))


def done(problem: Problem, plan: Plan) -> Problem:
    """The problem once the plan is carried out and the nodes report their engines' states."""
    observed = {k: (v.state, v.gpus) for k, v in plan.instances.items() if v.state is not EngineState.STOPPED}
    return dataclasses.replace(problem, residency=MappingProxyType(dict(plan.placement)), observed_engines=observed)


def test_the_catalog_that_exceeds_hbm_starts_sleeps_and_wakes_engines_at_their_cost() -> None:
    base = problem_from_scenario(exceeds_scenario())
    steps = []
    problem = with_demand(base, SMALL)
    for models in (LARGE, SMALL, LARGE):
        plan = solve(problem)
        assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
        steps.append(plan)
        problem = with_demand(done(problem, plan), models)
    plan = solve(problem)
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    steps.append(plan)
    seen = set().union(*map(transitions, steps))
    assert {Transition.START, Transition.SLEEP_LEVEL_1, Transition.WAKE} <= seen
    # the small models come back to engines stopped to make room for the MoEs: their requests in flight are
    # predicted to wait for the cold start (30 s) ...
    assert Transition.START in transitions(steps[2])
    assert steps[2].predicted.switch_latency_p95_seconds >= C.cold_start_fixed_seconds
    # ... and the MoEs, asleep at level 1 meanwhile, wake for theirs: seconds, not a cold start
    woken = {
        op.engine.instance.model for op in steps[3].operations if op.engine and op.engine.transition is Transition.WAKE
    }
    assert woken == set(LARGE)
    assert Transition.START not in transitions(steps[3])
    assert steps[3].predicted.switch_latency_p95_seconds < C.cold_start_fixed_seconds
