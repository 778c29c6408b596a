"""The invariant checker speaks the engine model: on a node whose engine declares vLLM or SGLang, it refuses
the run-time moves those engines cannot make (a session's KV moved or freed, a MoE's GPU expert share
changed while it runs, a running engine's precision changed); undeclared and `local` engines keep every move.
"""

from __future__ import annotations

from typing import Any

import pytest
from tiny_clusters import experts, gpu, held, kv, model, node, on_gpu, on_nvme, scenario, session, weights

from planner_service.domain.engines import DeclaredEngine, EngineFeature, EngineKind, Management, Transition
from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.problem import Problem
from planner_service.domain.scenario import ScenarioError, parse_scenario
from planner_service.domain.state import Location, StateObject
from planner_service.domain.units import GIB
from planner_service.planner.engine_plan import attach_derived_steps
from planner_service.planner.invariants import check_plan
from planner_service.planner.operations import Action, Operation, apply_operations, build_operations

G0, HOST, NVME = Location.gpu("g0"), Location.host("n0"), Location.nvme("n0")
A16, A8 = StateObject.weights("a", "bf16"), StateObject.weights("a", "fp8")
KV = StateObject.kv("a", "s1")
MOE = StateObject.weights("moe", "bf16")
MOE_EXPERTS = StateObject.experts("moe")

# the kinds a test runs under: None (undeclared) and local keep every move, vLLM and SGLang refuse
REFUSING = [("vllm", ["sleep_mode", "dev_mode", "lmcache"]), ("sglang", ["sleep_mode", "cpu_backup"])]


def problem_for(models: list[dict[str, Any]], residency: list[dict[str, Any]], engine: dict[str, Any]) -> Problem:
    """One 24 GiB card on node n0, whose one engine serves the first model; `engine` adds kind and features."""
    n0 = {**node("n0", gpu("g0", 24)), "engines": [{"model": models[0]["id"], "gpus": ["g0"], **engine}]}
    data = scenario([n0], models, [session("s1", models[0]["id"], tokens=8192)], residency)
    return problem_from_scenario(parse_scenario(data))


def kind(name: str | None, features: list[str] | None = None) -> dict[str, Any]:
    if name is None:
        return {}
    return {"kind": name, **({"features": features} if features else {})}


def ops_to(problem: Problem, target: dict[tuple[StateObject, Location], int]) -> list[Operation]:
    ops = build_operations(problem, target)
    attach_derived_steps(problem, ops, target)
    assert apply_operations(problem.residency, ops) == target
    return ops


def engine_errors(problem: Problem, target: dict[tuple[StateObject, Location], int]) -> list[str]:
    return [e for e in check_plan(problem, target, ops_to(problem, target)) if e.startswith("engine:")]


# --- a session's KV -----------------------------------------------------------------------------------


def kv_problem(engine: dict[str, Any]) -> Problem:
    return problem_for(
        [model("a", 8)],
        [
            held(weights("a"), on_gpu("g0"), 8 * GIB),
            held(weights("a"), on_nvme("n0"), 8 * GIB),
            held(kv("a", "s1"), on_gpu("g0"), GIB),
        ],
        engine,
    )


KV_OFFLOADED = {(A16, G0): 8 * GIB, (A16, NVME): 8 * GIB, (KV, HOST): GIB}
KV_FREED = {(A16, G0): 8 * GIB, (A16, NVME): 8 * GIB}


@pytest.mark.parametrize(("name", "features"), REFUSING)
def test_a_session_s_kv_is_not_moved_on_a_vllm_or_sglang_node(name: str, features: list[str]) -> None:
    problem = kv_problem(kind(name, features))
    (op,) = ops_to(problem, KV_OFFLOADED)
    assert (op.action, op.source, op.dest) == (Action.DEMOTE, G0, HOST)
    (error,) = engine_errors(problem, KV_OFFLOADED)
    assert f"moves kv(a, s1) from gpu:g0 to host:n0 on node n0, whose {name} engine for a cannot" in error


@pytest.mark.parametrize(("name", "features"), REFUSING)
def test_a_session_s_kv_is_not_freed_on_a_vllm_or_sglang_node(name: str, features: list[str]) -> None:
    problem = kv_problem(kind(name, features))
    (op,) = ops_to(problem, KV_FREED)
    assert (op.action, op.source, op.dest) == (Action.DROP, G0, None)
    (error,) = engine_errors(problem, KV_FREED)
    assert "frees kv(a, s1) at gpu:g0" in error and "one request's KV" in error


