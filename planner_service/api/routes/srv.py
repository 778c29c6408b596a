from __future__ import annotations

from fastapi import APIRouter

from planner_service.api.deps import OperatorDep, ServiceDep
from planner_service.wire.state import SrvOut

router = APIRouter(prefix="/v1/srv", tags=["srv"])


@router.get("", response_model=SrvOut, response_model_exclude_unset=True)
def get_srv(service: ServiceDep, _: OperatorDep) -> SrvOut:
    """The State Residency Vector and the confirmed placement; `version` changes only when they do."""
    return SrvOut.model_validate(service.srv_view())
