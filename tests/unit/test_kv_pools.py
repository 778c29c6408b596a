"""KV pools are launch settings: an engine starts with at least one request of its model's maximum context,
a running engine holds no more KV than the pool it was launched with, and the planner, the checker, the
SRV and the simulator all read that one rule (planner_service/domain/engines.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from tiny_clusters import GIB, gpu, held, model, node, on_gpu, on_host, on_nvme, plan_for, scenario, session, weights

from planner_service.domain import engines
from planner_service.domain.demo import demo_scenario_json
from planner_service.domain.engines import EngineKind, LaunchSettings, Transition
from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.problem import ModelSpec, Problem, resolve_model
from planner_service.domain.scenario import ModelIn, ScenarioError, parse_scenario
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.planner import engine_holdings, engine_instances
from planner_service.planner.invariants import check_plan
from planner_service.planner.operations import Operation
from planner_service.planner.plan import Plan
from planner_service.planner.srv import srv_rows
from planner_service.sim.instances import EngineBook
from planner_service.solver.registry import solve

VLLM = {"kind": "vllm", "features": ["lmcache", "sleep_mode", "dev_mode"]}


def demo_problem() -> Problem:
    return problem_from_scenario(parse_scenario(demo_scenario_json()))


# --- the minimum pool, by hand ------------------------------------------------------------------------------


def test_the_minimum_pool_of_a_dense_model_is_one_longest_request_per_gpu() -> None:
    """The demo's planner is Llama-3.1-8B (32 layers, 8 KV heads of 128, bf16), served up to 32,768 tokens:

    kv_bytes_per_token = 2 (K and V) x 32 layers x 8 heads x 128 x 2 bytes = 131,072
    min pool per GPU   = ceil(131,072 x 32,768 / tp) = 4 GiB on one GPU, 2 GiB on two
    """
    problem = demo_problem()
    spec = problem.models["planner"]
    assert (spec.kv_bytes_per_token, spec.max_context_tokens) == (131_072, 32_768)
    assert engine_holdings.min_pool_bytes_per_gpu(problem, "planner", 1) == 4 * GIB
    assert engine_holdings.min_pool_bytes_per_gpu(problem, "planner", 2) == 2 * GIB


def test_the_minimum_pool_of_a_moe_model_is_one_longest_request_per_gpu() -> None:
    """The demo's reasoner is DeepSeek-V3 (MLA: one 512-wide latent and a 64-wide rope key per layer, 61
    layers, bf16 cache), served up to 65,536 tokens; its routed experts take no KV. The latent is one KV head
    that every tensor-parallel rank holds whole (vLLM's get_num_kv_heads is 1 under MLA), so the pool per GPU
    does not shrink with the group (it was 70,272 x 65,536 / 4 = 1,151,336,448 on four cards when the
    planner split every KV evenly):

        kv_bytes_per_token = 61 x (512 + 64) x 2 bytes = 70,272
        min pool per GPU   = 70,272 x 65,536 = 4,605,345,792 on one GPU and on four
    """
    problem = demo_problem()
    spec = problem.models["reasoner"]
    assert spec.is_moe and (spec.kv_bytes_per_token, spec.max_context_tokens) == (70_272, 65_536)
    assert spec.kv_heads == 1
    assert engine_holdings.min_pool_bytes_per_gpu(problem, "reasoner", 1) == 4_605_345_792
    assert engine_holdings.min_pool_bytes_per_gpu(problem, "reasoner", 4) == 4_605_345_792


# --- the KV one GPU of a tensor-parallel group holds, by hand -------------------------------------------------


def preset_spec(preset: str) -> ModelSpec:
    return resolve_model(ModelIn.model_validate({"id": preset, "preset": preset}), preset)


def test_every_rank_holds_the_whole_mla_latent() -> None:
    """DeepSeek-V3 (config: 61 layers, kv_lora_rank 512, qk_rope_head_dim 64) on 4 x L40, bf16 cache: each
    card holds 61 x (512 + 64) x 2 bytes = 70,272 bytes per token, all of it, not 70,272 / 4 = 17,568."""
    spec = preset_spec("deepseek-v3")
    assert (spec.kv_bytes_per_token, spec.kv_heads) == (70_272, 1)
    assert spec.kv_bytes_per_gpu(1, 4) == 70_272
    assert spec.kv_bytes_per_gpu(1_000, 4) == 70_272_000


def test_kv_heads_fewer_than_the_group_are_replicated() -> None:
    """Qwen3-235B-A22B (94 layers, 4 KV heads of 128, bf16): 2 x 94 x 4 x 128 x 2 = 192,512 bytes per token.
    On 8 cards each rank holds max(1, 4 / 8) = 1 of the 4 heads: 192,512 / 4 = 48,128 per card, not
    192,512 / 8 = 24,064. Llama-3.3-70B (80 layers, 8 KV heads of 128): 2 x 80 x 8 x 128 x 2 = 327,680 bytes
    per token; on 16 cards one head of 8 per card, 40,960, not 20,480."""
    qwen, llama = preset_spec("qwen3-235b-a22b"), preset_spec("llama-3.3-70b-instruct")
    assert (qwen.kv_bytes_per_token, qwen.kv_heads) == (192_512, 4)
    assert qwen.kv_bytes_per_gpu(1, 8) == 48_128
    assert qwen.kv_bytes_per_gpu(1, 4) == 48_128  # 4 cards: one head each, the even split
    assert (llama.kv_bytes_per_token, llama.kv_heads) == (327_680, 8)
    assert llama.kv_bytes_per_gpu(1, 16) == 40_960


def test_a_dense_model_with_enough_kv_heads_splits_evenly() -> None:
    """Llama-3.1-8B (8 KV heads) on 4 cards: two heads a card, 131,072 / 4 = 32,768 bytes per token, as before;
    a model of unknown KV heads (given only its KV per token) splits evenly too."""
    assert preset_spec("llama-3.1-8b-instruct").kv_bytes_per_gpu(1, 4) == 32_768
    bare = resolve_model(
        ModelIn.model_validate({"id": "m", "weights_bytes": {"bf16": GIB}, "kv_bytes_per_token": 1000}), "m"
    )
    assert bare.kv_heads == 0 and bare.kv_bytes_per_gpu(3, 4) == 750
    given = resolve_model(
        ModelIn.model_validate({"id": "m", "weights_bytes": {"bf16": GIB}, "kv_bytes_per_token": 1000, "kv_heads": 2}),
        "m",
    )
    assert given.kv_bytes_per_gpu(3, 4) == 1500  # 2 heads on 4 cards: half the token's KV on each


def test_the_split_over_a_group() -> None:
    assert [engines.kv_split_ways(h, 8) for h in (0, 1, 4, 8, 16)] == [8, 1, 4, 8, 8]
    # a pool in tokens holds each token's share of the rank: 1,500 bytes on each of 4 cards, 2 KV heads
    assert engines.kv_pool_tokens(1000, 1500, 4, kv_heads=2) == 3
    assert engines.min_kv_pool_bytes_per_gpu(1000, 3, 4, kv_heads=2) == 1500


def test_the_model_s_own_limit_is_its_config_s_max_position_embeddings() -> None:
    """Without `max_context_tokens` a preset's config decides, as vLLM's max_model_len and SGLang's
    context_len default to: the demo's longctx (Llama-3.3-70B) keeps 131,072."""
    assert demo_problem().models["longctx"].max_context_tokens == 131_072
    data = demo_scenario_json()
    data["models"][0]["max_context_tokens"] = 0
    with pytest.raises((ScenarioError, ValueError), match="max_context_tokens"):
        parse_scenario(data)


def test_the_launch_rule_and_what_a_pool_holds() -> None:
    assert engines.min_kv_pool_bytes_per_gpu(1000, 3, 2) == 1500
    assert engines.min_kv_pool_bytes_per_gpu(1000, 3, 4) == 750
    assert engines.min_kv_pool_bytes_per_gpu(1000, 1, 3) == 334  # rounded up: the engine needs the whole request
    assert engines.min_kv_pool_bytes_per_gpu(1000, 0, 2) == 0  # unknown context: no floor
    # the pool in tokens (SGLang's --max-total-tokens): the minimum holds the longest request
    assert engines.kv_pool_tokens(1000, engines.min_kv_pool_bytes_per_gpu(1000, 3, 2), 2) == 3
    assert engines.kv_pool_tokens(1000, engines.min_kv_pool_bytes_per_gpu(1000, 1, 3), 3) == 1
    assert engines.kv_pool_tokens(0, 4096, 2) == 0  # no KV size known: no token count
    assert engines.launch_kv_pool_bytes_per_gpu(1500, 900) == 1500
    assert engines.launch_kv_pool_bytes_per_gpu(1500, 2000) == 2000
    assert engines.kv_held_in_pool(1500, 2000) == 1500
    assert engines.kv_held_in_pool(1500, 700) == 700
    with pytest.raises(ValueError, match="tp 0"):
        engines.min_kv_pool_bytes_per_gpu(1, 1, 0)


def test_an_instance_s_minimum_follows_its_launch_limit() -> None:
    """--max-model-len 8192 on two GPUs: 131,072 x 8,192 / 2 = 512 MiB per GPU, whatever the model's own limit."""
    inst = engines.EngineInstance(
        EngineKind.VLLM,
        "m",
        "bf16",
        ("g0", "g1"),
        GIB,
        LaunchSettings(0, max_context_tokens=8192),
        kv_bytes_per_token=131_072,
        model_max_context_tokens=131_072,
    )
    assert inst.max_context_tokens == 8192
    assert inst.min_kv_pool_bytes_per_gpu == 512 * 2**20


# --- the planner launches pools the engines start with, and keeps KV within them ------------------------------


def one_card(b_active: bool, b_tokens: int = 8192) -> dict[str, Any]:
    """One 26 GiB card whose vLLM engine serves a (16 GiB) with s1's KV in its pool; b (4 GiB) is cold."""
    engines_ = [{"model": "a", "gpus": ["g0"], **VLLM}, {"model": "b", "gpus": ["g0"], **VLLM}]
    return scenario(
        [{**node("n0", gpu("g0", 26)), "engines": engines_}],
        [model("a", 16), model("b", 4)],
        [
            session("s1", "a", active=True, tokens=4096),
            session("s3", "a", active=True, tokens=4096),
            session("s2", "b", active=b_active, tokens=b_tokens),
        ],
        [
            held(weights("a"), on_gpu("g0"), 16 * GIB),
            held(weights("a"), on_nvme("n0"), 16 * GIB),
            held({"kind": "kv", "model": "a", "session": "s1"}, on_gpu("g0"), 4096 * 4096),
            held(weights("b"), on_nvme("n0"), 4 * GIB),
        ],
    )


def launches(plan: Plan) -> dict[str, int]:
    return {
        op.engine.instance.model: op.engine.instance.kv_pool_bytes_per_gpu
        for op in plan.operations
        if op.engine is not None and op.engine.transition in (Transition.START, Transition.RESTART, Transition.WAKE)
    }


def test_a_start_launches_at_least_one_longest_request_of_pool() -> None:
    """b's sessions are its longest request: 8,192 tokens x 4,096 bytes = 32 MiB, more than the KV the plan
    puts in its pool when b has no session in flight."""
    problem, plan = plan_for(one_card(b_active=True))
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    assert launches(plan)["b"] >= 8192 * 4096


def test_the_planner_keeps_a_running_engine_s_kv_within_its_pool() -> None:
    """a's engine reports a pool that holds s1 alone: s3's new KV cannot join it there (the pool's LRU evicts
    an idle session's KV first, but both are in flight), so the plan predicts s3's KV off the GPU."""
    problem = problem_from_scenario(parse_scenario(one_card(b_active=False)))
    pool = 4096 * 4096
    problem = dataclasses.replace(problem, engine_pools={("n0", "a"): pool})
    plan = solve(problem)
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    on_g0 = sum(n for (obj, loc), n in plan.placement.items() if obj.kind is Kind.KV and loc == Location.gpu("g0"))
    assert on_g0 <= pool
    assert "b" not in launches(plan) or launches(plan)["b"] >= engine_holdings.min_pool_bytes_per_gpu(problem, "b", 1)


def with_pool(problem: Problem, plan: Plan, model_id: str, pool: int) -> list[str]:
    ops: list[Operation] = []
    for op in plan.operations:
        if op.engine is not None and op.engine.instance.model == model_id:
            instance = op.engine.instance.model_copy(update={"kv_pool_bytes_per_gpu": pool})
            op = dataclasses.replace(op, engine=op.engine.model_copy(update={"instance": instance}))
        ops.append(op)
    return [e for e in check_plan(problem, plan.placement, ops, plan.unserved) if e.startswith("engine:")]


def test_the_checker_refuses_a_start_below_the_minimum_pool() -> None:
    problem, plan = plan_for(one_card(b_active=True))
    least = engine_holdings.min_pool_bytes_per_gpu(problem, "b", 1)
    assert with_pool(problem, plan, "b", least) == []
    errors = with_pool(problem, plan, "b", least - 1)
    assert any("b's engine on n0 is launched with a KV pool" in e and "would refuse to start" in e for e in errors)


def test_the_checker_refuses_kv_beyond_a_running_engine_s_pool() -> None:
    """The plan made for a's engine as the placement implies it; a node then reports a smaller pool than the
    KV the plan keeps there: the engine cannot hold it."""
    problem, plan = plan_for(one_card(b_active=False))
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    on_g0 = sum(n for (obj, loc), n in plan.placement.items() if obj.kind is Kind.KV and obj.model == "a"
                and loc == Location.gpu("g0"))  # fmt: skip
    assert on_g0 > 0
    reported = dataclasses.replace(problem, engine_pools={("n0", "a"): on_g0 - 1})
    errors = [
        e for e in check_plan(reported, plan.placement, plan.operations, plan.unserved) if e.startswith("engine:")
    ]
    assert any("a's KV on gpu:g0 is planned at" in e and "beyond its engine's KV pool" in e for e in errors)


def test_the_srv_counts_no_gpu_kv_beyond_an_engine_s_pool() -> None:
    problem = problem_from_scenario(parse_scenario(one_card(b_active=False)))
    kv_s3 = (StateObject.kv("a", "s3"), Location.gpu("g0"))
    placement = {**problem.residency, kv_s3: 4096 * 4096}
    full = {(r.model, r.state, r.tier): r.bytes for r in srv_rows(problem, placement)}
    assert full[("a", Kind.KV, Tier.GPU)] == 2 * 4096 * 4096  # the pool the placement implies holds both
    reported = dataclasses.replace(problem, engine_pools={("n0", "a"): 4096 * 4096 + 5})
    capped = {(r.model, r.state, r.tier): r.bytes for r in srv_rows(reported, placement)}
    assert capped[("a", Kind.KV, Tier.GPU)] == 4096 * 4096 + 5


def test_the_simulator_launches_the_same_minimum() -> None:
    problem = demo_problem()
    book = EngineBook(problem, engine_instances.ENGINE_CONSTANTS)
    gpus = tuple(problem.gpus[g] for g in ("n1-g0", "n1-g1"))
    inst = book.instance("n1", "planner", "bf16", gpus)
    assert inst.launch.kv_pool_bytes_per_gpu == inst.min_kv_pool_bytes_per_gpu
    assert inst.min_kv_pool_bytes_per_gpu == engine_holdings.min_pool_bytes_per_gpu(problem, "planner", 2) == 2 * GIB


def asleep_on_one_card() -> dict[str, Any]:
    """b's vLLM engine sleeps at level 1 on g0 (its weights in host RAM), and two of its sessions are in
    flight: 8,192 tokens each at 128 KiB a token, 1 GiB of KV apiece, to prefill once it is woken."""
    return scenario(
        [{**node("n0", gpu("g0", 26)), "engines": [{"model": "b", "gpus": ["g0"], **VLLM}]}],
        [model("b", 4)],
        [session("s1", "b", active=True), session("s2", "b", active=True)],
        [held(weights("b"), on_host("n0"), 4 * GIB), held(weights("b"), on_nvme("n0"), 4 * GIB)],
    )


@pytest.mark.parametrize("solver", ["greedy", "milp"])
def test_a_wake_keeps_the_pool_its_sleeping_engine_reported(solver: str) -> None:
    """A wake maps the sleeping engine's pool back at the size it was launched with (vLLM's CuMemAllocator
    re-maps its recorded allocations): the plan's wake carries that pool, and the KV it prefills there stays
    within it, however much the sessions would take."""
    problem = problem_from_scenario(parse_scenario(asleep_on_one_card()))
    assert engine_instances.confirmed_states(problem)[("n0", "b")].state is engines.EngineState.ASLEEP_HOST
    planned = solve(problem, solver)
    assert launches(planned)["b"] == 2 * GIB  # unknown pool: launched for the KV the plan prefills there
    pool = 3 * GIB // 2
    reported = dataclasses.replace(problem, engine_pools={("n0", "b"): pool})
    plan = solve(reported, solver)
    assert launches(plan) == {"b": pool}
    on_g0 = sum(n for (obj, loc), n in plan.placement.items() if obj.kind is Kind.KV and loc == Location.gpu("g0"))
    assert 0 < on_g0 <= pool
    assert check_plan(reported, plan.placement, plan.operations, plan.unserved) == []
    if solver == "milp":  # its own plan, not the greedy's it falls back to when its own breaks an invariant
        assert plan.extra["milp"]["invariant_errors"] == []
