"""Closed-loop session slots: a trace's concurrency is a number of seats, and a session takes a seat.

A trace of a team describes about so many agents working at once; when a replay falls behind, an
agent's next session cannot start before its previous one has ended. So a replay holds at most the
trace's concurrency (the most sessions open at once by the trace's own times, each open from its first
record to its end record) of open sessions: a session that arrives while every seat is taken waits for
one, and its whole timeline moves by that wait. A session whose trace has no end record (a request log
without session boundaries) has no known length and takes no seat; it arrives as the trace says. A policy that falls behind then serves fewer sessions in
the trace's time instead of more at once, and its run overruns the trace (`saturated`).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

from planner_service.sim.trace import TraceEnd, TraceRecord

SATURATION_OVERRUN = 0.05  # a run whose simulated time passes the trace's end by more than this share


def trace_concurrency(records: Sequence[TraceRecord]) -> int:
    """The most sessions open at once, a session open from its first record's time to its end record's
    (sessions without an end record are not counted)."""
    ended = {r.session for r in records if isinstance(r, TraceEnd)}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for r in records:
        if r.session in ended:
            first.setdefault(r.session, r.t)
            last[r.session] = max(last.get(r.session, r.t), r.t)
    events = sorted([(t, 1) for t in first.values()] + [(t, -1) for t in last.values()], key=lambda e: (e[0], -e[1]))
    open_now = peak = 0
    for _, step in events:
        open_now += step
        peak = max(peak, open_now)
    return peak


def saturated(simulated_seconds: float, trace_seconds: float) -> bool:
    """Whether a run overran the trace by more than `SATURATION_OVERRUN` (no ratio is quoted from it)."""
    return simulated_seconds > (1 + SATURATION_OVERRUN) * trace_seconds


class SessionSlots:
    """Which sessions hold a seat, which wait for one, and how many records each has left."""

    def __init__(self, records: Sequence[TraceRecord], seats: int) -> None:
        self.seats = seats
        self.records_left: Counter[str] = Counter(r.session for r in records)
        self.seated = {r.session for r in records if isinstance(r, TraceEnd)}  # the sessions that take a seat
        self.open: set[str] = set()
        self.waiting: deque[str] = deque()
        self.peak_open = 0

    def arrive(self, session: str) -> bool:
        """A record of `session` arrived: True when it may run (it holds a seat, taking a free one if it had
        none, or it takes no seat)."""
        if session in self.open or session not in self.seated:
            return True
        if session not in self.waiting:
            if len(self.open) < self.seats:
                self._take(session)
                return True
            self.waiting.append(session)
        return False

    def may_run(self, session: str) -> bool:
        return session in self.open or session not in self.seated

    def consumed(self, session: str) -> None:
        """One of the session's records was released (a turn admitted or its end)."""
        self.records_left[session] -= 1

    def finished(self, session: str) -> bool:
        return self.records_left[session] <= 0

    def close(self, session: str) -> str | None:
        """The session has nothing left: free its seat; returns the waiting session that takes it, if any."""
        if session not in self.open:
            return None
        self.open.discard(session)
        if self.waiting:
            nxt = self.waiting.popleft()
            self._take(nxt)
            return nxt
        return None

    def _take(self, session: str) -> None:
        self.open.add(session)
        self.peak_open = max(self.peak_open, len(self.open))
