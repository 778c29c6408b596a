"""The planning loop: replan after event bursts (debounced) and periodically, off the event loop."""

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
        self._service.dirty.set()  # wake the thread
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        last_plan = time.monotonic()
        while not self._stop.is_set():
            triggered = self._service.dirty.wait(timeout=TICK_SECONDS)
            if self._stop.is_set():
                return
            self._service.tick()
            due = time.monotonic() - last_plan >= self._interval
            if not (triggered or due):
                continue
            if triggered and self._stop.wait(self._debounce):  # let the burst finish
                return
            try:
                result = self._service.replan()
            except ServiceError as error:
                log.warning("replan skipped: %s", error.message)
                self._service.dirty.clear()
            except Exception:  # the loop must outlive one bad plan; the error is logged with its traceback
                log.exception("replan failed")
                self._service.dirty.clear()
            else:
                log.debug("replan: %s", result)
            last_plan = time.monotonic()
