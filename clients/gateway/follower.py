"""Keeps the gateway's route table current by long-polling the planner; keeps the last one when it is down."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from clients.gateway.metrics import GatewayMetrics
from clients.gateway.table import RouteTable
from clients.sdk import AsyncStateBudgetClient, StateBudgetError
from planner_service.wire.routes import RoutesOut

log = logging.getLogger(__name__)


class RouteFollower:
    def __init__(
        self,
        planner: AsyncStateBudgetClient,
        metrics: GatewayMetrics,
        *,
        wait_seconds: float,
        retry_seconds: float,
    ) -> None:
        self.planner = planner
        self.metrics = metrics
        self.wait_seconds = wait_seconds
        self.retry_seconds = retry_seconds
        self.table = RouteTable.empty()
        self.planner_reachable = False
        self.last_error: str | None = None
        self.last_fetch_at: float | None = None
        self.fetches = 0  # answered fetches, so a test can tell a change arrived within one
        self._changed = asyncio.Condition()
        self.listeners: list[Callable[[RouteTable], None]] = []  # called with each new table, on the loop

    async def fetch_once(self, *, wait: bool) -> None:
        """One fetch; a long-poll on the current epoch and revision when `wait`."""
        routes: RoutesOut = await self.planner.get_routes(
            after_epoch=self.table.epoch if wait else None,
            after_revision=self.table.revision if wait else None,
            wait_seconds=self.wait_seconds if wait else 0.0,
        )
        self.last_fetch_at = time.time()
        self.fetches += 1
        if not self.planner_reachable:
            log.info("planner reachable; route table at epoch %d", routes.epoch)
        self.planner_reachable = True
        self.last_error = None
        self.metrics.planner_reachable.set(1)
        if routes.revision != self.table.revision or routes.epoch != self.table.epoch:
            self.table = RouteTable(routes)
            self.metrics.route_epoch.set(routes.epoch)
            for listener in self.listeners:
                listener(self.table)
            async with self._changed:
                self._changed.notify_all()

    async def run(self) -> None:
        wait = False
        while True:
            try:
                await self.fetch_once(wait=wait)
                wait = True
            except StateBudgetError as error:
                if self.planner_reachable or self.last_error is None:
                    log.warning("planner unreachable (%s); routing from the table of epoch %d", error, self.table.epoch)
                self.planner_reachable = False
                self.last_error = str(error)
                self.metrics.planner_reachable.set(0)
                self.metrics.planner_errors.inc()
                wait = False
                await asyncio.sleep(self.retry_seconds)

    async def wait_for_change(self, timeout_seconds: float) -> bool:
        """Until the next table arrives (True) or the timeout (False)."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_seconds)
            except TimeoutError:
                return False
        return True
