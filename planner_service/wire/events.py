"""Session events as clients send them (`POST /v1/events`): the one definition the service validates and
the SDK and the gateway build.

A timestamp is also held to the server's clock, which a request body cannot know: validating with
`context={SERVER_TIME: ServerTime(now, skew)}` checks it in pydantic; the service checks events already
parsed without that context against its own clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator

from planner_service.wire.base import WireIn
from planner_service.wire.bounds import EventId, Name, Tokens, UnixSeconds
from planner_service.wire.enums import Slo

SERVER_TIME = "server_time"
"""The validation-context key under which a `ServerTime` holds timestamps to the server's clock."""


@dataclass(frozen=True, slots=True)
class ServerTime:
    """The server's clock now and how far a client's timestamp may be from it (`max_clock_skew_seconds`)."""

    now: float
    max_skew_seconds: float

    def skew_error(self, at: float) -> str | None:
        """Why `at` is too far from the server's clock, or None when it is within the skew."""
        skew = at - self.now
        if abs(skew) <= self.max_skew_seconds:
            return None
        side = "ahead of" if skew > 0 else "behind"
        now = datetime.fromtimestamp(self.now, UTC).isoformat().replace("+00:00", "Z")
        return (
            f"{at:.0f} is {abs(skew):.0f} s {side} the server clock ({now}); "
            f"at most {self.max_skew_seconds:.0f} s of skew is accepted"
        )


class SessionEvent(WireIn):
    """What every session event carries."""

    id: EventId = Field(description="Unique per event; a repeated id is acknowledged and ignored.")
    session: Name
    at: UnixSeconds | None = Field(
        None,
        description="Unix seconds when it happened, within the server's clock skew "
        "(STATEBUDGET_MAX_CLOCK_SKEW_SECONDS); default: when received.",
    )

    @field_validator("at")
    @classmethod
    def _within_skew(cls, at: float | None, info: ValidationInfo) -> float | None:
        server_time = (info.context or {}).get(SERVER_TIME)
        if at is not None and isinstance(server_time, ServerTime):
            error = server_time.skew_error(at)
            if error is not None:
                raise ValueError(error)
        return at


class RequestEvent(SessionEvent):
    type: Literal["request"]
    model: Name
    user: Name | None = None
    slo: Slo | None = None
    input_tokens: Tokens = 0
    output_tokens: Tokens = 0


class TurnEndEvent(SessionEvent):
    type: Literal["turn_end"]
    output_tokens: Tokens = 0


class ToolCallStartEvent(SessionEvent):
    type: Literal["tool_call_start"]
    tool: Name | None = None


class ToolCallEndEvent(SessionEvent):
    type: Literal["tool_call_end"]
    tool: Name | None = None


class SessionEndEvent(SessionEvent):
    type: Literal["session_end"]


Event = Annotated[
    RequestEvent | TurnEndEvent | ToolCallStartEvent | ToolCallEndEvent | SessionEndEvent,
    Field(discriminator="type"),
]


class EventsIn(WireIn):
    events: list[Event] = Field(min_length=1, max_length=10_000)
