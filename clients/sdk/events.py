"""Session events as the service expects them (`POST /v1/events`); `id` makes a resend harmless.

sb.post_events(
    events.request("e1", session="s1", model="coder", slo="blocking", input_tokens=1200),
    events.tool_call_start("e2", session="s1", tool="pytest"),
)
"""

from __future__ import annotations

from typing import Any

from planner_service.wire.enums import EventType, Slo

__all__ = ["Slo", "request", "session_end", "tool_call_end", "tool_call_start", "turn_end"]


def _event(kind: EventType, event_id: str, session: str, at: float | None, **fields: Any) -> dict[str, Any]:
    event = {"id": event_id, "type": kind.value, "session": session, "at": at, **fields}
    return {k: v for k, v in event.items() if v is not None}


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
    return _event(
        EventType.REQUEST,
        event_id,
        session,
        at,
        model=model,
        user=user,
        slo=slo,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
    )


def turn_end(event_id: str, *, session: str, output_tokens: int = 0, at: float | None = None) -> dict[str, Any]:
    return _event(EventType.TURN_END, event_id, session, at, output_tokens=output_tokens)


def tool_call_start(event_id: str, *, session: str, tool: str | None = None, at: float | None = None) -> dict[str, Any]:
    return _event(EventType.TOOL_CALL_START, event_id, session, at, tool=tool)


def tool_call_end(event_id: str, *, session: str, tool: str | None = None, at: float | None = None) -> dict[str, Any]:
    return _event(EventType.TOOL_CALL_END, event_id, session, at, tool=tool)


def session_end(event_id: str, *, session: str, at: float | None = None) -> dict[str, Any]:
    return _event(EventType.SESSION_END, event_id, session, at)
