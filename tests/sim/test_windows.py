"""Real traces in the seed study: windows of whole sessions, bootstrap intervals over sessions, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from planner_service.cli import app
from planner_service.domain.demo import demo_scenario
from planner_service.domain.scenario import Slo
from planner_service.sim.engine import SimRequest
from planner_service.sim.evidence import render
from planner_service.sim.fit import fit_trace
from planner_service.sim.synth import SynthParams, synth_trace
from planner_service.sim.trace import TraceEnd, TraceRequest, write_trace_stream
from planner_service.sim.windows import bootstrap, load_trace, window_study, windows

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def req(t: float, session: str, model: str = "coder", parent: str | None = None) -> TraceRequest:
    return TraceRequest(t=t, session=session, model=model, input_tokens=10, output_tokens=5, parent=parent)


def test_windows_hold_whole_sessions_from_their_first_request_each_from_zero() -> None:
    records = [
        req(10, "a"),
        req(3500, "a"),  # a's later turn stays in a's window
        req(3700, "b"),
        req(3800, "b.k1", "planner", parent="b"),
        TraceEnd(t=3900, session="a", event="end"),
        req(7300, "b.k1", "planner"),  # a sub-agent stays in its parent's window
        TraceEnd(t=7400, session="b", event="end"),
        TraceEnd(t=7400, session="b.k1", event="end"),
    ]
    first, second = windows(records, 1.0)
    assert [(r.session, r.t) for r in first] == [("a", 10), ("a", 3500), ("a", 3900)]
    assert [(r.session, r.t) for r in second] == [
        ("b", 100),
        ("b.k1", 200),
        ("b.k1", 3700),
        ("b", 3800),
        ("b.k1", 3800),
    ]
    with pytest.raises(ValueError, match="hours"):
        windows(records, 0)


def served(session: str, switch: float, *, handoff: bool = True, state: str = "done") -> SimRequest:
    r = SimRequest(0, 0.0, session, "coder", 10, 5, Slo.INTERACTIVE, handoff, state=state)
    r.switch_seconds, r.ttft_seconds, r.admitted_at, r.done_at = switch, switch, 0.0, switch + 1
    return r


def test_the_bootstrap_reads_the_metric_as_replayed_and_resamples_whole_sessions() -> None:
    same = [[served("a", 1.0), served("a", 1.0)], [served("b", 1.0)]]
    boot = bootstrap(same, resamples=50)
    assert (boot["handoff_p95_seconds"].low, boot["handoff_p95_seconds"].high) == (1.0, 1.0)
    sessions = [[served(f"s{i}", float(i)), served(f"s{i}", float(i), state="failed")] for i in range(40)]
    boot = bootstrap(sessions, resamples=400)
    p95 = boot["handoff_p95_seconds"]
    assert p95.mean == pytest.approx(np.percentile(np.arange(40.0), 95))  # the requests served, as summarize reads
    assert p95.low < p95.mean <= p95.high <= 39.0
    # every resample draws 40 sessions of one failed request each: the count never moves
    assert (boot["failed_requests"].mean, boot["failed_requests"].low, boot["failed_requests"].high) == (40, 40, 40)
    assert p95.to_json()["method"] == "bootstrap" and p95.label(1).startswith("37.0 [")


@pytest.fixture(scope="module")
def small_trace():
    """An hour of three sessions on the demo, 30 % hand-offs to fresh sub-agents."""
    params = SynthParams(sessions=3, hours=1.0, handoff_rate=0.3, context="fresh", gap_scale=8)
    return synth_trace(demo_scenario(), params, np.random.default_rng(4))


def test_a_window_study_bootstraps_the_request_metrics_and_t_intervals_the_rest(small_trace) -> None:
    study = window_study(demo_scenario(), small_trace, "synthetic", 0.5, ["sleep-router"], [1], [0], tune_budget=2)
    (run,) = study.runs["sleep-router"]
    metrics = study.intervals["sleep-router"]
    assert run["window"] == 1
    # one window: the bootstrap's statistic is the replay's own figure; the per-replay metrics have no interval
    assert metrics["handoff_p95_seconds"].mean == pytest.approx(run["handoff_p95_seconds"], abs=1e-5)
    assert metrics["handoff_p95_seconds"].low <= run["handoff_p95_seconds"] <= metrics["handoff_p95_seconds"].high
    assert np.isnan(metrics["gpu_gib_mean"].half_width)
    data = study.to_json()
    assert data["trace"] == {"source": "synthetic", "hours": 0.5, "sessions": study.sessions}
    assert study.sessions == len({r.session for r in windows(small_trace, 0.5)[1] if "." not in r.session})


def test_training_windows_stay_apart_and_a_missing_window_is_named(small_trace) -> None:
    with pytest.raises(ValueError, match="train windows: 1 also reported"):
        window_study(demo_scenario(), small_trace, "s", 0.5, ["static-tuned"], [1], [1])
    with pytest.raises(ValueError, match="windows: 7 hold no session"):
        window_study(demo_scenario(), small_trace, "s", 0.5, ["sleep-router"], [7], [])


def test_the_cli_replays_a_trace_file_and_the_evidence_page_renders_it(small_trace, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace_stream(path, small_trace)
    args = ["study", "seeds", "--trace", str(path), "--hours", "0.5", "--seeds", "1", "--train-seeds", "0"]
    args += ["--policies", "sleep-router,static-tuned", "--tune-budget", "2", "--precision", "native", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    stored = tmp_path / "real.json"
    stored.write_text(result.stdout)
    level = json.loads(result.stdout)["levels"][0]
    assert level["trace"]["source"] == str(path) and level["train_seeds"] == [0]
    page = render([stored])
    assert f"The real trace `{path}` replayed as it is" in page and "training windows 0" in page
    assert "static-tuned: trained on windows 0" in page
    hand_off = level["metrics"]["sleep-router"]["handoff_p95_seconds"]
    assert f"{hand_off['mean']:.2f} [{hand_off['low']:.2f}, {hand_off['high']:.2f}]" in page
    result = CliRunner().invoke(app, ["study", "seeds", "--trace", "kaggle", "--seeds", "1", "--train-seeds", ""])
    assert result.exit_code == 2 and "kaggle is neither a trace file nor one of" in result.output


@pytest.mark.skipif(not (TRACES / "alibaba_genai_2026").exists(), reason="../shared/traces is absent")
def test_the_alibaba_trace_by_name_cuts_into_days_and_fits() -> None:
    records = load_trace("alibaba", demo_scenario(), TRACES)
    days = windows(records, 24.0)
    assert len(days) == 24  # 23 days and a little (SOURCE.md: 2024-11-15 16:57 to 12-08 17:33)
    assert sum(isinstance(r, TraceRequest) for day in days for r in day) == 26_823  # every request, once
    # its fit (sim/fit.py): minutes between a group's requests, 24.9 % of later requests change model
    fit = fit_trace(records, "alibaba")
    assert 60 < fit.gap_seconds.median < 90 and fit.handoff_share == pytest.approx(0.249, abs=0.001)
