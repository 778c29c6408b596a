"""Response bodies (inputs live in `planner_service.service.inputs`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class Health(BaseModel):
    status: Literal["ok", "starting"]
    epoch: int | None = None
    srv_version: int | None = None


class EventResult(BaseModel):
    id: str
    status: Literal["applied", "duplicate"]


class EventsOut(BaseModel):
    applied: int
    duplicates: int
    results: list[EventResult]


class SessionOut(BaseModel):
    id: str
    user: str
    slo: str
    model: str
    active: bool
    ended: bool
    in_tool_call: bool
    context_tokens: int
    cached_tokens: dict[str, int]
    requests: int
    tool_calls: int
    kv_bytes: dict[str, dict[str, int]]
    last_activity: str | None


class SrvRow(BaseModel):
    model: str
    state: Literal["weights", "kv", "experts"]
    tier: Literal["gpu", "host", "nvme"]
    fraction: float
    bytes: int


class SrvOut(BaseModel):
    version: int
    srv: list[SrvRow]
    placement: list[dict[str, Any]]


class LeaseOut(BaseModel):
    lease_id: str | None
    expires_at: str | None
    expires_in_seconds: float | None
    operations: list[dict[str, Any]]


class ReportOut(BaseModel):
    operation: dict[str, Any]
    srv_version: int
    duplicate: bool


class RegisterOut(BaseModel):
    node: str
    registered_at: str | None
    capabilities: list[str]
    engines: list[dict[str, Any]] | None = Field(
        description="The models the node serves through its engines, {model, gpus} (gpus: fixed ones, or empty); "
        "null: any model, on any group."
    )
    gpus: list[str]
    lease_seconds: float
    warnings: list[str]


class HeartbeatOut(BaseModel):
    node: str
    received_at: str | None
    calibration: dict[str, Any]
