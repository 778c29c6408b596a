from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from planner_service.api.deps import OperatorDep, ServiceDep
from planner_service.wire.state import SrvOut

router = APIRouter(prefix="/v1/srv", tags=["srv"])


@router.get("", response_model=SrvOut, response_model_exclude_unset=True)
def get_srv(service: ServiceDep, _: OperatorDep) -> dict[str, Any]:
    """The State Residency Vector and the confirmed placement; `version` changes only when they do."""
    return service.srv_view()
