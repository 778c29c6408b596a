"""The planner plans engine instances (planner/engine_plan.py): on vLLM and SGLang nodes every weights move
is a start, wake, sleep, stop, restart or read-ahead of one instance, priced by the engine model, and the
invariant checker refuses the steps an engine would refuse."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import pytest
from tiny_clusters import (
    GIB,
    experts,
    gpu,
    held,
    kv,
    model,
    node,
    on_gpu,
    on_host,
    on_nvme,
    plan_for,
    scenario,
    session,
    weights,
)

from planner_service.domain.demo import demo_scenario_json
from planner_service.domain.engines import EngineState, Transition
from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.problem import Problem
from planner_service.domain.scenario import parse_scenario
from planner_service.domain.state import Location, StateObject, Tier
from planner_service.planner import engine_instances, engine_plan
from planner_service.planner.invariants import check_plan
from planner_service.planner.operations import Operation, apply_operations
from planner_service.planner.plan import Plan, make_plan
from planner_service.planner.residency import ResidencyIndex
from planner_service.solver.registry import solve

VLLM = {"kind": "vllm", "features": ["lmcache", "sleep_mode", "dev_mode"]}


def transitions(plan: Plan) -> set[Transition]:
    return {op.engine.transition for op in plan.operations if op.engine is not None}


def demo_problem() -> Problem:
    data = demo_scenario_json()
    assert all(
        e["kind"] == "vllm" and "lmcache" in e["features"] for n in data["cluster"]["nodes"] for e in n["engines"]
    )
    return problem_from_scenario(parse_scenario(data))


# a first plan for the demo that moves vision and the summarizer off n4 (nodes and precisions given, as the local
# search gives them): their engines there sleep at level 1
OFF_N4 = {
    "nodes": {"vision": "n3", "summarizer": "n2", "reasoner": "n2", "longctx": "n1", "air": "n1", "coder": "n2",
              "planner": "n3"},
    "precisions": {"vision": "bf16", "summarizer": "bf16", "reasoner": "fp8", "longctx": "int4", "air": "fp8",
                   "coder": "bf16", "planner": "bf16"},
}  # fmt: skip


def test_the_demo_s_plans_start_sleep_and_wake_engines() -> None:
    problem = demo_problem()
    first = solve(problem, **OFF_N4)
    assert check_plan(problem, first.placement, first.operations, first.unserved) == []
    assert {Transition.START, Transition.SLEEP_LEVEL_1} <= transitions(first)
    # the plan done and the engines' states reported, vision's requests come back; the online rules pin it
    # to n4, where its engine sleeps at level 1 (planner/online.py pins a model where it served)
    assert first.instances[("n4", "vision")].state is EngineState.ASLEEP_HOST
    observed = {k: (v.state, v.gpus) for k, v in first.instances.items() if v.state is not EngineState.STOPPED}
    sessions = {
        sid: dataclasses.replace(s, active=s.active or s.model == "vision") for sid, s in problem.sessions.items()
    }
    then = dataclasses.replace(problem, residency=first.placement, sessions=sessions, observed_engines=observed)
    second = solve(then, nodes={"vision": "n4"}, precisions={"vision": "bf16"})
    assert check_plan(then, second.placement, second.operations, second.unserved) == []
    (wake,) = [op.engine for op in second.operations if op.engine and op.engine.transition is Transition.WAKE]
    assert wake is not None and (wake.instance.id, wake.from_state) == ("vision@bf16@n4-g1", EngineState.ASLEEP_HOST)
    # the vision engine that ran in its place leaves its GPUs
    (left,) = [
        op.engine
        for op in second.operations
        if op.engine and op.engine.instance.model == "vision" and op.engine.transition is not Transition.WAKE
    ][:1]
    assert left.transition in {Transition.SLEEP_LEVEL_1, Transition.SLEEP_LEVEL_2, Transition.STOP}
    assert left.from_state is EngineState.RUNNING and left.instance.node != "n4"


def test_every_move_of_a_step_waits_on_what_any_of_them_waits_on() -> None:
    """A step is one call, made on the first of its moves an agent runs: the demo's first plan starts engines
    on n1's four GPUs as the reasoner's engine leaves them, so every move of such a start waits on every GPU's
    free, not only on its own GPU's (else the move whose GPU is free first starts the engine on full GPUs)."""
    problem = demo_problem()
    plan = solve(problem)
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    steps: dict[tuple[str, str, Transition], list[Operation]] = defaultdict(list)
    for op in plan.operations:
        if op.engine is not None and op.engine.transition in (Transition.START, Transition.WAKE, Transition.RESTART):
            steps[(op.node, op.engine.instance.id, op.engine.transition)].append(op)
    waits = {key: [set(op.depends_on) - {o.id for o in moves} for op in moves] for key, moves in steps.items()}
    assert all(all(w == ws[0] for w in ws) for ws in waits.values()), waits
    assert any(len(ws) > 1 and ws[0] for ws in waits.values())  # a group start that waits on frees


