"""Timestamps are held to the server's clock: within the skew, or a 422 naming the field."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from planner_service.service.errors import InvalidInput
from planner_service.service.inputs import SERVER_TIME, EventsIn, ServerTime, TurnEndEvent, check_event_times
from planner_service.wire.bounds import DEFAULT_MAX_CLOCK_SKEW_SECONDS, MAX_UNIX_SECONDS

NOW = 1_800_000_000.0
DAY = 86_400.0
SERVER = ServerTime(NOW, DEFAULT_MAX_CLOCK_SKEW_SECONDS)


def batch(*ats: float | None) -> dict:
    return {"events": [{"id": f"e{i}", "type": "turn_end", "session": "s1", "at": at} for i, at in enumerate(ats)]}


def error_fields(error: ValidationError) -> list[str]:
    return [".".join(str(p) for p in e["loc"]) for e in error.errors()]


@pytest.mark.parametrize(("at", "side"), [(NOW + 2 * DAY, "ahead of"), (NOW - 2 * DAY, "behind"), (0.0, "behind")])
def test_a_timestamp_beyond_the_skew_is_refused_in_validation(at, side):
    with pytest.raises(ValidationError) as caught:
        EventsIn.model_validate(batch(NOW, at), context={SERVER_TIME: SERVER})
    assert error_fields(caught.value) == ["events.1.turn_end.at"]
    assert side in str(caught.value) and "at most 86400 s of skew" in str(caught.value)


def test_a_timestamp_within_the_skew_is_kept():
    parsed = EventsIn.model_validate(batch(NOW - DAY + 1, NOW + DAY - 1, None), context={SERVER_TIME: SERVER})
    assert [e.at for e in parsed.events] == [NOW - DAY + 1, NOW + DAY - 1, None]


def test_the_skew_is_the_servers_setting():
    tight = ServerTime(NOW, 60.0)
    with pytest.raises(ValidationError, match="at most 60 s of skew"):
        EventsIn.model_validate(batch(NOW + 61), context={SERVER_TIME: tight})
    assert EventsIn.model_validate(batch(NOW + 59), context={SERVER_TIME: tight}).events[0].at == NOW + 59


def test_without_the_servers_clock_only_the_static_bounds_hold():
    assert EventsIn.model_validate(batch(NOW + 30 * DAY)).events[0].at == NOW + 30 * DAY
    for at in (MAX_UNIX_SECONDS + 1, -1.0, math.inf, math.nan):
        with pytest.raises(ValidationError):
            EventsIn.model_validate(batch(at))


def test_check_event_times_names_the_first_event_beyond_the_skew():
    events = EventsIn.model_validate(batch(NOW, None, 253_402_300_000.0, NOW - 3 * DAY)).events
    with pytest.raises(InvalidInput) as caught:
        check_event_times(events, SERVER)
    assert caught.value.field == "events.2.at"
    assert caught.value.message.startswith("events[2].at: ") and "ahead of the server clock" in caught.value.message
    check_event_times(events[:2], SERVER)  # within the skew, or no `at`: nothing to refuse


def test_check_event_times_lets_resends_of_acknowledged_events_through():
    events = EventsIn.model_validate(batch(NOW - 3 * DAY, NOW)).events
    check_event_times(events, SERVER, known_ids={"e0"})
    with pytest.raises(InvalidInput):
        check_event_times(events, SERVER, known_ids={"e1"})


def test_event_models_refuse_non_finite_times():
    with pytest.raises(ValidationError, match="finite"):
        TurnEndEvent(id="e", type="turn_end", session="s", at=math.inf)
