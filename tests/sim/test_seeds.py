"""Seeds and intervals: the t-interval by hand, training seeds kept apart, the study's shape."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from planner_service.cli import app
from planner_service.domain.demo import demo_scenario
from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.problem import native_precision_scenario
from planner_service.sim.intervals import t_critical, t_interval
from planner_service.sim.seeds import check_seeds, seed_study
from planner_service.sim.synth import SynthParams


def test_t_interval_by_hand() -> None:
    """[1, 2, 3]: mean 2, s = 1, t(0.975, 2) = 4.303, half width 4.303 / sqrt(3) = 2.4843."""
    interval = t_interval([1.0, 2.0, 3.0])
    assert (interval.mean, interval.n) == (2.0, 3)
    assert interval.half_width == pytest.approx(4.303 / math.sqrt(3), rel=1e-9)
    assert math.isnan(t_interval([5.0]).half_width) and t_interval([5.0]).label() == "5.00 (n=1)"


def test_t_critical_values() -> None:
    assert t_critical(1) == 12.706 and t_critical(9) == 2.262 and t_critical(30) == 2.042
    assert t_critical(45) == 2.021 and t_critical(500) == 1.980 and t_critical(5000) == 1.960
    with pytest.raises(ValueError, match="dof"):
        t_critical(0)


def test_training_seeds_stay_apart_from_reported_ones() -> None:
    with pytest.raises(ValueError, match="train_seeds: 2 also reported"):
        check_seeds([1, 2], [2, 7])
    with pytest.raises(ValueError, match="seeds: at least one"):
        check_seeds([], [7])


def test_a_study_reports_every_policy_on_every_seed() -> None:
    """Two 6-minute traces of three sessions on the demo; static-tuned trained on seed 9 with 2 replays."""
    params = SynthParams(sessions=3, hours=0.1, arrival_spread_seconds=60, departure_spread_seconds=60)
    study = seed_study(demo_scenario(), params, ["sleep-router", "static-tuned"], [1, 2], [9], tune_budget=2)
    assert set(study.intervals) == {"sleep-router", "static-tuned"}
    for name in study.policies:
        assert [r["seed"] for r in study.runs[name]] == [1, 2]
        assert study.intervals[name]["handoff_p95_seconds"].n == 2
    assert study.tuning is not None and study.tuning.replays <= 2
    data = study.to_json()
    assert data["train_seeds"] == [9] and data["static_tuned_search"]["space_size"] >= 1
    # failed requests are a metric; where the hand-offs' latency went is kept per policy, averaged over seeds
    assert data["metrics"]["sleep-router"]["failed_requests"]["n"] == 2
    for name in study.policies:
        parts = data["handoff_switch_parts"][name]
        for which in ("mean", "tail"):
            seeds = [r["handoff_switch_parts"][which] for r in data["runs"][name]]
            assert parts[which] == pytest.approx({k: sum(s[k] for s in seeds) / 2 for k in parts[which]}, abs=1e-5)


def test_the_cli_names_the_field_of_bad_seeds() -> None:
    result = CliRunner().invoke(app, ["study", "seeds", "--seeds", "1,2", "--train-seeds", "2"])
    assert result.exit_code == 2 and "train_seeds" in result.output
    result = CliRunner().invoke(app, ["study", "seeds", "--seeds", "one"])
    assert result.exit_code == 2 and "--seeds" in result.output


def test_the_cli_runs_a_study_per_load_level_with_precision_held_equal() -> None:
    """Two load levels (gaps x4 and x8) of a 6-minute trace of two sessions, on the demo at native precision."""
    args = ["study", "seeds", "--policies", "sleep-router,statebudget", "--seeds", "1", "--train-seeds", ""]
    args += ["--sessions", "2", "--gap-scale", "4,8", "--hours", "0.1", "--precision", "native", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["precision"] == "native" and data["scenario"] == "demo"
    assert [level["trace"]["gap_scale"] for level in data["levels"]] == [4.0, 8.0]
    for level in data["levels"]:
        assert all(run["degraded_share"] == 0.0 for runs in level["runs"].values() for run in runs)


def test_the_cli_names_the_field_of_a_bad_load_or_precision() -> None:
    result = CliRunner().invoke(app, ["study", "seeds", "--gap-scale", "slow"])
    assert result.exit_code == 2 and "--gap-scale" in result.output
    result = CliRunner().invoke(app, ["study", "seeds", "--gap-scale", "0", "--train-seeds", "", "--seeds", "1"])
    assert result.exit_code == 2 and "gap_scale" in result.output
    result = CliRunner().invoke(app, ["study", "seeds", "--precision", "best"])
    assert result.exit_code == 2 and "--precision" in result.output


def test_native_precision_leaves_each_model_its_preferred_precision_only() -> None:
    scenario = native_precision_scenario(demo_scenario())
    coder = next(m for m in scenario.models if m.id == "coder")
    assert [str(p) for p in coder.precisions or []] == ["bf16"]  # the demo also allows int4
    assert not [r for r in scenario.residency if r.object.model == "coder" and str(r.object.precision) == "int4"]
    assert problem_from_scenario(scenario).models["coder"].precisions == ("bf16",)


def test_the_cli_runs_a_level_per_handoff_rate_with_fresh_sub_agent_contexts() -> None:
    args = ["study", "seeds", "--policies", "sleep-router", "--seeds", "1", "--train-seeds", ""]
    args += ["--sessions", "2", "--hours", "0.1", "--handoff-rate", "0.05,0.5", "--context", "fresh", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    levels = json.loads(result.stdout)["levels"]
    assert [(lv["trace"]["handoff_rate"], lv["trace"]["context"]) for lv in levels] == [(0.05, "fresh"), (0.5, "fresh")]
    result = CliRunner().invoke(app, ["study", "seeds", "--context", "forked", "--train-seeds", "", "--seeds", "1"])
    assert result.exit_code == 2 and "context" in result.output
    result = CliRunner().invoke(app, ["study", "seeds", "--handoff-rate", "1.5", "--train-seeds", "", "--seeds", "1"])
    assert result.exit_code == 2 and "handoff_rate" in result.output


def test_the_cli_fits_the_synthetic_traces_to_a_trace_file(tmp_path) -> None:
    import numpy as np

    from planner_service.sim.synth import synth_trace
    from planner_service.sim.trace import write_trace_stream

    source = tmp_path / "slow.jsonl"
    slow = SynthParams(sessions=4, hours=1.0, human_turn_probability=0.0, tool_gap_median_seconds=60.0)
    write_trace_stream(source, synth_trace(demo_scenario(), slow, np.random.default_rng(1)))
    args = ["study", "seeds", "--policies", "sleep-router", "--seeds", "1", "--train-seeds", "", "--sessions", "2"]
    args += ["--hours", "0.1", "--fit", str(source), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    fit = json.loads(result.stdout)["levels"][0]["trace"]["fit"]
    assert fit["source"] == str(source) and fit["gap_seconds"]["median"] == pytest.approx(60.0, rel=0.1)
