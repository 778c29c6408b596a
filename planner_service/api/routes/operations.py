from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query

from planner_service.api.deps import OperatorDep, PrincipalDep, ServiceDep
from planner_service.api.schemas import ReportOut
from planner_service.service.inputs import ReportIn

router = APIRouter(prefix="/v1/operations", tags=["operations"])


@router.get("")
def list_operations(
    service: ServiceDep,
    _: OperatorDep,
    node: str | None = Query(None, description="Only this node's operations."),
    state: Literal["queued", "leased", "done", "failed", "superseded"] | None = Query(None),
) -> list[dict[str, Any]]:
    """The queues: operations with their lifecycle state (open ones unless `state` asks otherwise)."""
    return service.operations_view(node=node, state=state)


@router.post("/{op_id}/report", response_model=ReportOut)
def report(op_id: str, body: ReportIn, service: ServiceDep, principal: PrincipalDep) -> dict[str, Any]:
    """`done` (with measured seconds and bytes) or `failed` (with the error) for a leased operation; idempotent."""
    node_scope = principal.node if principal.kind == "node" else None
    return service.report(op_id, body, node_scope=node_scope)
