"""What the importers share: options, the importer protocol, idle-timeout session ends, model choice."""

from __future__ import annotations

import heapq
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from planner_service.domain.scenario import Scenario
from planner_service.sim.trace import TraceEnd, TraceError, TraceRecord


@dataclass(frozen=True)
class ImportOptions:
    """Options every importer takes; `None` means the importer's documented default."""

    limit: int | None = None  # read at most this many source requests
    models: tuple[str, ...] = ()  # scenario model ids to map onto, in the importer's order
    idle_timeout_seconds: float | None = None  # a session ends this long after its last request
    handoffs: bool = False  # later turns of a session follow the scenario's hand-off chain (HandoffChain)


class TraceImporter(Protocol):
    """Turns one public trace into StateBudget trace records, streamed in time order."""

    def records(self, source: Path, scenario: Scenario, options: ImportOptions) -> Iterator[TraceRecord]: ...


class IdleSessions:
    """Open sessions that end `idle_timeout_seconds` after their last request.

    Call `expire(t)` before emitting a request at time t: it yields, in time order, the
    `end` records of sessions idle since before t - timeout. `close_all()` ends the rest.
    """

    def __init__(self, idle_timeout_seconds: float) -> None:
        if idle_timeout_seconds <= 0:
            raise ValueError("idle_timeout_seconds must be positive")
        self.timeout = idle_timeout_seconds
        self.last_seconds: dict[str, float] = {}
        self._heap: list[tuple[float, int, str]] = []  # (expiry, tie-break, session); stale entries skipped
        self._pushed = 0

    def is_open(self, session: str) -> bool:
        return session in self.last_seconds

    def touch(self, session: str, t: float) -> None:
        self.last_seconds[session] = t
        self._pushed += 1
        heapq.heappush(self._heap, (t + self.timeout, self._pushed, session))

    def expire(self, now: float) -> Iterator[TraceEnd]:
        while self._heap and self._heap[0][0] < now:
            expiry, _, session = heapq.heappop(self._heap)
            last = self.last_seconds.get(session)
            if last is not None and last + self.timeout == expiry:  # not touched since this entry
                del self.last_seconds[session]
                yield TraceEnd(t=round(expiry, 3), session=session, event="end")

    def close_all(self) -> Iterator[TraceEnd]:
        yield from self.expire(float("inf"))


def pick_models(scenario: Scenario, requested: tuple[str, ...], default: list[str]) -> list[str]:
    """The requested model ids (checked against the scenario), else `default`."""
    known = [m.id for m in scenario.models]
    chosen = list(requested) or default
    unknown = [m for m in chosen if m not in known]
    if unknown:
        raise ValueError(f"unknown model(s) {', '.join(unknown)}; the scenario has: {', '.join(known)}")
    return chosen


def check_order(t: float, last: float, where: str) -> None:
    if t < last:
        raise TraceError(f"{where}: time {t} goes back (previous {last}); the source must be in time order")


def new_input_tokens(prompt_tokens: int, history_tokens: int) -> int:
    """What a turn appends to the session's history so that history + input equals its prompt.

    A prompt shorter than the history (a truncated conversation) appends nothing.
    """
    return max(0, prompt_tokens - history_tokens)


class HandoffChain:
    """Models for the turns of imported sessions whose source names one model (or service) per session.

    Azure and Mooncake sessions never change model, so replaying them shows no hand-offs. With
    `--handoffs`, a session's first turn keeps the importer's model and each later turn moves along
    the scenario's hand-off prior (`predictor.handoff`, the chain the synthetic traces drift from):
    the arrival times, sessions and token counts stay the source's, only the agent role of a turn is
    drawn. Each session draws from its own generator seeded by the CRC-32 of its id, so a session's
    models do not depend on how many rows were read before it.
    """

    def __init__(self, scenario: Scenario) -> None:
        from planner_service.sim.synth import handoff_prior

        self.models = [m.id for m in scenario.models]
        self.index = {m: i for i, m in enumerate(self.models)}
        self.matrix = handoff_prior(scenario)
        self.current: dict[str, tuple[str, np.random.Generator]] = {}

    def model(self, session: str, first_model: str) -> str:
        """The model of the session's next turn (its first turn: `first_model`)."""
        if session not in self.current:
            self.current[session] = (first_model, np.random.default_rng(zlib.crc32(session.encode())))
            return first_model
        model, rng = self.current[session]
        nxt = self.models[int(rng.choice(len(self.models), p=self.matrix[self.index[model]]))]
        self.current[session] = (nxt, rng)
        return nxt