def test_a_session_s_kv_is_prefilled_once_the_engine_it_needs_is_up() -> None:
    """The engine computes the KV: a prefill that ran before the start did nothing, and the service, told the
    engine is stopped, took the KV out of the confirmed state and planned it again on every replan."""
    problem = problem_for([model("a", 8)], [held(weights("a"), on_nvme("n0"), 8 * GIB)], kind("vllm"))
    target = {(A16, G0): 8 * GIB, (A16, NVME): 8 * GIB, (KV, G0): GIB}
    start, prefill = ops_to(problem, target)
    assert (start.object, start.engine and start.engine.transition) == (A16, Transition.START)
    assert (prefill.object, prefill.source, prefill.depends_on) == (KV, None, [start.id])


def test_prefilling_a_session_s_kv_is_the_engine_serving_it() -> None:
    problem = problem_for([model("a", 8)], [held(weights("a"), on_gpu("g0"), 8 * GIB)], kind("vllm"))
    target = {(A16, G0): 8 * GIB, (KV, G0): GIB}
    (op,) = ops_to(problem, target)
    assert op.source is None
    assert check_plan(problem, target, [op]) == []


@pytest.mark.parametrize("name", [None, "local"])
def test_undeclared_and_local_engines_move_and_free_kv(name: str | None) -> None:
    for target in (KV_OFFLOADED, KV_FREED):
        problem = kv_problem(kind(name))
        assert check_plan(problem, target, ops_to(problem, target)) == []


def test_an_engine_node_that_registers_no_capability_sleeps_its_engine_to_host_ram() -> None:
    """A vLLM node agent registers no capability (its executor makes none of the `local` executor's partial
    moves); its engine's level-1 sleep still takes the weights to host RAM, as the engine model says, and a
    node without the engine still may not."""
    residency = [held(weights("a"), on_gpu("g0"), 8 * GIB), held(weights("a"), on_nvme("n0"), 8 * GIB)]
    asleep = {(A16, HOST): 8 * GIB, (A16, NVME): 8 * GIB}
    for engine, refused in ((kind("vllm", ["sleep_mode", "dev_mode"]), False), (kind(None), True)):
        n0 = {**node("n0", gpu("g0", 24), capabilities=[]), "engines": [{"model": "a", "gpus": ["g0"], **engine}]}
        data = scenario([n0], [model("a", 8)], [session("s1", "a", tokens=8192, active=False)], residency)
        problem = problem_from_scenario(parse_scenario(data))
        ops = ops_to(problem, asleep)
        assert [(op.action, op.dest) for op in ops] == [(Action.DEMOTE, HOST)]
        assert (ops[0].engine is not None) is not refused
        errors = check_plan(problem, asleep, ops)
        assert bool(errors) is refused and all("through host DRAM" in e for e in errors), errors


# --- a MoE's GPU expert share -----------------------------------------------------------------------------


