from __future__ import annotations

from fastapi import APIRouter

from planner_service.api.deps import OperatorDep, ServiceDep
from planner_service.wire.sessions import SessionOut

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


@router.get("", response_model=list[SessionOut])
def list_sessions(service: ServiceDep, _: OperatorDep) -> list[SessionOut]:
    """Every session the service knows."""
    return [SessionOut.model_validate(session) for session in service.sessions_view()]


@router.get("/{session_id}", response_model=SessionOut)
def get_session(session_id: str, service: ServiceDep, _: OperatorDep) -> SessionOut:
    """Current model, context tokens, per-model cached tokens and the number of requests applied."""
    return SessionOut.model_validate(service.session_view(session_id))