def switch_scenario(b_active: bool) -> dict[str, Any]:
    """One 26 GiB card whose vLLM engine serves a at bf16 (16 GiB); b (12 GiB) fits beside a only at fp8 (8 GiB)."""
    engines = [{"model": "a", "gpus": ["g0"], **VLLM}, {"model": "b", "gpus": ["g0"], **VLLM}]
    return scenario(
        [{**node("n0", gpu("g0", 26)), "engines": engines}],
        [model("a", {"bf16": 16, "fp8": 8}), model("b", 12)],
        [session("s1", "a", active=True, tokens=4096), session("s2", "b", active=b_active)],
        [
            held(weights("a"), on_gpu("g0"), 16 * GIB),
            held(weights("a"), on_nvme("n0"), 16 * GIB),
            held(weights("a", "fp8"), on_nvme("n0"), 8 * GIB),
            held(weights("b"), on_nvme("n0"), 12 * GIB),
        ],
    )


def test_a_demand_shift_that_pays_for_a_restart_gets_one() -> None:
    problem, plan = plan_for(switch_scenario(b_active=True))
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    restart = next(op.engine for op in plan.operations if op.engine and op.engine.transition is Transition.RESTART)
    assert restart.previous is not None and (restart.previous.precision, restart.instance.precision) == ("bf16", "fp8")
    assert Transition.START in transitions(plan)  # b's engine beside it


def test_a_demand_shift_that_does_not_pay_gets_no_restart() -> None:
    problem, plan = plan_for(switch_scenario(b_active=False))
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    assert Transition.RESTART not in transitions(plan)
    assert transitions(plan) <= {Transition.READAHEAD}  # at most b's checkpoint read into the page cache


def test_a_step_is_priced_once_per_instance_by_the_engine_model() -> None:
    """b's cold start from NVMe: cold_start_fixed + max(checkpoint / nvme_read, shard / h2d) (README)."""
    problem, plan = plan_for(switch_scenario(b_active=True))
    start = [op for op in plan.operations if op.engine and op.engine.transition is Transition.START]
    node, card = problem.nodes["n0"], problem.gpus["g0"]
    load = max(12 * GIB / node.nvme_read_bytes_per_s, 12 * GIB / card.h2d_bytes_per_s)
    expected = engine_instances.ENGINE_CONSTANTS.cold_start_fixed_seconds + load
    assert [op.estimated_seconds for op in start] == [pytest.approx(expected)]