def moe_problem(engine: dict[str, Any]) -> Problem:
    # 4 GiB of non-expert weights and 4 of its 16 GiB of routed experts on the card; all of it on NVMe
    moe = model("moe", 4, experts_bytes=16 * GIB, expert_bytes=GIB // 4, active_expert_bytes_per_token=GIB // 8)
    return problem_for(
        [moe],
        [
            held(weights("moe"), on_gpu("g0"), 4 * GIB),
            held(weights("moe"), on_nvme("n0"), 4 * GIB),
            held(experts("moe"), on_gpu("g0"), 4 * GIB),
            held(experts("moe"), on_nvme("n0"), 16 * GIB),
        ],
        engine,
    )


def moe_target(experts_on_gpu: int) -> dict[tuple[StateObject, Location], int]:
    return {(MOE, G0): 4 * GIB, (MOE, NVME): 4 * GIB, (MOE_EXPERTS, G0): experts_on_gpu, (MOE_EXPERTS, NVME): 16 * GIB}


@pytest.mark.parametrize(("name", "features"), REFUSING)
@pytest.mark.parametrize(("experts_on_gpu", "change"), [(8 * GIB, "adds"), (2 * GIB, "removes")])
def test_a_running_moe_s_gpu_expert_share_is_not_changed_on_a_vllm_or_sglang_node(
    name: str, features: list[str], experts_on_gpu: int, change: str
) -> None:
    problem = moe_problem(kind(name, features))
    target = moe_target(experts_on_gpu)
    (op,) = ops_to(problem, target)
    assert op.object == MOE_EXPERTS
    (error,) = engine_errors(problem, target)
    assert (
        f"{change} {abs(experts_on_gpu - 4 * GIB)} bytes of experts(moe) on GPU while the model runs at bf16" in error
    )
    assert "launch setting" in error


def test_experts_leave_the_gpu_with_the_engine_that_stops() -> None:
    """Not a run-time change: the weights leave too, so the engine does not run on at another share."""
    problem = moe_problem(kind("vllm", ["sleep_mode", "dev_mode"]))
    target = {(MOE, NVME): 4 * GIB, (MOE_EXPERTS, NVME): 16 * GIB}
    assert engine_errors(problem, target) == []


@pytest.mark.parametrize("name", [None, "local"])
def test_undeclared_and_local_engines_change_expert_shares_at_run_time(name: str | None) -> None:
    problem = moe_problem(kind(name))
    target = moe_target(8 * GIB)
    assert check_plan(problem, target, ops_to(problem, target)) == []


# --- a running engine's precision -------------------------------------------------------------------------


def precision_problem(engine: dict[str, Any]) -> Problem:
    return problem_for(
        [model("a", {"bf16": 16, "fp8": 8})],
        [
            held(weights("a", "bf16"), on_gpu("g0"), 16 * GIB),
            held(weights("a", "bf16"), on_nvme("n0"), 16 * GIB),
            held(weights("a", "fp8"), on_nvme("n0"), 8 * GIB),
        ],
        engine,
    )


SWITCHED = {(A16, NVME): 16 * GIB, (A8, NVME): 8 * GIB, (A8, G0): 8 * GIB}


@pytest.mark.parametrize(("name", "features"), REFUSING)
def test_a_running_engine_s_precision_is_not_changed_on_a_vllm_or_sglang_node(name: str, features: list[str]) -> None:
    problem = precision_problem(kind(name, features))
    ops = build_operations(problem, SWITCHED)  # the bytes moves alone, no engine step
    assert {(op.action, op.object) for op in ops} == {(Action.DROP, A16), (Action.PROMOTE, A8)}
    unstepped, refused = sorted(e for e in check_plan(problem, SWITCHED, ops) if e.startswith("engine:"))
    assert f"brings weights(a, fp8) to the GPUs while the model runs at bf16 on node n0, whose {name} engine" in refused
    assert "moves weights(a, bf16) on the GPUs of node n0 with no engine step" in unstepped


@pytest.mark.parametrize(("name", "features"), REFUSING)
def test_a_precision_switch_on_a_vllm_or_sglang_node_is_a_restart(name: str, features: list[str]) -> None:
    problem = precision_problem(kind(name, features))
    ops = ops_to(problem, SWITCHED)
    steps = {
        (op.engine.transition, op.engine.instance.precision, op.engine.previous.precision) for op in ops if op.engine
    }
    assert steps == {(Transition.RESTART, "fp8", "bf16")}
    assert engine_errors(problem, SWITCHED) == []


def test_an_engine_that_is_not_running_loads_any_precision() -> None:
    problem = problem_for(
        [model("a", {"bf16": 16, "fp8": 8})],
        [held(weights("a", "bf16"), on_nvme("n0"), 16 * GIB), held(weights("a", "fp8"), on_nvme("n0"), 8 * GIB)],
        kind("vllm"),
    )
    target = {(A16, NVME): 16 * GIB, (A8, NVME): 8 * GIB, (A8, G0): 8 * GIB}
    assert check_plan(problem, target, ops_to(problem, target)) == []


@pytest.mark.parametrize("name", [None, "local"])
def test_undeclared_and_local_engines_change_precision_at_run_time(name: str | None) -> None:
    problem = precision_problem(kind(name))
    assert check_plan(problem, SWITCHED, ops_to(problem, SWITCHED)) == []


# --- the scenario declares kinds, and the problem carries them ----------------------------------------------


def test_declared_kinds_features_and_management_compile_into_the_node() -> None:
    problem = problem_for(
        [model("a", 8)], [], {"kind": "sglang", "features": ["sleep_mode", "cpu_backup"], "management": "adopted"}
    )
    n0 = problem.nodes["n0"]
    assert n0.declared_engines["a"] == DeclaredEngine(
        EngineKind.SGLANG, frozenset({EngineFeature.SLEEP_MODE, EngineFeature.CPU_BACKUP}), Management.ADOPTED
    )
    assert n0.engine_kind("a") is EngineKind.SGLANG and n0.engine_kind("b") is None
    assert problem_for([model("a", 8)], [], {}).nodes["n0"].declared_engines == {}


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"kind": "lmcache"}, "LMCache is a feature of a vllm engine"),
        ({"kind": "other"}, "'other' is no engine kind"),
        ({"kind": "vllm", "features": ["cpu_backup"]}, "a vllm engine has no cpu_backup"),
        ({"kind": "sglang", "features": ["lmcache", "dev_mode"]}, "a sglang engine has no lmcache, dev_mode"),
        ({"kind": "vllm", "features": ["sleep_mode", "sleep_mode"]}, "duplicate feature 'sleep_mode'"),
        ({"features": ["sleep_mode"]}, "give 'kind' too"),
        ({"management": "adopted"}, "give 'kind' too"),
    ],
)
def test_a_scenario_declares_only_engines_the_model_describes(engine: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        problem_for([model("a", 8)], [], engine)
