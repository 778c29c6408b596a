"""Session events as the service expects them (`POST /v1/events`); `id` makes a resend harmless.

sb.post_events(
    events.request("e1", session="s1", model="coder", slo="blocking", input_tokens=1200),
    events.tool_call_start("e2", session="s1", tool="pytest"),
)
"""

from __future__ import annotations

from typing import Any

from planner_service.wire.enums import Slo
from planner_service.wire.events import (
    RequestEvent,
    SessionEndEvent,
    SessionEvent,
    ToolCallEndEvent,
    ToolCallStartEvent,
    TurnEndEvent,
)

__all__ = ["Slo", "request", "session_end", "tool_call_end", "tool_call_start", "turn_end"]


def _body(event: SessionEvent) -> dict[str, Any]:
    """The event as the request body carries it. Built from the wire model the service validates with, so a
    field out of bounds is refused here (`pydantic.ValidationError`, naming it) before it is queued."""
    return event.model_dump(mode="json", exclude_none=True)


def request(
    event_id: str,
    *,
    session: str,
    model: str,
    user: str | None = None,
    slo: Slo | None = None,
    input_tokens: int = 0,
    output_tokens: int = 0,
    at: float | None = None,
) -> dict[str, Any]:
    """The session hands off to (or keeps using) `model`: the planner wants it ready to prefill."""
    return _body(
        RequestEvent(
            id=event_id,
            type="request",
            session=session,
            at=at,
            model=model,
            user=user,
            slo=slo,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
        )
    )


def turn_end(event_id: str, *, session: str, output_tokens: int = 0, at: float | None = None) -> dict[str, Any]:
    return _body(TurnEndEvent(id=event_id, type="turn_end", session=session, at=at, output_tokens=output_tokens))


def tool_call_start(event_id: str, *, session: str, tool: str | None = None, at: float | None = None) -> dict[str, Any]:
    return _body(ToolCallStartEvent(id=event_id, type="tool_call_start", session=session, at=at, tool=tool))


def tool_call_end(event_id: str, *, session: str, tool: str | None = None, at: float | None = None) -> dict[str, Any]:
    return _body(ToolCallEndEvent(id=event_id, type="tool_call_end", session=session, at=at, tool=tool))


def session_end(event_id: str, *, session: str, at: float | None = None) -> dict[str, Any]:
    return _body(SessionEndEvent(id=event_id, type="session_end", session=session, at=at))
