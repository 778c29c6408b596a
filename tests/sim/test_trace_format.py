"""The trace format: round trips, errors that name the line and field, and a current JSON Schema."""

from pathlib import Path

import jsonschema
import pytest

from planner_service.domain.scenario import Slo
from planner_service.schemas import render
from planner_service.sim.trace import (
    TraceEnd,
    TraceError,
    TraceRequest,
    iter_trace,
    read_trace,
    trace_json_schema,
    write_trace,
    write_trace_stream,
)

SCHEMA_FILE = Path(__file__).resolve().parents[2] / "schemas" / "trace.schema.json"


def records():
    return [
        TraceRequest(
            t=5.0, session="s2", model="coder", input_tokens=10, output_tokens=2, slo=Slo.BLOCKING, user="bob"
        ),
        TraceRequest(t=0.5, session="s1", model="planner", input_tokens=900, output_tokens=300),
        TraceEnd(t=9.0, session="s1", event="end"),
    ]


def test_write_sorts_and_read_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    assert write_trace(path, records()) == 3
    back = read_trace(path)
    assert [r.t for r in back] == [0.5, 5.0, 9.0]
    assert back[0].slo is Slo.INTERACTIVE and back[0].user is None  # the defaults
    assert back[1] == records()[0]
    assert '"user"' not in path.read_text().splitlines()[0]  # None fields are left out


def test_stream_writer_counts_and_refuses_going_back(tmp_path: Path) -> None:
    ordered = sorted(records(), key=lambda r: r.t)
    summary = write_trace_stream(tmp_path / "t.jsonl", ordered)
    assert summary.to_json() == {
        "requests": 2,
        "sessions": 2,
        "ends": 1,
        "models": {"coder": 1, "planner": 1},
        "duration_seconds": 9.0,
    }
    with pytest.raises(TraceError, match="record 2: t=0.5 goes back"):
        write_trace_stream(tmp_path / "u.jsonl", records())


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"t": 1, "session": "s", "model": "m", "input_tokens": -5, "output_tokens": 1}', "input_tokens"),
        ('{"t": 1, "session": "s", "input_tokens": 5, "output_tokens": 1}', "model"),
        ('{"t": 1, "session": "s", "model": "m", "input_tokens": 5, "output_tokens": 1, "slo": "urgent"}', "slo"),
        ('{"t": 1, "session": "s", "event": "stop"}', "event"),
        ("{not json", "not JSON"),
    ],
)
def test_malformed_line_names_line_and_field(tmp_path: Path, line: str, expected: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t": 0, "session": "s", "model": "m", "input_tokens": 1, "output_tokens": 1}\n' + line + "\n")
    with pytest.raises(TraceError) as caught:
        read_trace(path)
    assert "line 2" in str(caught.value) and expected in str(caught.value)


def test_time_going_back_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "unsorted.jsonl"
    path.write_text('{"t": 5, "session": "s", "event": "end"}\n{"t": 1, "session": "s", "event": "end"}\n')
    with pytest.raises(TraceError, match="line 2: t=1.0 goes back"):
        list(iter_trace(path))


def test_schema_file_is_current_and_accepts_records() -> None:
    assert SCHEMA_FILE.read_text() == render(trace_json_schema()), "run `statebudget export-schemas`"
    schema = trace_json_schema()
    for record in records():
        jsonschema.validate(record.model_dump(mode="json", exclude_none=True), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"t": 1, "session": "s", "model": "m", "input_tokens": 1}, schema)
