"""The engines a replan plans from are in the states the engine steps in flight leave them (`land_engines`),
beside the placement those steps land: a heartbeat still reports a woken engine asleep until it is done, and a
plan from the two mixed stepped an engine from a state it was not in."""

from __future__ import annotations

from planner_service.domain.state import Location, StateObject
from planner_service.planner.operations import Action, Operation
from planner_service.service.landing import LandedEngines, land_engines
from planner_service.service.records import OpRecord
from planner_service.wire.enums import EngineKind, EngineState, Transition
from planner_service.wire.operations import EngineInstanceRef, EngineStep

GIB = 1 << 30
KEY = ("n0", "m")


def step_op(transition: Transition, action: Action, dest: Location | None, pool: int = 2 * GIB) -> OpRecord:
    instance = EngineInstanceRef(
        id="m@bf16@g0+g1",
        node="n0",
        kind=EngineKind.VLLM,
        model="m",
        precision="bf16",
        gpus=["g0", "g1"],
        kv_pool_bytes_per_gpu=pool,
        gpu_expert_fraction=0.25,
    )
    source = Location.gpu("g0") if action is not Action.PROMOTE else Location.nvme("n0")
    op = Operation("1.op-1", action, StateObject.weights("m", "bf16"), source, dest, GIB, False, node="n0")
    op.engine = EngineStep(transition=transition, instance=instance, from_state=EngineState.RUNNING)
    return OpRecord(op, 1, 0)


REPORTED_ASLEEP = LandedEngines({KEY: (EngineState.ASLEEP_HOST, ("g0", "g1"))}, {KEY: 0.25}, {KEY: GIB})
REPORTED_RUNNING = LandedEngines({}, {}, {KEY: GIB})


def test_a_wake_in_flight_lands_a_running_engine_with_its_pool() -> None:
    landed = land_engines(REPORTED_ASLEEP, [step_op(Transition.WAKE, Action.PROMOTE, Location.gpu("g0"))])
    assert landed == LandedEngines({}, {}, {KEY: 2 * GIB})


def test_a_sleep_in_flight_lands_an_asleep_engine_on_its_group() -> None:
    level_2 = land_engines(REPORTED_RUNNING, [step_op(Transition.SLEEP_LEVEL_2, Action.DROP, None)])
    assert level_2.observed == {KEY: (EngineState.ASLEEP_DISCARDED, ("g0", "g1"))}
    assert level_2.expert_fractions == {KEY: 0.25}
    level_1 = land_engines(REPORTED_RUNNING, [step_op(Transition.SLEEP_LEVEL_1, Action.DEMOTE, Location.host("n0"))])
    assert level_1.observed == {KEY: (EngineState.ASLEEP_HOST, ("g0", "g1"))}


def test_a_stop_in_flight_lands_no_engine() -> None:
    assert land_engines(REPORTED_ASLEEP, [step_op(Transition.STOP, Action.DROP, None)]) == LandedEngines({}, {}, {})


def test_moves_without_a_step_leave_the_engines_as_reported() -> None:
    record = step_op(Transition.WAKE, Action.PROMOTE, Location.gpu("g0"))
    record.op.engine = None
    assert land_engines(REPORTED_ASLEEP, [record]) == REPORTED_ASLEEP
