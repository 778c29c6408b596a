from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from planner_service.api.deps import OperatorDep, PrincipalDep, ServiceDep
from planner_service.service.errors import Forbidden
from planner_service.service.inputs import ReportIn
from planner_service.wire.enums import OperationState
from planner_service.wire.operations import OperationRecord, ReportOut

router = APIRouter(prefix="/v1/operations", tags=["operations"])


@router.get("", response_model=list[OperationRecord], response_model_exclude_unset=True)
def list_operations(
    service: ServiceDep,
    _: OperatorDep,
    node: str | None = Query(None, description="Only this node's operations."),
    state: Annotated[
        OperationState | None,
        Query(description="Only operations in this state (held_back: none; the plan lists its held-back moves)."),
    ] = None,
) -> list[OperationRecord]:
    """The queues: operations with their lifecycle state (open ones unless `state` asks otherwise)."""
    return [OperationRecord.model_validate(op) for op in service.operations_view(node=node, state=state)]


@router.post("/{op_id}/report", response_model=ReportOut, response_model_exclude_unset=True)
def report(op_id: str, body: ReportIn, service: ServiceDep, principal: PrincipalDep) -> ReportOut:
    """`done` (with measured seconds and bytes) or `failed` (with the error) for a leased operation; idempotent."""
    if principal.kind == "router":
        raise Forbidden("a router token cannot report operations; that is a node's or an operator's")
    node_scope = principal.node if principal.kind == "node" else None
    return ReportOut.model_validate(service.report(op_id, body, node_scope=node_scope))
