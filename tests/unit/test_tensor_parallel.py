"""vLLM splits a model's attention heads over its tensor-parallel group and refuses a group size that does
not divide them (vllm/config/__init__.py, `ModelConfig.verify_with_parallel_config`): on a vLLM node the
planners offer only such groups; other kinds, and a model whose heads are unknown, take any size."""

from __future__ import annotations

from typing import Any

import pytest
from tiny_clusters import gpu, held, node, on_nvme, plan_for, scenario, session, weights

from planner_service.domain.engines import EngineKind, tensor_parallel_ok
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.planner.invariants import check_plan
from planner_service.solver.registry import solve

# Qwen2.5-Coder-32B: 40 attention heads; 65.5 GB at bf16 (a 21.8 GB shard on each of 3 cards of 24 GiB, too
# much for 2), 32.8 GB at fp8 (2 cards)
CODER = {"id": "coder", "preset": "qwen2.5-coder-32b-instruct", "precisions": ["bf16", "fp8"]}
CHECKPOINTS = [
    held(weights("coder", p), on_nvme("n1"), n) for p, n in (("bf16", 65_527_752_704), ("fp8", 32_763_876_352))
]


def three_cards(kind: str) -> dict[str, Any]:
    out = node("n1", *(gpu(f"n1-g{i}", 24) for i in range(3)))
    out["engines"] = [{"model": "coder", "kind": kind, "features": ["sleep_mode", "dev_mode"]}]
    return out


def coder_group(kind: str, solver: str = "greedy") -> tuple[str, int]:
    data = scenario([three_cards(kind)], [CODER], [session("s1", "coder", active=True, tokens=1000)], CHECKPOINTS)
    problem, _ = plan_for(data)
    plan = solve(problem, solver)
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    (precision,) = {o.precision for (o, loc) in plan.placement if o.kind is Kind.WEIGHTS and loc.tier is Tier.GPU}
    on = {loc.id for (o, loc) in plan.placement if o.kind is Kind.WEIGHTS and loc.tier is Tier.GPU}
    return str(precision), len(on)


@pytest.mark.parametrize(
    ("kind", "heads", "tp", "ok"),
    [
        (EngineKind.VLLM, 40, 3, False),
        (EngineKind.VLLM, 40, 4, True),
        (EngineKind.VLLM, 0, 3, True),  # heads unknown
        (EngineKind.SGLANG, 40, 3, True),
        (EngineKind.LOCAL, 40, 3, True),
        (None, 40, 3, True),
    ],
)
def test_the_rule(kind: EngineKind | None, heads: int, tp: int, ok: bool) -> None:
    assert tensor_parallel_ok(kind, heads, tp) is ok


@pytest.mark.parametrize("solver", ["greedy", "search", "milp"])
def test_on_vllm_three_cards_serve_a_40_head_model_on_two_at_fp8(solver: str) -> None:
    assert coder_group("vllm", solver) == ("fp8", 2)


def test_on_a_local_engine_all_three_cards_serve_it() -> None:
    assert coder_group("local")[1] == 3  # the widest group that fits, as for any kind that takes any size


def test_the_checker_refuses_a_new_vllm_group_that_does_not_divide_the_heads() -> None:
    data = scenario([three_cards("vllm")], [CODER], [session("s1", "coder", active=True, tokens=1000)], CHECKPOINTS)
    problem, plan = plan_for(data)
    shard = problem.models["coder"].weights_bytes["bf16"] // 3
    target = {
        key: n for key, n in plan.placement.items() if not (key[0].kind is Kind.WEIGHTS and key[1].tier is Tier.GPU)
    }
    target |= {(StateObject.weights("coder", "bf16"), Location.gpu(g)): shard for g in problem.nodes["n1"].gpus}
    broken = check_plan(problem, target, [], plan.unserved)
    assert any("needs a group size that divides its 40 attention heads" in e for e in broken), broken
