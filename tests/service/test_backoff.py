"""Failed moves wait, doubling, before a plan queues them again; their dependents wait with them."""

from __future__ import annotations

from planner_service.domain.state import Location, StateObject
from planner_service.planner.operations import Action, Operation
from planner_service.service.backoff import FailedMoves


def op(op_id: str, model: str, *depends_on: str) -> Operation:
    return Operation(
        op_id,
        Action.PROMOTE,
        StateObject.weights(model, "bf16"),
        Location.host("n1"),
        Location.gpu("g0"),
        bytes=1,
        keep_source=True,
        depends_on=list(depends_on),
        node="n1",
    )


def test_the_wait_doubles_up_to_its_cap_and_a_success_forgets_it() -> None:
    moves = FailedMoves(base_seconds=30, max_seconds=100)
    waits = [moves.failed(op("a", "m"), 1000.0, "busy").until - 1000.0 for _ in range(4)]
    assert waits == [30, 60, 100, 100]
    moves.succeeded(op("b", "m"))  # the same move under another plan's id
    assert moves.hold_back([op("c", "m")], 1000.0) == {}


def test_a_plan_holds_back_a_waiting_move_and_what_depends_on_it_until_the_wait_is_over() -> None:
    moves = FailedMoves(base_seconds=30)
    failures = moves.failed(op("old", "m"), 0.0, "engine refused")
    plan = [op("1", "m"), op("2", "other", "1"), op("3", "third", "2"), op("4", "fourth")]
    assert moves.hold_back(plan, 10.0) == {"1": failures, "2": failures, "3": failures}
    assert moves.hold_back(plan, 30.0) == {}
