from __future__ import annotations

from fastapi import APIRouter

from planner_service.api.deps import RouterAccessDep, ServiceDep
from planner_service.service.inputs import EventsIn
from planner_service.wire.sessions import EventsOut

router = APIRouter(prefix="/v1/events", tags=["events"])


@router.post("", response_model=EventsOut)
def post_events(body: EventsIn, service: ServiceDep, _: RouterAccessDep) -> EventsOut:
    """Session events, applied atomically; a repeated event id is acknowledged and ignored."""
    return EventsOut.model_validate(service.apply_events(body.events))
