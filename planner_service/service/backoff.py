"""Moves that failed wait before a plan asks for them again.

A node reports an operation `failed` when its engine cannot carry it out, or
not now. The next plan usually asks for the same move again: without a
pause, each failure would install a new epoch that queues it again, as fast
as the agent polls. So each move (action, object, from, to) that failed
waits `base_seconds * 2**(failures - 1)` seconds, at most `max_seconds`,
before a plan may queue it again, and a success forgets its failures. A plan
holds back such moves and every operation that depends on them; what it
holds back is in the plan's `held_back`. The failures are soft state: a
restarted service tries each move once more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from planner_service.domain.state import Location, StateObject
from planner_service.planner.operations import Action, Operation

Move = tuple[Action, StateObject, Location | None, Location | None]


def move_of(op: Operation) -> Move:
    return (op.action, op.object, op.source, op.dest)


@dataclass(frozen=True, slots=True)
class Failures:
    count: int
    until: float  # when a plan may ask for the move again
    error: str | None  # what the node said the last time


@dataclass
class FailedMoves:
    base_seconds: float = 30.0
    max_seconds: float = 3600.0
    _failures: dict[Move, Failures] = field(default_factory=dict)

    def failed(self, op: Operation, now: float, error: str | None) -> Failures:
        before = self._failures.get(move_of(op))
        count = before.count + 1 if before else 1
        wait = min(self.max_seconds, self.base_seconds * 2 ** (count - 1))
        self._failures[move_of(op)] = failures = Failures(count, now + wait, error)
        return failures

    def succeeded(self, op: Operation) -> None:
        self._failures.pop(move_of(op), None)

    def hold_back(self, ops: Sequence[Operation], now: float) -> dict[str, Failures]:
        """The operations (by id) a plan must not queue yet: moves still waiting after a failure, and every
        operation that depends on one of them (`ops` in dependency order, as plans list them), with the
        failures that hold each back."""
        held: dict[str, Failures] = {}
        for op in ops:
            failures = self._failures.get(move_of(op))
            if failures is not None and failures.until > now:
                held[op.id] = failures
                continue
            blocking = [held[d] for d in op.depends_on if d in held]
            if blocking:
                held[op.id] = max(blocking, key=lambda f: f.until)
        return held
