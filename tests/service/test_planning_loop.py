"""The planning loop's pacing: woken replans wait for the debounce, and for their own cost when they are slow."""

from __future__ import annotations

import threading
import time
from typing import Any, cast

from planner_service.service.engine import ClusterService
from planner_service.service.loop import URGENT_DUTY, PlanningLoop


class SlowService:
    """What the loop calls, with a replan that takes `replan_seconds` and new requests that keep waking it."""

    def __init__(self, replan_seconds: float, replans: int) -> None:
        self.urgent = threading.Event()
        self.replan_seconds = replan_seconds
        self.spans: list[tuple[float, float]] = []  # (start, end) of each replan
        self.done = threading.Event()
        self._replans = replans
        self.planning = self

    def tick(self) -> None:
        pass

    def covers_waiting(self) -> bool:
        return False

    def replan(self) -> dict[str, Any]:
        started = time.monotonic()
        time.sleep(self.replan_seconds)
        self.urgent.set()  # requests for models served nowhere kept coming while it planned
        self.spans.append((started, time.monotonic()))
        if len(self.spans) == self._replans:
            self.done.set()
        return {"epoch": len(self.spans), "changed": True}


def run_loop(service: SlowService, debounce_seconds: float) -> list[float]:
    """The quiet time before each woken replan after the first."""
    loop = PlanningLoop(cast(ClusterService, service), debounce_seconds=debounce_seconds, interval_seconds=3600)
    service.urgent.set()
    loop.start()
    try:
        assert service.done.wait(timeout=60)
    finally:
        loop.stop()
    return [start - end for (_, end), (start, _) in zip(service.spans, service.spans[1:], strict=False)]


def test_slow_woken_replans_take_at_most_their_share_of_the_service() -> None:
    service = SlowService(replan_seconds=0.15, replans=4)
    quiet = run_loop(service, debounce_seconds=0.01)
    took = [end - start for start, end in service.spans]
    assert len(quiet) == 3
    for before, gap in zip(took, quiet, strict=False):  # waits only ever run long, never short
        assert gap >= before * (1 / URGENT_DUTY - 1) - 0.01


def test_fast_woken_replans_wait_for_the_debounce_alone() -> None:
    loop = PlanningLoop(cast(ClusterService, SlowService(0, 0)), debounce_seconds=0.2, interval_seconds=3600)
    assert loop.quiet_seconds(0.04) == 0.2  # a quiet machine's replan: the control path keeps its debounce
    assert loop.quiet_seconds(0.5) == 0.5 * (1 / URGENT_DUTY - 1)