def traded_gpus_scenario() -> dict[str, Any]:
    """Three RTX 3090s (2 GiB reserved each): DeepSeek-V3 (SGLang, fp8) runs on g0, GLM-4.5V (vLLM, bf16) on
    g1, with one idle GLM-4.5V session. The greedy restarts both onto all three cards: the vision engine's new
    shard on g0 waits for DeepSeek's old one to leave g0, and DeepSeek's new shard on g1 for the vision
    engine's to leave g1. Sizes are the catalog's (model_presets.py): 17.1 GB and 14.4 GB of dense weights."""
    gpus = [{"id": f"n0-g{i}", "type": "rtx-3090", "reserved_bytes": 2 * GIB} for i in range(3)]
    engines = [{"model": "deepseek", "kind": "sglang"}, {"model": "vision", "kind": "vllm"}]
    models = [
        # served up to 54,613 tokens: every rank holds DeepSeek's whole MLA latent, so its pool per card is
        # 70,272 B x 54,613 = 3,837,764,736 B on any group, about what the config's 163,840 tokens split over
        # three cards came to when the planner split every KV evenly (70,272 x 163,840 / 3 = 3,837,788,160 B)
        {"id": "deepseek", "preset": "deepseek-v3", "precisions": ["fp8"], "max_context_tokens": 54_613},
        {"id": "vision", "preset": "glm-4.5v", "precisions": ["bf16"]},
    ]
    data = scenario(
        [{**node("n0"), "gpus": gpus, "engines": engines}],
        models,
        [session("s0", "vision", slo="blocking", tokens=13_794)],
    )
    problem = problem_from_scenario(parse_scenario(data))
    ds, vis = problem.models["deepseek"], problem.models["vision"]
    data["residency"] = [
        held(weights("deepseek", "fp8"), on_nvme("n0"), ds.weights_bytes["fp8"]),
        held(experts("deepseek"), on_nvme("n0"), ds.experts_bytes),
        held(weights("vision"), on_nvme("n0"), vis.weights_bytes["bf16"]),
        held(experts("vision"), on_nvme("n0"), vis.experts_bytes),
        held(weights("deepseek", "fp8"), on_gpu("n0-g0"), ds.weights_bytes["fp8"]),
        held(weights("vision"), on_gpu("n0-g1"), vis.weights_bytes["bf16"]),
    ]
    return data


def steps_of(plan: Plan) -> dict[tuple[str, Transition], list[Operation]]:
    out: dict[tuple[str, Transition], list[Operation]] = defaultdict(list)
    for op in plan.operations:
        if op.engine is not None:
            out[(op.object.model, op.engine.transition)].append(op)
    return out


def test_engines_that_trade_gpus_stop_and_start_where_a_restart_cannot_be_ordered() -> None:
    """Each engine's restart waits on the other's old shard leaving: as two calls they cannot both go first.
    The vision engine stops instead (frees g1, waits on nothing), DeepSeek restarts once it has stopped, and
    the vision engine starts once DeepSeek has left g0; priced as the restart was, stop_fixed + cold start."""
    problem, plan = plan_for(traded_gpus_scenario())
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    steps = steps_of(plan)
    assert set(steps) == {
        ("deepseek", Transition.RESTART),
        ("vision", Transition.STOP),
        ("vision", Transition.START),
    }
    stop, start = steps[("vision", Transition.STOP)], steps[("vision", Transition.START)]
    restart = steps[("deepseek", Transition.RESTART)]
    stop_ids = {op.id for op in stop}
    assert all(not op.depends_on for op in stop)
    assert all(stop_ids <= set(op.depends_on) for op in restart)
    off_g0 = {op.id for op in restart if op.source is not None and op.source.id == "n0-g0" and op.dest is None}
    assert off_g0 and all(stop_ids | off_g0 <= set(op.depends_on) for op in start)
    # the stop names the old instance from its state now, the start the new one from stopped
    assert {(op.engine.instance.gpus[0], op.engine.from_state) for op in stop if op.engine} == {
        ("n0-g1", EngineState.RUNNING)
    }
    assert {op.engine.from_state for op in start if op.engine} == {EngineState.STOPPED}
    before, after = engine_instances.confirmed_states(problem), plan.instances
    key = ("n0", "vision")
    as_restart = engine_plan.step_seconds(problem, before[key], after[key], Transition.RESTART)
    priced = [op.estimated_seconds for op in stop + start if op.estimated_seconds]
    constants = engine_instances.ENGINE_CONSTANTS
    assert len(priced) == 2 and priced[0] == pytest.approx(constants.stop_fixed_seconds)
    assert sum(priced) == pytest.approx(as_restart)
    # GET /v1/engines: one step from its state now to its planned one, carried out as two calls
    rows = engine_plan.engine_rows(problem, plan.placement, engine_plan.plan_steps(plan.operations))
    vision = next(r for r in rows if r["model"] == "vision")
    assert (vision["planned_step"], vision["planned_steps"]) == ("restart", ["stop", "start"])


