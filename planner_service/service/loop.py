"""The planning loop, off the event loop: replan at once (debounced) when a request waits for a model served
nowhere or the plan broke (the service's `urgent`), and otherwise every `interval_seconds`, so that
changes the engines absorb on their own (turns on warm models, reports) do not reshuffle the cluster.

Wakes are throttled on the leading edge: a wake after a quiet `debounce_seconds` plans at once (the first
request of a burst waits for no timer: the gateway's control path, docs/benchmarks/control-path.md), and the
wakes within `debounce_seconds` of a replan make one more when that window ends, so a burst costs at most two
replans; a wake for models that the current plan already brings makes none (`Planning.covers_waiting`). The
simulator's `statebudget` policy throttles the same way (planner/online.py)."""

from __future__ import annotations

import logging
import threading
import time

from planner_service.service.engine import ClusterService
from planner_service.service.errors import ServiceError

log = logging.getLogger(__name__)

TICK_SECONDS = 0.5  # how often leases are checked for expiry


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

    def _run(self) -> None:
        last_plan = time.monotonic()
        while not self._stop.is_set():
            triggered = self._service.urgent.wait(timeout=TICK_SECONDS)
            if self._stop.is_set():
                return
            self._service.tick()
            triggered = triggered or self._service.urgent.is_set()  # (tick may have found the plan broken)
            due = time.monotonic() - last_plan >= self._interval
            if not (triggered or due):
                continue
            since = time.monotonic() - last_plan
            if triggered and since < self._debounce and self._stop.wait(self._debounce - since):
                return  # within a replan's window: the rest of the burst is planned once it ends
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
