"""Session events: requests, turns, tool calls and session ends applied to the sessions and the predictor."""

from __future__ import annotations

import logging
from typing import Any

from planner_service.domain.problem import STAND_IN, is_stand_in
from planner_service.domain.scenario import (
    Slo,
)
from planner_service.service.errors import (
    InvalidInput,
)
from planner_service.service.inputs import (
    Event,
    RequestEvent,
    ServerTime,
    SessionEndEvent,
    ToolCallEndEvent,
    ToolCallStartEvent,
    TurnEndEvent,
    check_event_times,
)
from planner_service.service.live import (
    Live,
)
from planner_service.service.records import SessionState
from planner_service.service.state_lock import Urgency
from planner_service.service.store import Batch

log = logging.getLogger(__name__)


class Sessions:
    """Session events: requests, turns, tool calls and session ends applied to the sessions and the predictor."""

    def __init__(self, live: Live) -> None:
        self.live = live

    def apply_events(self, events: list[Event]) -> dict[str, Any]:
        """Apply a batch atomically: all new events apply, or none when one refers to something unknown."""
        self.live.require_ready()
        with self.live.change(Urgency.URGENT):
            server_time = ServerTime(self.live.clock(), self.live.settings.max_clock_skew_seconds)
            check_event_times(events, server_time, known_ids=self.live.event_ids)
            models = sorted(self.live.model_ids())
            known_sessions = {sid for sid, s in self.live.sessions.items()}
            seen: set[str] = set()
            for i, ev in enumerate(events):
                if ev.id in self.live.event_ids or ev.id in seen:
                    continue
                seen.add(ev.id)
                if is_stand_in(ev.session):
                    raise InvalidInput(
                        f"events[{i}].session: ids beginning with {STAND_IN!r} are reserved for the planner's "
                        "stand-in sessions",
                        field=f"events.{i}.session",
                    )
                if isinstance(ev, RequestEvent):
                    if ev.model not in models:
                        raise InvalidInput(
                            f"events[{i}].model: unknown model {ev.model!r}; known: {models}", field=f"events.{i}.model"
                        )
                    known_sessions.add(ev.session)
                elif ev.session not in known_sessions:
                    raise InvalidInput(
                        f"events[{i}].session: unknown session {ev.session!r}; a session starts with a request event",
                        field=f"events.{i}.session",
                    )
            now = self.live.clock()
            batch = Batch()
            results = []
            for ev in events:
                if ev.id in self.live.event_ids:
                    results.append({"id": ev.id, "status": "duplicate"})
                    continue
                self._apply_event(ev, ev.at if ev.at is not None else now, batch)
                self.live.event_ids[ev.id] = now
                batch.events.append((ev.id, ev.type, now))
                results.append({"id": ev.id, "status": "applied"})
            self.live.purge_ended_sessions(batch)
            self.live.write(batch)
            applied = [ev for ev, res in zip(events, results, strict=True) if res["status"] == "applied"]
            for ev in applied:
                self.live.metrics.events.labels(ev.type).inc()
            if applied:
                self.live.wake(
                    urgent=any(isinstance(ev, RequestEvent) and ev.model not in self.live.serving for ev in applied)
                )
        return {
            "applied": len(applied),
            "duplicates": len(events) - len(applied),
            "results": results,
        }

    def _apply_event(self, ev: Event, t: float, batch: Batch) -> None:
        s = self.live.sessions.get(ev.session)
        if isinstance(ev, RequestEvent):
            if s is None:
                s = SessionState(
                    id=ev.session,
                    user=ev.user or "default",
                    slo=ev.slo or Slo.INTERACTIVE,
                    model=ev.model,
                    created_at=t,
                )
                self.live.sessions[s.id] = s
            else:
                self.live.predictor.observe_handoff(t, s.model, ev.model)
                batch.observations.append((t, "handoff", s.model, ev.model, None, None))
                if s.last_turn_end is not None and t >= s.last_turn_end:
                    self.live.predictor.observe_turn_gap(t, t - s.last_turn_end)
                    batch.observations.append((t, "gap", None, None, t - s.last_turn_end, None))
            s.model, s.active, s.ended = ev.model, True, False
            s.user = ev.user or s.user
            s.slo = ev.slo or s.slo
            s.requests += 1
            s.context_tokens += ev.input_tokens + ev.output_tokens
            s.cached_tokens[ev.model] = s.context_tokens
            self.live.load.add(t, ev.model, s.context_tokens)
            batch.observations.append((t, "request", None, ev.model, None, s.context_tokens))
            if ev.model in self.live.serving:
                self.live.observe_switch(s, 0.0)
                s.waiting_since = None
            else:
                s.waiting_since = t
        else:
            assert s is not None
            if isinstance(ev, TurnEndEvent):
                s.active, s.in_tool_call, s.last_turn_end = False, False, t
                s.context_tokens += ev.output_tokens
                s.cached_tokens[s.model] = s.context_tokens
            elif isinstance(ev, ToolCallStartEvent):
                s.in_tool_call = True
                s.tool_calls += 1
            elif isinstance(ev, ToolCallEndEvent):
                s.in_tool_call = False
            elif isinstance(ev, SessionEndEvent):
                if not s.ended:  # no next request came after its last one (the warm-ups' `next_turn`)
                    self.live.predictor.observe_session_end(t, s.model)
                    batch.observations.append((t, "end", s.model, None, None, None))
                s.active, s.in_tool_call, s.ended, s.waiting_since = False, False, True, None
        s.last_activity = t
        if isinstance(ev, (RequestEvent, TurnEndEvent)):
            self.live.last_used[s.model] = max(self.live.last_used.get(s.model, t), t)
        batch.sessions[s.id] = s.to_json()