def test_a_stop_and_a_start_free_and_load_whole_shards_on_the_gpu_both_groups_hold() -> None:
    """The vision engine goes from g1 to g0-g2: as one restart its move on g1 was the difference between its
    shards. As a stop and a start, the stop drops all of the old shard on g1 (the stopped engine holds
    nothing there) and the start loads the new shard on g1 as on g0 and g2; the plan ends where it did."""
    problem, plan = plan_for(traded_gpus_scenario())
    vision = StateObject.weights("vision", "bf16")
    steps = steps_of(plan)
    stop, start = steps[("vision", Transition.STOP)], steps[("vision", Transition.START)]
    after_stop = apply_operations(problem.residency, stop)
    assert not [loc for (obj, loc) in after_stop if obj == vision and loc.tier is Tier.GPU]
    shard = plan.placement[(vision, Location.gpu("n0-g1"))]
    assert sorted((op.dest.id, op.bytes) for op in start if op.dest is not None) == [
        (f"n0-g{i}", shard) for i in range(3)
    ]
    assert apply_operations(problem.residency, plan.operations) == plan.placement


def test_the_checker_refuses_a_stop_or_start_that_moves_part_of_a_shard() -> None:
    """The stop as the restart's difference on g1 (the old shard less the new), with no load of g1 in the
    start: the confirmed state would keep a stopped engine's shard, and the start would load g1 unrecorded."""
    problem, plan = plan_for(traded_gpus_scenario())
    steps = steps_of(plan)
    stop, start = steps[("vision", Transition.STOP)], steps[("vision", Transition.START)]
    on_g1 = next(op for op in start if op.dest == Location.gpu("n0-g1"))
    ops = [
        dataclasses.replace(op, bytes=op.bytes - on_g1.bytes) if op is stop[0] else op
        for op in plan.operations
        if op is not on_g1
    ]
    errors = check_plan(problem, plan.placement, ops, plan.unserved)
    assert any("the stop of vision's engine on n0 frees" in e and "not its whole shard" in e for e in errors)
    assert any("the start of vision's engine on n0 loads 0 bytes" in e for e in errors)


def test_the_checker_refuses_a_start_that_does_not_wait_on_its_stop() -> None:
    """(It waits on the stop through DeepSeek's drop from g0 as well: only without any wait does it not.)"""
    problem, plan = plan_for(traded_gpus_scenario())
    ops = [
        dataclasses.replace(op, depends_on=[])
        if op.engine is not None and op.engine.transition is Transition.START
        else op
        for op in plan.operations
    ]
    errors = check_plan(problem, plan.placement, ops, plan.unserved)
    assert any("which the plan also stops, without waiting on the stop" in e for e in errors)


def test_a_restart_of_an_engine_that_cannot_stop_is_not_split() -> None:
    """`restart_unpairing` leaves a restart whole where the engine could not be stopped and started (the
    planner restarts no adopted engine: this is the guard should one reach it)."""
    problem, plan = plan_for(traded_gpus_scenario())
    steps = steps_of(plan)
    stop, start = steps[("vision", Transition.STOP)], steps[("vision", Transition.START)]
    first_stop, first_start = stop[0].engine, start[0].engine
    assert first_stop is not None and first_start is not None
    adopted = first_stop.instance.model_copy(update={"management": "adopted"})
    restart = first_start.model_copy(
        update={"transition": Transition.RESTART, "previous": adopted, "from_state": EngineState.RUNNING}
    )
    stop = [dataclasses.replace(op, engine=restart) for op in stop]
    start = [dataclasses.replace(op, engine=restart) for op in start]
    now = ResidencyIndex.build(problem, problem.residency)
    unpair = engine_plan.restart_unpairing(problem, engine_instances.confirmed_states(problem), plan.instances, now)
    assert not unpair(stop, start)
    assert {op.engine.transition for op in stop + start if op.engine} == {Transition.RESTART}


