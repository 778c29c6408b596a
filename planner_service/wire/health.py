"""Liveness and readiness."""

from __future__ import annotations

from planner_service.wire.base import WireModel
from planner_service.wire.enums import HealthStatus


class Health(WireModel):
    status: HealthStatus
    epoch: int | None = None
    srv_version: int | None = None
