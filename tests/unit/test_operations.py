"""Operations from hand-written targets: the action, source and dependencies each case needs."""

from __future__ import annotations

from tiny_clusters import gpu, held, kv, model, node, on_gpu, on_host, on_nvme, scenario, session, weights

from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.scenario import parse_scenario
from planner_service.domain.state import Location, StateObject
from planner_service.domain.units import GIB
from planner_service.planner.invariants import check_plan
from planner_service.planner.operations import Action, apply_operations, build_operations

A = StateObject.weights("a", "bf16")
B = StateObject.weights("b", "bf16")
G0, HOST, NVME = Location.gpu("g0"), Location.host("n0"), Location.nvme("n0")


def problem_with(*residency):
    # one 10 GiB card; "a" and "b" are 8 GiB each, so they never share it
    data = scenario(
        [node("n0", gpu("g0", 10))], [model("a", 8), model("b", 8)], [session("s1", "a", tokens=8192)], list(residency)
    )
    return problem_from_scenario(parse_scenario(data))


def ops_to(problem, target):
    ops = build_operations(problem, target)
    assert apply_operations(problem.residency, ops) == target
    assert check_plan(problem, target, ops) == []
    return ops


def test_promote_from_host_keeps_the_source() -> None:
    problem = problem_with(held(weights("a"), on_host("n0"), 8 * GIB))
    (op,) = ops_to(problem, {(A, HOST): 8 * GIB, (A, G0): 8 * GIB})
    assert (op.action, op.source, op.dest, op.bytes, op.keep_source) == (Action.PROMOTE, HOST, G0, 8 * GIB, True)
    assert op.estimated_seconds > 0 and op.reason


def test_promote_reads_host_before_nvme() -> None:
    problem = problem_with(held(weights("a"), on_host("n0"), 8 * GIB), held(weights("a"), on_nvme("n0"), 8 * GIB))
    (op,) = ops_to(problem, {(A, HOST): 8 * GIB, (A, NVME): 8 * GIB, (A, G0): 8 * GIB})
    assert op.source == HOST


def test_demote_moves_the_last_copy_down() -> None:
    problem = problem_with(held(weights("a"), on_gpu("g0"), 8 * GIB))
    (op,) = ops_to(problem, {(A, HOST): 8 * GIB})
    assert (op.action, op.source, op.dest, op.keep_source) == (Action.DEMOTE, G0, HOST, False)


def test_gpu_copy_is_dropped_when_nvme_has_one() -> None:
    problem = problem_with(held(weights("a"), on_gpu("g0"), 8 * GIB), held(weights("a"), on_nvme("n0"), 8 * GIB))
    (op,) = ops_to(problem, {(A, NVME): 8 * GIB})
    assert (op.action, op.source, op.dest) == (Action.DROP, G0, None)


def test_a_full_gpu_is_freed_before_it_is_filled() -> None:
    problem = problem_with(
        held(weights("a"), on_gpu("g0"), 8 * GIB),
        held(weights("a"), on_nvme("n0"), 8 * GIB),
        held(weights("b"), on_nvme("n0"), 8 * GIB),
    )
    drop, load = ops_to(problem, {(A, NVME): 8 * GIB, (B, NVME): 8 * GIB, (B, G0): 8 * GIB})
    assert (drop.action, drop.object, load.action, load.object) == (Action.DROP, A, Action.PROMOTE, B)
    assert load.depends_on == [drop.id]


def test_a_drop_waits_for_the_copy_it_relies_on() -> None:
    # "a" moves GPU -> host while its NVMe copy is dropped: the drop must wait until host holds it
    problem = problem_with(held(weights("a"), on_gpu("g0"), 8 * GIB), held(weights("a"), on_nvme("n0"), 8 * GIB))
    ops = ops_to(problem, {(A, HOST): 8 * GIB})
    demote = next(op for op in ops if op.action is Action.DEMOTE)
    drop = next(op for op in ops if op.action is Action.DROP)
    assert demote.dest == HOST and drop.source in (G0, NVME)
    assert demote.id in drop.depends_on


def test_kv_is_prefilled_from_nothing() -> None:
    problem = problem_with(held(weights("a"), on_gpu("g0"), 8 * GIB))
    kv = StateObject.kv("a", "s1")
    (op,) = ops_to(problem, {(A, G0): 8 * GIB, (kv, G0): GIB})
    assert (op.action, op.source, op.dest, op.bytes) == (Action.PROMOTE, None, G0, GIB)
    assert "prefill" in op.reason


def test_ids_are_renumbered_in_topological_order() -> None:
    problem = problem_with(
        held(weights("a"), on_gpu("g0"), 8 * GIB),
        held(weights("a"), on_nvme("n0"), 8 * GIB),
        held(weights("b"), on_nvme("n0"), 8 * GIB),
    )
    ops = ops_to(problem, {(A, NVME): 8 * GIB, (B, NVME): 8 * GIB, (B, G0): 8 * GIB})
    assert [op.id for op in ops] == ["op-1", "op-2"]
    assert ops[1].to_json()["depends_on"] == ["op-1"]


def test_kv_is_prefilled_not_restored_where_the_node_cannot_offload_kv() -> None:
    data = scenario(
        [node("n0", gpu("g0", 10), capabilities=["weights_offload"])],
        [model("a", 8)],
        [session("s1", "a", tokens=8192)],
        [held(weights("a"), on_gpu("g0"), 8 * GIB), held(kv("a", "s1"), on_host("n0"), GIB)],
    )
    problem = problem_from_scenario(parse_scenario(data))
    kv_obj = StateObject.kv("a", "s1")
    (op,) = ops_to(problem, {(A, G0): 8 * GIB, (kv_obj, HOST): GIB, (kv_obj, G0): GIB})
    assert (op.action, op.source, op.dest) == (Action.PROMOTE, None, G0)