# --- the checker refuses what the engines refuse ------------------------------------------------------


def restart_plan() -> tuple[Problem, Plan]:
    return plan_for(switch_scenario(b_active=True))


def with_step(problem: Problem, plan: Plan, change: dict[str, Any], where: Transition) -> list[str]:
    ops: list[Operation] = []
    for op in plan.operations:
        if op.engine is not None and op.engine.transition is where:
            op = dataclasses.replace(op, engine=op.engine.model_copy(update=change))
        ops.append(op)
    return [e for e in check_plan(problem, plan.placement, ops, plan.unserved) if e.startswith("engine:")]


def test_the_checker_refuses_a_step_from_the_wrong_state() -> None:
    problem, plan = restart_plan()
    errors = with_step(problem, plan, {"from_state": EngineState.ASLEEP_HOST}, Transition.START)
    assert any("starts" in e and "from asleep_host, but it is stopped" in e for e in errors)


def test_the_checker_refuses_a_transition_the_kind_does_not_offer() -> None:
    problem, plan = restart_plan()
    instance = next(op.engine for op in plan.operations if op.engine and op.engine.transition is Transition.START)
    assert instance is not None
    no_sleep = instance.instance.model_copy(update={"features": []})
    errors = with_step(
        problem, plan, {"transition": Transition.WAKE, "from_state": EngineState.STOPPED, "instance": no_sleep},
        Transition.START,
    )  # fmt: skip
    assert any("for wake, which it does not offer (from_state)" in e for e in errors)


def test_the_checker_refuses_a_start_of_an_adopted_engine() -> None:
    problem, plan = restart_plan()
    start = next(op.engine for op in plan.operations if op.engine and op.engine.transition is Transition.START)
    assert start is not None
    adopted = start.instance.model_copy(update={"management": "adopted"})
    errors = with_step(problem, plan, {"instance": adopted}, Transition.START)
    assert any("for start, which it does not offer (managed)" in e for e in errors)


def test_the_checker_refuses_a_level_1_sleep_without_sleep_mode() -> None:
    problem, plan = restart_plan()
    restart = next(op.engine for op in plan.operations if op.engine and op.engine.transition is Transition.RESTART)
    assert restart is not None and restart.previous is not None
    bare = restart.previous.model_copy(update={"features": []})
    errors = with_step(
        problem, plan, {"transition": Transition.SLEEP_LEVEL_1, "previous": None, "instance": bare}, Transition.RESTART
    )
    assert any("for sleep_level_1, which it does not offer (sleep_mode)" in e for e in errors)


def test_the_checker_refuses_two_transitions_of_one_instance() -> None:
    problem, plan = restart_plan()
    first = next(op for op in plan.operations if op.engine and op.engine.transition is Transition.RESTART)
    assert first.engine is not None
    ops = [
        dataclasses.replace(
            op, engine=first.engine.model_copy(update={"transition": Transition.STOP, "previous": None})
        )
        if op is first
        else op
        for op in plan.operations
    ]
    errors = check_plan(problem, plan.placement, ops, plan.unserved)
    assert any("is asked for restart, stop in one plan" in e for e in errors)


def test_the_checker_refuses_a_gpu_move_without_a_step() -> None:
    problem, plan = restart_plan()
    ops = [dataclasses.replace(op, engine=None) for op in plan.operations]
    errors = check_plan(problem, plan.placement, ops, plan.unserved)
    assert any("with no engine step" in e for e in errors)


