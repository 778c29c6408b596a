"""The greedy's estimates on engine nodes match what the evaluator charges (docs/studies/gap.md, "On engine
scenarios, closing the gap"): each test a small cluster where the greedy's choice was worse before."""

from __future__ import annotations

import dataclasses
from typing import Any

from tiny_clusters import (
    GIB,
    KV_BYTES_PER_TOKEN,
    gpu,
    held,
    kv,
    model,
    node,
    on_gpu,
    on_nvme,
    scenario,
    session,
    weights,
)

from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.scenario import parse_scenario
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.planner.invariants import check_plan
from planner_service.planner.plan import Plan
from planner_service.solver.registry import solve

TOKENS_PER_GIB = GIB // KV_BYTES_PER_TOKEN  # 8,192


def gpu_bytes(plan: Plan, obj: StateObject, gpu_id: str) -> int:
    return plan.placement.get((obj, Location.gpu(gpu_id)), 0)


def full_pool() -> dict[str, Any]:
    """One 26 GiB card whose adopted vLLM engine (no sleep mode: it cannot leave its GPUs) serves a (16 GiB);
    its pool holds idle s1's 4 GiB of KV and no more; s3, in flight, needs 2 GiB."""
    engine = {"model": "a", "gpus": ["g0"], "kind": "vllm", "features": [], "management": "adopted"}
    return scenario(
        [{**node("n0", gpu("g0", 26)), "engines": [engine]}],
        [model("a", 16)],
        [session("s1", "a", tokens=4 * TOKENS_PER_GIB), session("s3", "a", active=True, tokens=2 * TOKENS_PER_GIB)],
        [
            held(weights("a"), on_gpu("g0"), 16 * GIB),
            held(weights("a"), on_nvme("n0"), 16 * GIB),
            held(kv("a", "s1"), on_gpu("g0"), 4 * GIB),
        ],
    )


def test_a_fixed_pool_evicts_idle_kv_for_an_active_session() -> None:
    """The engine's pool LRU evicts idle s1's KV for s3's new KV (engine_plan._kv_within_pools), so s3 is
    served there. Kept whole, s1's KV had left s3 unserved: a 1,200 s penalty."""
    problem = problem_from_scenario(parse_scenario(full_pool()))
    problem = dataclasses.replace(problem, engine_pools={("n0", "a"): 4 * GIB})
    plan = solve(problem)
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    assert plan.unserved == {}
    assert gpu_bytes(plan, StateObject.kv("a", "s3"), "g0") == 2 * GIB
    assert gpu_bytes(plan, StateObject.kv("a", "s1"), "g0") == 2 * GIB  # what the pool's room leaves of it
    assert plan.objective.unserved == 0


def staying_engine() -> dict[str, Any]:
    """n0: two 26 GiB cards; b's managed vLLM engine runs on g1 with a 20 GiB pool holding its active session's
    4 GiB of KV; c (16 GiB), in flight too, is on NVMe. n1: one 26 GiB card, empty. Every engine is vLLM."""
    vllm = {"kind": "vllm", "features": ["sleep_mode", "lmcache"], "management": "managed"}
    return scenario(
        [
            {**node("n0", gpu("g0", 26), gpu("g1", 26)), "engines": [{"model": "b", **vllm}, {"model": "c", **vllm}]},
            {**node("n1", gpu("h0", 26)), "engines": [{"model": "b", **vllm}, {"model": "c", **vllm}]},
        ],
        [model("b", 4), model("c", 16)],
        [
            session("sb", "b", active=True, tokens=4 * TOKENS_PER_GIB),
            session("sc", "c", active=True, tokens=TOKENS_PER_GIB),
        ],
        [
            held(weights("b"), on_gpu("g1"), 4 * GIB),
            held(weights("b"), on_nvme("n0"), 4 * GIB),
            held(weights("b"), on_nvme("n1"), 4 * GIB),
            held(kv("b", "sb"), on_gpu("g1"), 4 * GIB),
            held(weights("c"), on_nvme("n0"), 16 * GIB),
            held(weights("c"), on_nvme("n1"), 16 * GIB),
        ],
    )


def test_a_running_engine_the_choice_keeps_keeps_its_gpus() -> None:
    """The joint choice keeps b on its running engine and serves c on n0 too; c, placed first, would take the
    widest group that fits, g0 and g1, leaving b's engine (4 GiB of weights and its 20 GiB pool) no room to
    stay: b then restarted on n1, re-prefilling its session. The engine's room is held until b is placed."""
    problem = problem_from_scenario(parse_scenario(staying_engine()))
    problem = dataclasses.replace(problem, engine_pools={("n0", "b"): 20 * GIB})
    plan = solve(problem)
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    assert plan.unserved == {}
    assert gpu_bytes(plan, StateObject.weights("b", "bf16"), "g1") == 4 * GIB  # b stays
    assert gpu_bytes(plan, StateObject.kv("b", "sb"), "g1") == 4 * GIB
    c_on = {
        loc.id
        for (obj, loc), n in plan.placement.items()
        if obj == StateObject.weights("c", "bf16") and n and loc.tier is Tier.GPU
    }
    assert c_on == {"g0"}
    assert not any(obj.kind is Kind.WEIGHTS and loc.id == "h0" for obj, loc in plan.placement)
