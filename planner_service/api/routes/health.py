from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request

from planner_service.api.deps import ServiceDep
from planner_service.api.errors import problem
from planner_service.wire.enums import HealthStatus
from planner_service.wire.health import Health

router = APIRouter(tags=["health"])


@router.get(
    "/livez", response_model=Health, response_model_exclude_none=True, responses={503: {"description": "restart me"}}
)
def livez(service: ServiceDep) -> Health | Response:
    """The process answers, and its state still matches the database (after a failed write it does not:
    a restart restores the last committed state)."""
    if service.broken is not None:
        return problem(503, "Not live", service.broken)
    return Health(status=HealthStatus.OK)


@router.get("/readyz", response_model=Health, responses={503: {"description": "still starting, or broken"}})
def readyz(service: ServiceDep) -> Health | Response:
    """The state is restored and a plan exists."""
    if service.broken is not None:
        return problem(503, "Not ready", service.broken)
    status = service.status()
    if status["epoch"] is None:
        return problem(503, "Not ready", "the service is restoring its state or computing its first plan")
    return Health(status=HealthStatus.OK, **status)


@router.get("/metrics", response_class=Response)
def metrics(request: Request) -> Response:
    """Prometheus exposition."""
    return Response(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)