def test_the_checker_counts_a_launched_engine_s_kv_pool() -> None:
    problem, plan = restart_plan()
    start = next(op for op in plan.operations if op.engine and op.engine.transition is Transition.START)
    assert start.engine is not None
    free = problem.gpus["g0"].capacity_bytes - sum(n for (_, loc), n in plan.placement.items() if loc.id == "g0")
    big_pool = start.engine.instance.model_copy(update={"kv_pool_bytes_per_gpu": free + 2 * GIB})
    ops = [
        dataclasses.replace(op, engine=start.engine.model_copy(update={"instance": big_pool}))
        if op.engine is not None and op.engine.transition is Transition.START
        else op
        for op in plan.operations
    ]
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    errors = check_plan(problem, plan.placement, ops, plan.unserved)
    assert any(e.startswith("capacity: gpu:g0") and "engine pools and engines' CUDA contexts" in e for e in errors)


def test_the_checker_counts_running_and_sleeping_engines_contexts() -> None:
    """a runs and fills its card but for its own CUDA context; b's engine, reported asleep on the same card,
    holds its context too. a's weights alone filling the card leave no room for a's context: refused."""

    def problem_with(a_gib: float, observed: bool) -> Problem:
        engines = [{"model": "a", "gpus": ["g0"], **VLLM}, {"model": "b", "gpus": ["g0"], **VLLM}]
        data = scenario(
            [{**node("n0", gpu("g0", 24)), "engines": engines}],
            [model("a", a_gib), model("b", 4)],
            [],
            [held(weights("a"), on_gpu("g0"), int(a_gib * GIB)), held(weights("b"), on_nvme("n0"), 4 * GIB)],
        )
        problem = problem_from_scenario(parse_scenario(data))
        asleep = {("n0", "b"): (EngineState.ASLEEP_DISCARDED, ("g0",))} if observed else {}
        return dataclasses.replace(problem, observed_engines=asleep)

    capacity = problem_with(8, False).gpus["g0"].capacity_bytes
    context = engine_instances.ENGINE_CONSTANTS.context_bytes_per_gpu
    awake = problem_with((capacity - context) / GIB, False)
    assert check_plan(awake, dict(awake.residency), []) == []
    asleep = problem_with((capacity - context) / GIB, True)
    (error,) = check_plan(asleep, dict(asleep.residency), [])
    assert error.startswith("capacity: gpu:g0") and f"{2 * context} of engine pools and engines' CUDA contexts" in error
    full = problem_with(capacity / GIB, False)
    (error,) = check_plan(full, dict(full.residency), [])
    assert error.startswith(f"capacity: gpu:g0 holds {capacity} bytes and {context} of engine pools")


def test_a_wake_waits_for_the_gpu_a_demote_into_host_ram_frees_beside_its_backup_s_drop() -> None:
    """b's SGLang engine sleeps on g0 (30 GiB) with its weights backed up in host RAM; a (20 GiB, a local
    engine) holds g0. The plan wakes b there and puts a in host RAM, which has room for a beside b's backup:
    the demote waits on nothing there, and the wake waits on the demote. (Had the demote waited on the backup's
    drop, which follows the wake, the wake would have filled g0 first: 20 + 16 GiB.)"""
    engines = [{"model": "b", "gpus": ["g0"], "kind": "sglang", "features": ["sleep_mode", "cpu_backup"]}]
    data = scenario(
        [{**node("n0", gpu("g0", 30)), "engines": [*engines, {"model": "a", "kind": "local"}]}],
        [model("a", 20), model("b", 16)],
        [],
        [
            held(weights("a"), on_gpu("g0"), 20 * GIB),
            held(weights("b"), on_host("n0"), 16 * GIB),
            held(weights("b"), on_nvme("n0"), 16 * GIB),
        ],
    )
    problem = problem_from_scenario(parse_scenario(data))
    problem = dataclasses.replace(problem, observed_engines={("n0", "b"): (EngineState.ASLEEP_HOST, ("g0",))})
    a, b = StateObject.weights("a", "bf16"), StateObject.weights("b", "bf16")
    g0, host, nvme = Location.gpu("g0"), Location.host("n0"), Location.nvme("n0")
    target = {(a, host): 20 * GIB, (b, g0): 16 * GIB, (b, nvme): 16 * GIB}
    plan = make_plan(problem, "hand", target, {})
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    by_move = {(op.object, op.source, op.dest): op for op in plan.operations}
    demote, wake, drop = by_move[(a, g0, host)], by_move[(b, host, g0)], by_move[(b, host, None)]
    assert wake.engine is not None and wake.engine.transition is Transition.WAKE
    assert demote.depends_on == [] and demote.id in wake.depends_on and wake.id in drop.depends_on


