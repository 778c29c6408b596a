"""GPU capacity in every order a plan's `depends_on` allows counts what engines hold beside the bytes moved:
the CUDA context of every instance up (engines.holdings), arriving with the step that takes it up and leaving
with the one that stops it, and the KV pool a start, wake or restart launches, with that step's first move
(planner/invariants.py `_every_order_safe`); a step that brings an instance up waits on the frees of its
GPUs (planner/operations.py `share_step_dependencies`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from tiny_clusters import GIB, gpu, held, model, node, on_gpu, on_nvme, plan_for, scenario, session, weights

from planner_service.domain.engines import Transition
from planner_service.domain.state import Location
from planner_service.planner import engine_instances
from planner_service.planner.invariants import check_plan
from planner_service.planner.operations import Operation

VLLM = {"kind": "vllm", "features": ["lmcache", "sleep_mode", "dev_mode"]}
CONTEXT = engine_instances.ENGINE_CONSTANTS.context_bytes_per_gpu


def sleep_then_start(b_tokens: int, b_max_context: int | None = None) -> dict[str, Any]:
    """One 25 GiB card: a (16 GiB) runs idle on it, b (4 GiB) is stopped and one of its sessions is in flight
    (128 KiB of KV a token): a must sleep for b to start."""
    engines = [{"model": "a", "gpus": ["g0"], **VLLM}, {"model": "b", "gpus": ["g0"], **VLLM}]
    b = model("b", 4, **({"max_context_tokens": b_max_context} if b_max_context else {}))
    return scenario(
        [{**node("n0", gpu("g0", 25)), "engines": engines}],
        [model("a", 16), b],
        [session("s1", "a", tokens=1024), session("s2", "b", active=True, tokens=b_tokens)],
        [
            held(weights("a"), on_gpu("g0"), 16 * GIB),
            held(weights("a"), on_nvme("n0"), 16 * GIB),
            held(weights("b"), on_nvme("n0"), 4 * GIB),
        ],
    )


def moved_onto(ops: list[Operation], gpu_id: str) -> int:
    return sum(op.bytes for op in ops if op.dest == Location.gpu(gpu_id))


@pytest.mark.parametrize(
    ("b_tokens", "b_max_context"),
    [
        (32_768, None),  # b's KV 4 GiB, its pool no larger: the two contexts are what does not fit
        (1_024, 32_768),  # b's KV 128 MiB in a pool launched for one 32,768-token request (4 GiB)
    ],
)
def test_a_start_that_may_run_before_the_sleep_of_its_card_is_refused(b_tokens: int, b_max_context: int | None) -> None:
    """The greedy's plan waits for a's sleep before b's start and passes. Without those waits, b's start may
    come first: 16 GiB of a + a's context + b's 4 GiB + its pool (KV in it) + b's context = 26 GiB on a
    25 GiB card, though the bytes moved alone (a's 16 + b's weights and KV) fit."""
    problem, plan = plan_for(sleep_then_start(b_tokens, b_max_context))
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    (start,) = [op for op in plan.operations if op.engine and op.engine.transition is Transition.START]
    (sleep,) = [op for op in plan.operations if op.engine and op.engine.transition is Transition.SLEEP_LEVEL_1]
    assert sleep.id in start.depends_on and start.engine is not None
    assert start.engine.instance.kv_pool_bytes_per_gpu == 4 * GIB
    unordered = [dataclasses.replace(op, depends_on=[]) for op in plan.operations]
    assert 16 * GIB + moved_onto(unordered, "g0") <= problem.gpus["g0"].capacity_bytes
    worst = 16 * GIB + CONTEXT + 4 * GIB + 4 * GIB + CONTEXT
    assert check_plan(problem, plan.placement, unordered, plan.unserved) == [
        f"capacity in some order: gpu:g0 can reach {worst} bytes > {25 * GIB}"
    ]


def restart_beside_a_sleep() -> dict[str, Any]:
    """Two 24 GiB cards: a (8 GiB) and b (12 GiB) run on g1, a's four sessions in flight want 16 GiB of KV, b
    is idle. a restarts on both cards (4 GiB of weights and an 8 GiB pool on each) and b sleeps."""
    engines = [{"model": "a", **VLLM}, {"model": "b", "gpus": ["g1"], **VLLM}]
    return scenario(
        [{**node("n0", gpu("g0", 24), gpu("g1", 24)), "engines": engines}],
        [model("a", 8), model("b", 12)],
        [session(f"s{i}", "a", active=True, tokens=32_768) for i in range(4)] + [session("t", "b", tokens=1024)],
        [
            held(weights("a"), on_gpu("g1"), 8 * GIB),
            held(weights("a"), on_nvme("n0"), 8 * GIB),
            held(weights("b"), on_gpu("g1"), 12 * GIB),
            held(weights("b"), on_nvme("n0"), 12 * GIB),
        ],
    )


def test_a_restart_waits_on_the_frees_of_its_gpus_even_where_its_own_move_there_is_a_free() -> None:
    """a's restart moves onto g1 nothing but a drop of half its shard there, so no add of it waits on b's
    sleep; yet the one call maps a's 8 GiB pool on g1 with whichever of its moves runs first. The restart
    waits on the sleep; without that wait its pool may come while b's 12 GiB are still there:
    8 + 12 + two contexts + 8 of a's KV in its pool - 4 dropped = 26 GiB on a 24 GiB card."""
    problem, plan = plan_for(restart_beside_a_sleep())
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    restart = [op for op in plan.operations if op.engine and op.engine.transition is Transition.RESTART]
    (sleep,) = [op for op in plan.operations if op.engine and op.engine.transition is Transition.SLEEP_LEVEL_1]
    assert restart and all(sleep.id in op.depends_on for op in restart)
    assert {op.engine.instance.kv_pool_bytes_per_gpu for op in restart if op.engine} == {8 * GIB}
    ids = {op.id for op in restart}
    unordered = [
        dataclasses.replace(op, depends_on=[d for d in op.depends_on if d != sleep.id]) if op.id in ids else op
        for op in plan.operations
    ]
    worst = 8 * GIB + 12 * GIB + 2 * CONTEXT + 8 * GIB - 4 * GIB
    assert check_plan(problem, plan.placement, unordered, plan.unserved) == [
        f"capacity in some order: gpu:g1 can reach {worst} bytes > {24 * GIB}"
    ]
