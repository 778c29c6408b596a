from __future__ import annotations

from fastapi import APIRouter

from planner_service.api.deps import OperatorDep, ServiceDep
from planner_service.wire.engines import EngineOut

router = APIRouter(prefix="/v1/engines", tags=["engines"])


@router.get("", response_model=list[EngineOut])
def list_engines(service: ServiceDep, _: OperatorDep) -> list[EngineOut]:
    """The engine instances of vLLM and SGLang nodes: state now and once the current plan is done, launch
    settings, GPUs and the bytes each state holds."""
    return [EngineOut.model_validate(engine) for engine in service.engines_view()]