def test_a_running_engine_the_plan_takes_off_sleeps_only_where_its_context_fits_beside_the_sleepers() -> None:
    """a's SGLang engine runs on g0 (24 GiB) and could sleep at level 1; b's sleeps there at level 2 and stays
    asleep, keeping its 1 GiB CUDA context; the plan takes a off and fills g0 with c (22.5 GiB): b's context
    leaves no room for a's, so a stops. (Judged before b's context was counted, a slept: 24.5 GiB on g0.)"""
    sglang = {"kind": "sglang", "gpus": ["g0"]}
    engines = [
        {"model": "a", **sglang, "features": ["sleep_mode", "cpu_backup"]},
        {"model": "b", **sglang, "features": ["sleep_mode"]},
        {"model": "c", "kind": "local"},
    ]
    data = scenario(
        [{**node("n0", gpu("g0", 24)), "engines": engines}],
        [model("a", 8), model("b", 8), model("c", 22.5)],
        [],
        [*(held(weights(m), on_nvme("n0"), size * GIB) for m, size in (("a", 8), ("b", 8), ("c", 22.5)))],
    )
    data["residency"].append(held(weights("a"), on_gpu("g0"), 8 * GIB))
    problem = problem_from_scenario(parse_scenario(data))
    problem = dataclasses.replace(problem, observed_engines={("n0", "b"): (EngineState.ASLEEP_DISCARDED, ("g0",))})
    c, g0 = StateObject.weights("c", "bf16"), Location.gpu("g0")
    target = {**{k: n for k, n in problem.residency.items() if k[1].tier is Tier.NVME}, (c, g0): int(22.5 * GIB)}
    plan = make_plan(problem, "hand", target, {})
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    assert plan.instances[("n0", "a")].state is EngineState.STOPPED
    assert plan.instances[("n0", "b")].state is EngineState.ASLEEP_DISCARDED


SGLANG_ADOPTED = {"kind": "sglang", "features": ["sleep_mode", "cpu_backup"], "management": "adopted"}


