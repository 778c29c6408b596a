"""Azure LLM inference trace 2023 (Splitwise; ../shared/traces/azure_llm_2023/SOURCE.md).

Source: `AzureLLMInferenceTrace_code.csv` and `AzureLLMInferenceTrace_conv.csv`, columns
`TIMESTAMP` (wall clock, 100 ns), `ContextTokens` (prompt), `GeneratedTokens` (output). Each file
is one production service; the two are merged on time, and `t` counts from the earlier first row.

- **Models.** The `code` service maps onto the first model given (default: the scenario's first
  model whose id or preset mentions "code"), `conv` onto the second (default: the first other model
  whose id or preset mentions "plan", "summar" or "chat", else the first other model).
- **Hand-offs.** With `--handoffs`, a session's first turn is on its service's model and later
  turns follow the scenario's hand-off chain (`common.HandoffChain`): an agent that starts on the
  code (or chat) model and hands off as the scenario's prior says; the SLO stays the service's.
- **SLO.** `code` requests are `blocking` (an editor waits on the completion), `conv` requests
  `interactive`.
- **Pseudo-sessions.** The trace has no session id, so sessions are derived per service by
  *prompt containment*: a request continues the open session of its service whose history
  (all its input + output tokens so far) is the largest that still fits in the request's prompt
  (history <= ContextTokens), i.e. the longest conversation its prompt could contain; otherwise it
  opens a new session. A session ends `idle_timeout_seconds` (default 120 s) after its last
  request. Ids are `code-N` / `conv-N` in order of opening. On the full files this gives 8,978
  sessions from 28,185 requests, 6,130 of them multi-turn (up to 29 turns).
- **Tokens.** `input_tokens = ContextTokens - history` (the new part of the prompt; 0 if shorter),
  `output_tokens = GeneratedTokens`; so a session's history after a turn equals that turn's
  prompt plus its output.
- `--limit N` reads the first N rows of the merged stream. A directory input reads both files;
  a single CSV is one service, named by `code` or `conv` in its file name.
"""

from __future__ import annotations

import bisect
import csv
import heapq
from collections.abc import Iterator
from datetime import datetime
from itertools import islice
from pathlib import Path

from planner_service.domain.scenario import Scenario, Slo
from planner_service.sim.importers.common import (
    HandoffChain,
    IdleSessions,
    ImportOptions,
    check_order,
    new_input_tokens,
    pick_models,
)
from planner_service.sim.trace import TraceError, TraceRecord, TraceRequest

SERVICES = ("code", "conv")
FILES = {"code": "AzureLLMInferenceTrace_code.csv", "conv": "AzureLLMInferenceTrace_conv.csv"}
SLOS = {"code": Slo.BLOCKING, "conv": Slo.INTERACTIVE}
DEFAULT_IDLE_TIMEOUT_SECONDS = 120.0
COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def default_models(scenario: Scenario) -> list[str]:
    def mentions(model, words: tuple[str, ...]) -> bool:
        text = f"{model.id} {model.preset or ''}".lower()
        return any(w in text for w in words)

    models = scenario.models
    code = next((m for m in models if mentions(m, ("code",))), models[0])
    others = [m for m in models if m.id != code.id] or [code]
    conv = next((m for m in others if mentions(m, ("plan", "summar", "chat"))), others[0])
    return [code.id, conv.id]


def _sources(source: Path) -> dict[str, Path]:
    if source.is_dir():
        found = {service: source / name for service, name in FILES.items() if (source / name).exists()}
        if not found:
            raise TraceError(f"{source}: neither {FILES['code']} nor {FILES['conv']} is there")
        return found
    for service in SERVICES:
        if service in source.name.lower():
            return {service: source}
    raise TraceError(f"{source}: cannot tell the service; the file name should contain 'code' or 'conv'")


def _rows(service: str, path: Path) -> Iterator[tuple[datetime, str, int, int, int]]:
    """(time, service, line, prompt tokens, output tokens), in file order."""
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}: missing column(s) {', '.join(missing)}")
        for row in reader:
            line = reader.line_num
            try:
                stamp = datetime.fromisoformat(row["TIMESTAMP"])
                prompt, output = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (TypeError, ValueError) as error:
                raise TraceError(f"{path} line {line}: {error}") from None
            yield stamp, service, line, prompt, output


class _Service:
    """The open pseudo-sessions of one service, ordered by history for the best-fit search."""

    def __init__(self, name: str, model: str) -> None:
        self.name = name
        self.model = model
        self.opened = 0
        self.by_history: list[tuple[int, str]] = []

    def assign(self, prompt: int, sessions: IdleSessions) -> tuple[str, int]:
        """The session this prompt continues (or a new one) and its history before the turn."""
        while True:
            i = bisect.bisect_right(self.by_history, (prompt, "\uffff")) - 1
            if i < 0:
                break
            history, session = self.by_history.pop(i)
            if sessions.is_open(session):
                return session, history
            # else it ended while idle: forget it and look again
        self.opened += 1
        return f"{self.name}-{self.opened}", 0

    def update(self, session: str, history: int) -> None:
        bisect.insort(self.by_history, (history, session))


class AzureImporter:
    def records(self, source: Path, scenario: Scenario, options: ImportOptions) -> Iterator[TraceRecord]:
        models = dict(zip(SERVICES, pick_models(scenario, options.models, default_models(scenario)), strict=True))
        if len(models) < 2:
            models["conv"] = models["code"]
        paths = _sources(source)
        starts = []
        for service, path in paths.items():
            first = next(_rows(service, path), None)
            if first is not None:
                starts.append(first[0])
        if not starts:
            return
        origin = min(starts)
        timeout = options.idle_timeout_seconds or DEFAULT_IDLE_TIMEOUT_SECONDS
        sessions = IdleSessions(timeout)
        services = {name: _Service(name, models[name]) for name in paths}
        chain = HandoffChain(scenario) if options.handoffs else None
        merged = heapq.merge(*(_rows(service, path) for service, path in paths.items()), key=lambda row: row[0])
        last = 0.0
        for stamp, service, line, prompt, output in islice(merged, options.limit):
            t = round((stamp - origin).total_seconds(), 3)
            check_order(t, last, f"{paths[service]} line {line}")
            last = t
            yield from sessions.expire(t)
            state = services[service]
            session, history = state.assign(prompt, sessions)
            new_input = new_input_tokens(prompt, history)
            state.update(session, history + new_input + output)
            sessions.touch(session, t)
            yield TraceRequest(
                t=t,
                session=session,
                model=chain.model(session, state.model) if chain else state.model,
                input_tokens=new_input,
                output_tokens=output,
                slo=SLOS[service],
            )
        yield from sessions.close_all()
