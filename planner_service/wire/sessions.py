"""Sessions and what the service did with the events that change them."""

from __future__ import annotations

from pydantic import Field

from planner_service.wire.base import WireModel
from planner_service.wire.enums import EventStatus, Slo, Tier


class EventResult(WireModel):
    id: str
    status: EventStatus


class EventsOut(WireModel):
    applied: int
    duplicates: int
    results: list[EventResult]


class SessionOut(WireModel):
    id: str
    user: str
    slo: Slo
    model: str
    active: bool
    ended: bool
    in_tool_call: bool
    context_tokens: int
    cached_tokens: dict[str, int] = Field(description="Model -> context tokens its KV holds.")
    requests: int
    tool_calls: int
    kv_bytes: dict[str, dict[Tier, int]] = Field(description="Model -> tier -> bytes of the session's KV there.")
    last_activity: str | None = Field(description="ISO 8601, UTC.")
