from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Annotated

from fastapi import APIRouter, Query
from starlette.concurrency import run_in_threadpool

from planner_service.api.deps import RouterAccessDep, ServiceDep, SettingsDep, SignalDep
from planner_service.wire.routes import RoutesOut

router = APIRouter(prefix="/v1/routes", tags=["routes"])

# a heartbeat that wakes an instance changes the table without touching a queue: the long-poll looks again this
# often (a plan, a report or an expiry wakes it at once)
_RECHECK_SECONDS = 0.1


@router.get("", response_model=RoutesOut)
async def get_routes(
    service: ServiceDep,
    settings: SettingsDep,
    signal: SignalDep,
    _: RouterAccessDep,
    after_epoch: Annotated[
        int | None, Query(ge=0, description="Answer once the plan epoch differs from this one (long-poll).")
    ] = None,
    after_revision: Annotated[
        str | None, Query(max_length=64, description="Answer once the table's revision differs from this one.")
    ] = None,
    wait: Annotated[float, Query(ge=0, le=300, description="Longest wait for a change, in seconds.")] = 0.0,
) -> RoutesOut:
    """The gateway's route table: per model its engine instances and their URLs, each session's KV holder,
    and the gateway's directives; with `after_epoch` / `after_revision` and `wait`, a long-poll that answers
    when either changed (or when `wait` ran out, with the table as it is)."""
    deadline = time.monotonic() + min(wait, settings.max_wait_seconds)
    while True:
        change = signal.any_change()  # taken before the look, so a change during it ends the wait below
        table = await run_in_threadpool(service.routes_view)
        unchanged = (after_epoch is None or table["epoch"] == after_epoch) and (
            after_revision is None or table["revision"] == after_revision
        )
        remaining = deadline - time.monotonic()
        if (after_epoch is None and after_revision is None) or not unchanged or remaining <= 0 or signal.draining:
            return RoutesOut.model_validate(table)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(change.wait(), min(remaining, _RECHECK_SECONDS))
