"""`statebudget study h1|h3|pareto` on a small case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner_service.cli import app
from planner_service.domain.demo import demo_scenario
from planner_service.sim.studies import study_h1, study_h3, study_pareto
from planner_service.sim.trace import TraceEnd, TraceRequest, write_trace


def trace():
    return [
        TraceRequest(t=0.0, session="s1", model="coder", input_tokens=10_000, output_tokens=1000),
        TraceRequest(t=10.0, session="s2", model="planner", input_tokens=4000, output_tokens=0),
        TraceRequest(t=20.0, session="s1", model="reasoner", input_tokens=1000, output_tokens=0),
        TraceEnd(t=30.0, session="s2", event="end"),
        TraceRequest(t=40.0, session="s1", model="coder", input_tokens=1000, output_tokens=0),
    ]


def test_h1_pooling_never_needs_more_than_per_model_pools(tmp_path: Path) -> None:
    result = study_h1(demo_scenario(), trace(), tmp_path)
    data = result.data
    assert data["pooling_gain"] >= 1.0
    assert data["pooled_peak_bytes"] <= data["sum_of_peaks_bytes"]
    # a session's KV on its model is its whole history including the current turn:
    # coder at 40 s: 11000 + 1000 + 1000 tokens * 262144 B; planner: 4000 * 131072 B
    assert data["per_model_peak_kv_bytes"]["coder"] == 13_000 * 262_144
    assert data["per_model_peak_kv_bytes"]["planner"] == 4000 * 131_072
    assert result.plot.exists()


def test_h3_names_the_first_killer(tmp_path: Path) -> None:
    result = study_h3(demo_scenario(), trace(), tmp_path)
    assert result.data["first_killer"] in ("weights", "kv")  # the demo's catalog exceeds its HBM
    assert result.data["rows"][0]["added"] == "coder"  # the most requested model is warmed first
    assert result.plot.exists()


def test_pareto_trades_gpu_bytes_for_latency(tmp_path: Path) -> None:
    result = study_pareto(demo_scenario(), trace(), tmp_path, prices=(0.0, 5.0))
    cheap, dear = result.data["points"]
    assert cheap["gpu_bytes_mean"] >= dear["gpu_bytes_mean"]
    assert result.plot.exists()


@pytest.mark.parametrize("kind", ["h1", "h3"])
def test_study_cli(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, trace())
    result = CliRunner().invoke(app, ["study", kind, "--trace", str(path), "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    json.loads(result.stdout)
    assert (tmp_path / f"{kind}.png").exists()
