from __future__ import annotations

import asyncio
import time
from typing import Annotated

from fastapi import APIRouter, Path
from starlette.concurrency import run_in_threadpool

from planner_service.api.deps import NodeAccessDep, ServiceDep, SettingsDep, SignalDep
from planner_service.service.inputs import HeartbeatIn, LeaseIn, RegisterIn
from planner_service.wire.nodes import HeartbeatOut, RegisterOut
from planner_service.wire.operations import LeaseOut, RenewOut

router = APIRouter(prefix="/v1/nodes/{node_id}", tags=["nodes"])


@router.post("/register", response_model=RegisterOut, response_model_exclude_unset=True)
def register(node_id: str, body: RegisterIn, service: ServiceDep, _: NodeAccessDep) -> RegisterOut:
    """A node agent announces its inventory and the moves its engines can carry out."""
    return RegisterOut.model_validate(service.register_node(node_id, body))


@router.post("/heartbeat", response_model=HeartbeatOut)
def heartbeat(node_id: str, body: HeartbeatIn, service: ServiceDep, _: NodeAccessDep) -> HeartbeatOut:
    """Telemetry: per-GPU use, measured bandwidths (they recalibrate the cost model), engine state."""
    return HeartbeatOut.model_validate(service.heartbeat(node_id, body))


@router.post("/lease", response_model=LeaseOut, response_model_exclude_unset=True)
async def lease(
    node_id: str, body: LeaseIn, service: ServiceDep, settings: SettingsDep, signal: SignalDep, _: NodeAccessDep
) -> LeaseOut:
    """Long-poll: lease the node's ready operations, most urgent first, waiting up to `wait_seconds` for some."""
    deadline = time.monotonic() + min(body.wait_seconds, settings.max_wait_seconds)
    while True:
        changed = signal.event(node_id)  # taken before looking, so a change in between still wakes us
        if signal.draining:  # shutting down: answer now, leasing nothing
            return LeaseOut(lease_id=None, expires_at=None, expires_in_seconds=None, operations=[])
        result = await run_in_threadpool(service.lease, node_id, body.max_operations)
        remaining = deadline - time.monotonic()
        if result["operations"] or remaining <= 0:
            return LeaseOut.model_validate(result)
        try:
            await asyncio.wait_for(changed.wait(), timeout=remaining)
        except TimeoutError:
            pass


@router.post("/leases/{lease_id}/renew", response_model=RenewOut)
def renew_lease(
    node_id: str,
    lease_id: Annotated[str, Path(min_length=1, max_length=200, description="The id the lease answer gave.")],
    service: ServiceDep,
    principal: NodeAccessDep,
) -> RenewOut:
    """Extend a lease still running to `lease_seconds` from now (renew about every third of it).

    A lease that holds nothing any more (it expired and its operations were re-queued or superseded, or
    all were reported) is a 409 that says which: its operations are no longer the caller's to report.
    """
    node_scope = principal.node if principal.kind == "node" else None
    return RenewOut.model_validate(service.renew(node_id, lease_id, node_scope=node_scope))
