"""Session events the gateway sends for the agents: built from what passes through, batched off the
request path, kept and resent while the planner is down (event ids make a resend harmless)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clients.gateway.metrics import GatewayMetrics
from clients.gateway.parsing import AnswerFacts, RequestFacts
from clients.sdk import AsyncStateBudgetClient, StateBudgetError
from clients.sdk import events as ev

log = logging.getLogger(__name__)


class EventSink:
    """A FIFO of events, posted in batches by `run()`; on a failure the batch stays at the head."""

    def __init__(
        self,
        planner: AsyncStateBudgetClient,
        metrics: GatewayMetrics,
        *,
        flush_seconds: float,
        batch_max: int,
        buffer_max: int,
        retry_seconds: float,
    ) -> None:
        self.planner = planner
        self.metrics = metrics
        self.flush_seconds = flush_seconds
        self.batch_max = batch_max
        self.retry_seconds = retry_seconds
        self._pending: deque[dict[str, Any]] = deque(maxlen=buffer_max)
        self._wake = asyncio.Event()

    def emit(self, event: dict[str, Any]) -> None:
        if len(self._pending) == self._pending.maxlen:
            self.metrics.events_dropped.inc()
        self._pending.append(event)
        self.metrics.events_pending.set(len(self._pending))
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def flush(self) -> bool:
        """Post what is pending, batch by batch; False when the planner refused or was unreachable."""
        while self._pending:
            batch = [self._pending[i] for i in range(min(self.batch_max, len(self._pending)))]
            try:
                await self.planner.post_events(*batch)
            except StateBudgetError as error:
                self.metrics.event_post_failures.inc()
                log.warning("events not delivered (%d pending, kept): %s", len(self._pending), error)
                return False
            for _ in batch:
                self._pending.popleft()
            self.metrics.events_sent.inc(len(batch))
            self.metrics.events_pending.set(len(self._pending))
        return True

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.flush_seconds)  # gather what arrives meanwhile into one batch
            if not await self.flush():
                await asyncio.sleep(self.retry_seconds)
                self._wake.set()


@dataclass(slots=True)
class _Session:
    last_seen: float
    tool: str | None = None  # the tool a finished turn called, until the session's next request
    in_tool_call: bool = False


class SessionEvents:
    """Turns requests and answers into the planner's session events, as a hand-instrumented agent sends them:
    `tool_call_end` (when a session in a tool call asks again), `request`, then `turn_end` and, where the
    answer stopped for tool calls, `tool_call_start`; `session_end` once a session was idle long enough."""

    def __init__(self, sink: EventSink, *, idle_seconds: float, clock: Callable[[], float] = time.time) -> None:
        self.sink = sink
        self.idle_seconds = idle_seconds
        self.clock = clock
        self._sessions: dict[str, _Session] = {}
        self._prefix = uuid.uuid4().hex[:12]
        self._seq = 0

    def _id(self) -> str:
        self._seq += 1
        return f"gw-{self._prefix}-{self._seq}"

    def _emit(self, make: Callable[..., dict[str, Any]], /, *args: Any, **fields: Any) -> None:
        """Queue the event `make` builds from the wire model. One the model refuses (an id or a count out of its
        bounds) is dropped and counted: queued, the planner would refuse its whole batch at every retry."""
        try:
            event = make(*args, **fields)
        except ValueError as error:  # pydantic's ValidationError names the field
            self.sink.metrics.events_dropped.inc()
            log.warning("a session event the planner would refuse is dropped: %s", error)
            return
        self.sink.emit(event)

    def on_request(self, facts: RequestFacts) -> None:
        now = self.clock()
        s = self._sessions.get(facts.session)
        if s is None:
            s = self._sessions[facts.session] = _Session(last_seen=now)
        if s.in_tool_call:
            self._emit(ev.tool_call_end, self._id(), session=facts.session, tool=s.tool, at=now)
            s.in_tool_call, s.tool = False, None
        s.last_seen = now
        self._emit(
            ev.request,
            self._id(),
            session=facts.session,
            model=facts.model,
            user=facts.user,
            input_tokens=facts.input_tokens,
            at=now,
        )

    def on_answer(self, facts: RequestFacts, answer: AnswerFacts) -> None:
        now = self.clock()
        s = self._sessions.setdefault(facts.session, _Session(last_seen=now))
        s.last_seen = now
        self._emit(ev.turn_end, self._id(), session=facts.session, output_tokens=answer.output_tokens, at=now)
        if answer.finish_reason == "tool_calls":
            s.in_tool_call = True
            s.tool = answer.tools[0] if answer.tools else None
            self._emit(ev.tool_call_start, self._id(), session=facts.session, tool=s.tool, at=now)

    def end_idle(self) -> int:
        """`session_end` for each session quiet for `idle_seconds`; how many ended."""
        now = self.clock()
        idle = [sid for sid, s in self._sessions.items() if now - s.last_seen >= self.idle_seconds]
        for sid in idle:
            del self._sessions[sid]
            self._emit(ev.session_end, self._id(), session=sid, at=now)
        return len(idle)

    async def run_idle_sweep(self) -> None:
        while True:
            await asyncio.sleep(min(self.idle_seconds / 4, 30.0))
            self.end_idle()