def test_an_adopted_engine_is_not_regrouped_and_its_session_s_kv_stays_whole_on_its_gpu() -> None:
    """a MoE's adopted SGLang engine runs on g0 alone; over both cards its experts would have more room, but
    only its owner could relaunch it there: it stays on g0, with its active session's KV whole beside it."""
    moe = model("a", 16, experts_bytes=64 * GIB, expert_bytes=GIB // 4)
    problem, plan = plan_for(
        scenario(
            [{**node("n0", gpu("g0", 24), gpu("g1", 24)), "engines": [{"model": "a", **SGLANG_ADOPTED}]}],
            [moe],
            [session("s1", "a", active=True, tokens=16384)],
            [
                held(weights("a"), on_gpu("g0"), 16 * GIB),
                held(kv("a", "s1"), on_gpu("g0"), 2 * GIB),
                held(weights("a"), on_nvme("n0"), 16 * GIB),
                held(experts("a"), on_nvme("n0"), 64 * GIB),
            ],
        )
    )
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    assert Transition.RESTART not in transitions(plan)
    assert plan.instances[("n0", "a")].gpus == ("g0",)
    s1 = next(obj for obj, _ in plan.placement if obj.session == "s1")
    assert {loc.id: n for (obj, loc), n in plan.placement.items() if obj == s1} == {"g0": 2 * GIB}


def test_a_running_engine_s_kv_pool_is_not_given_to_another_model() -> None:
    """a keeps serving on g0, where its pool holds s2's 6 GiB of KV that vLLM cannot free one request at a
    time: that room is a's, so b, which would fit only in it, waits."""
    engines = [{"model": "a", "gpus": ["g0"], **VLLM}, {"model": "b", "gpus": ["g0"], **VLLM}]
    problem, plan = plan_for(
        scenario(
            [{**node("n0", gpu("g0", 26)), "engines": engines}],
            [model("a", 16), model("b", 4)],
            [
                session("s1", "a", active=True),
                session("s2", "a", tokens=6 * 8192),
                session("s3", "b", active=True, slo="background"),
            ],
            [
                held(weights("a"), on_gpu("g0"), 16 * GIB),
                held(kv("a", "s1"), on_gpu("g0"), GIB),
                held(kv("a", "s2"), on_gpu("g0"), 6 * GIB),
                held(weights("a"), on_nvme("n0"), 16 * GIB),
                held(weights("b"), on_nvme("n0"), 4 * GIB),
            ],
        )
    )
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    s2 = next(obj for obj, _ in problem.residency if obj.session == "s2")
    assert plan.placement.get((s2, next(loc for obj, loc in problem.residency if obj == s2))) == 6 * GIB
    assert "s3" in plan.unserved


def test_a_running_moe_engine_s_experts_beside_its_group_keep_their_room() -> None:
    """m runs on g1 and was launched with 4 GiB of its experts on g0, beside d's engine, which fills the rest of
    g0 with its weights, s1's pool and its CUDA context: s2, d's new request, is served first (interactive before background)
    and finds no room beside that pool, since m's experts stay as launched while m runs as it is: it is served
    in d's pool, whose LRU evicts idle s1's KV for it."""
    engines = [{"model": "d", **VLLM}, {"model": "m", **VLLM}]
    problem = problem_from_scenario(
        parse_scenario(
            scenario(
                [{**node("n0", gpu("g0", 25), gpu("g1", 32)), "engines": engines}],
                [model("d", 16), model("m", 4, experts_bytes=64 * GIB, expert_bytes=GIB // 4)],
                [
                    session("s1", "d", tokens=4 * 8192),
                    session("s2", "d", active=True),
                    session("s3", "m", active=True, slo="background"),
                ],
                [
                    held(weights("d"), on_gpu("g0"), 16 * GIB),
                    held(kv("d", "s1"), on_gpu("g0"), 4 * GIB),
                    held(experts("m"), on_gpu("g0"), 4 * GIB),  # 24 GiB and d's context: g0 is full
                    held(weights("m"), on_gpu("g1"), 4 * GIB),
                    held(experts("m"), on_gpu("g1"), 24 * GIB),
                    held(kv("m", "s3"), on_gpu("g1"), GIB),
                    held(weights("d"), on_nvme("n0"), 16 * GIB),
                    held(weights("m"), on_nvme("n0"), 4 * GIB),
                    held(experts("m"), on_nvme("n0"), 64 * GIB),
                ],
            )
        )
    )
    kept = {"nodes": {"d": "n0", "m": "n0"}, "precisions": {"d": "bf16", "m": "bf16"}}  # both served a moment ago
    for options in (kept, {}):
        plan = solve(problem, "greedy", **options)
        assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
        on_g0 = {(obj.model, obj.kind.value): n for (obj, loc), n in plan.placement.items() if loc.id == "g0"}
        assert on_g0[("m", "experts")] == 4 * GIB
        assert "s2" not in plan.unserved
        assert plan.placement[(StateObject.kv("d", "s2"), Location.gpu("g0"))] == GIB
        assert plan.placement[(StateObject.kv("d", "s1"), Location.gpu("g0"))] == 3 * GIB
