"""The planning loop, off the event loop: replan at once (throttled) when a request waits for a model served
nowhere or the plan broke (the service's `urgent`), and otherwise every `interval_seconds`, so that
changes the engines absorb on their own (turns on warm models, reports) do not reshuffle the cluster.

Wakes are throttled on the leading edge: a wake after a quiet window plans at once (the first request of a
burst waits for no timer: the gateway's control path, docs/benchmarks/control-path.md), and the wakes within
the window after a replan make one more when it ends, so a burst costs at most two replans; a wake for models
that the current plan already brings makes none (`Planning.covers_waiting`). The simulator's `statebudget`
policy throttles the same way (planner/online.py).

The window is `debounce_seconds`, or longer when replans are slow. Under load every new session that asks for
a model served nowhere wakes the loop, and a replan's snapshot and install hold the state lock that events,
leases and reports wait for, so woken replans are also spaced by their own cost: after one that took `d`
seconds the window is at least `d * (1 / URGENT_DUTY - 1)`. On a quiet machine a replan takes tens of
milliseconds and the debounce rules; when replans slow down because the service is busy, they take at most a
third of its time."""

from __future__ import annotations

import logging
import threading
import time

from planner_service.service.engine import ClusterService
from planner_service.service.errors import ServiceError

log = logging.getLogger(__name__)

TICK_SECONDS = 0.5  # how often leases are checked for expiry
URGENT_DUTY = 1 / 3  # of the wall time, at most, that woken replans take back to back


class PlanningLoop:
    def __init__(self, service: ClusterService, *, debounce_seconds: float, interval_seconds: float) -> None:
        self._service = service
        self._debounce = debounce_seconds
        self._interval = interval_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="statebudget-planner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._service.urgent.set()  # wake the thread
        if self._thread is not None:
            self._thread.join(timeout=10)

    def quiet_seconds(self, replan_seconds: float) -> float:
        """How long a woken replan waits after the last replan, which took `replan_seconds`."""
        return max(self._debounce, replan_seconds * (1 / URGENT_DUTY - 1))

    def _run(self) -> None:
        last_plan = time.monotonic()
        last_took = 0.0  # wall seconds of the last replan
        while not self._stop.is_set():
            triggered = self._service.urgent.wait(timeout=TICK_SECONDS)
            if self._stop.is_set():
                return
            self._service.tick()
            triggered = triggered or self._service.urgent.is_set()  # (tick may have found the plan broken)
            due = time.monotonic() - last_plan >= self._interval
            if not (triggered or due):
                continue
            # within the window after the last replan: the rest of the burst is planned when it ends
            wait = last_plan + self.quiet_seconds(last_took) - time.monotonic()
            if triggered and wait > 0 and self._stop.wait(wait):
                return
            started = time.monotonic()
            try:
                if not due:  # woken by requests for models served nowhere, or a broken plan
                    self._service.urgent.clear()  # before looking: a request after it wakes the loop again
                    if self._service.planning.covers_waiting():
                        continue  # the current plan brings them: no replan, and the periodic one keeps its time
                result = self._service.replan()
            except ServiceError as error:
                log.warning("replan skipped: %s", error.message)
                self._service.urgent.clear()
            except Exception:  # the loop must outlive one bad plan; the error is logged with its traceback
                log.exception("replan failed")
                self._service.urgent.clear()
            else:
                log.debug("replan: %s", result)
            last_plan = time.monotonic()
            last_took = last_plan - started
