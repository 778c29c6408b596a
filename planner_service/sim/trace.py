"""The agent trace format: JSON Lines, sorted by time.

One object a line, either a request

    {"t": 12.5, "session": "s1", "model": "coder", "input_tokens": 900, "output_tokens": 300,
     "slo": "interactive", "user": "alice"}

or the end of a session

    {"t": 80.0, "session": "s1", "event": "end"}

`t` is seconds from the start of the trace; `slo` defaults to interactive and
`user` to the session id. A session's history grows by each turn's input and
output tokens, whichever model served it. A model's KV for a session covers
the history up to that model's last turn in it, while retained; a turn on
model M must prefill the history M's retained KV does not cover.

A sub-agent with a context of its own is a session of its own whose first request
names the session that handed off to it (`"parent": "s1"`); its history is its own
turns only, and a hand-off is counted across the two (a change of model between
the last turn that arrived in either and the next).
`schemas/trace.schema.json` is generated from these classes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from planner_service.domain.scenario import Slo, format_validation_error


class TraceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    t: Annotated[float, Field(ge=0, description="Seconds from the start of the trace.")]
    session: str = Field(min_length=1)
    model: str = Field(min_length=1)
    input_tokens: Annotated[int, Field(ge=0)]
    output_tokens: Annotated[int, Field(ge=0)]
    slo: Slo = Slo.INTERACTIVE
    user: str | None = None
    parent: str | None = Field(
        default=None,
        min_length=1,
        description="On a sub-agent session's first request: the session that handed off to it (a fresh context).",
    )


class TraceEnd(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    t: Annotated[float, Field(ge=0)]
    session: str = Field(min_length=1)
    event: Literal["end"]


TraceRecord = TraceRequest | TraceEnd
_RECORD = TypeAdapter(TraceRecord)


class TraceError(ValueError):
    """A trace line that does not parse; the message names the line and field."""


def by_workflow(records: Iterable[TraceRecord]) -> Iterator[tuple[str, TraceRequest]]:
    """Each request of a trace, in order, with its workflow: the session that began it, whose sub-agents
    (`parent`) it hands off to, as the simulator counts hand-offs."""
    root: dict[str, str] = {}
    for r in records:
        if isinstance(r, TraceRequest):
            if r.session not in root:
                root[r.session] = root.get(r.parent, r.parent) if r.parent else r.session
            yield root[r.session], r


def trace_json_schema() -> dict:
    schema = _RECORD.json_schema()
    schema["title"] = "StateBudget agent trace record (one per line, JSON Lines, sorted by t)"
    return schema


def parse_record(data: dict, line: int = 0) -> TraceRecord:
    try:
        return _RECORD.validate_python(data)
    except ValidationError as error:
        raise TraceError(f"line {line}: {format_validation_error(error)}") from None


def iter_trace(path: Path) -> Iterator[TraceRecord]:
    """Read records, checking that time never goes backwards."""
    last = 0.0
    with path.open() as fh:
        for number, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                data = json.loads(text)
            except json.JSONDecodeError as error:
                raise TraceError(f"line {number}: not JSON: {error.msg}") from None
            record = parse_record(data, number)
            if record.t < last:
                raise TraceError(f"line {number}: t={record.t} goes back in time (previous {last}); sort the trace")
            last = record.t
            yield record


def read_trace(path: Path) -> list[TraceRecord]:
    return list(iter_trace(path))


def write_trace(path: Path, records: Iterable[TraceRecord]) -> int:
    """Write records sorted by time (stable); returns how many were written."""
    ordered = sorted(records, key=lambda r: r.t)
    with path.open("w") as fh:
        for record in ordered:
            fh.write(record.model_dump_json(exclude_none=True) + "\n")
    return len(ordered)


@dataclass
class TraceSummary:
    """Counts of a trace, gathered while it is written or read."""

    requests: int = 0
    ends: int = 0
    sessions: set[str] = field(default_factory=set)
    models: dict[str, int] = field(default_factory=dict)  # model -> requests
    duration_seconds: float = 0.0

    def add(self, record: TraceRecord) -> None:
        self.sessions.add(record.session)
        self.duration_seconds = max(self.duration_seconds, record.t)
        if isinstance(record, TraceEnd):
            self.ends += 1
        else:
            self.requests += 1
            self.models[record.model] = self.models.get(record.model, 0) + 1

    def to_json(self) -> dict:
        return {
            "requests": self.requests,
            "sessions": len(self.sessions),
            "ends": self.ends,
            "models": dict(sorted(self.models.items(), key=lambda kv: (-kv[1], kv[0]))),
            "duration_seconds": round(self.duration_seconds, 3),
        }


def write_trace_stream(path: Path, records: Iterable[TraceRecord]) -> TraceSummary:
    """Write records that arrive already in time order, one at a time (for large imports).

    Raises TraceError when a record goes back in time; the file then holds the records before it.
    """
    summary = TraceSummary()
    last = 0.0
    with path.open("w") as fh:
        for number, record in enumerate(records, start=1):
            if record.t < last:
                raise TraceError(f"record {number}: t={record.t} goes back in time (previous {last})")
            last = record.t
            fh.write(record.model_dump_json(exclude_none=True) + "\n")
            summary.add(record)
    return summary
