"""The reliability trials of `make soak`, bounded: `statebudget serve` as a real process under agents and
events, restarted; SIGKILLed under mixed load; and sent the bad inputs of the reliability issue."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner_service.soak.faults import run_faults
from planner_service.soak.fuzz import run_fuzz
from planner_service.soak.report import Results, render
from planner_service.soak.trials import (
    KillConfig,
    LoadConfig,
    LoadResult,
    run_kill_trials,
    run_load,
    write_large_scenario,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def explain(r: LoadResult) -> str:
    return render(Results([r], None, [], r.seconds), Path.cwd())


def assert_held(r: LoadResult) -> None:
    assert r.error is None, explain(r)
    assert r.events_sent > 0 and r.events_acked == r.events_sent and r.events_lost == 0, explain(r)
    assert r.reports_done > 0 and r.replay_applied == r.reports_done - len(r.conflicts), explain(r)
    assert r.watch_rounds > 0 and r.capacity_violations == 0, explain(r)
    assert not r.double_applied and not r.resent_not_duplicate and not r.source_short, explain(r)
    assert not r.placement_differences, explain(r)
    assert r.tally.status_5xx() == 0, explain(r)
    assert r.restart_ok and r.quarantine == 0, explain(r)
    assert r.ok, explain(r)


def test_demo_under_agents_and_events_keeps_its_invariants_and_restarts(tmp_path: Path) -> None:
    """F1's scenario: 12 agents on the demo's 4 nodes, 50 events/s from 200 sessions."""
    r = run_load(LoadConfig("demo", duration_seconds=10.0, agents_per_node=3), tmp_path)
    assert (r.nodes, r.agents) == (4, 12)
    assert_held(r)


def test_a_50_node_cluster_under_agents_and_events_keeps_its_invariants_and_restarts(tmp_path: Path) -> None:
    scenario = write_large_scenario(tmp_path / "cluster.json", 50, seed=3)
    config = LoadConfig("50-nodes", seed=("--scenario", str(scenario)), duration_seconds=5.0, agents_per_node=1)
    r = run_load(config, tmp_path)
    assert (r.nodes, r.gpus, r.agents) == (50, 200, 50)
    assert_held(r)


def test_sigkill_loses_nothing_acknowledged_and_applies_nothing_twice(tmp_path: Path) -> None:
    result = run_kill_trials(KillConfig(trials=2, min_load_seconds=0.5, max_load_seconds=1.5), tmp_path)
    assert result.error is None, result.error
    assert len(result.trials) == 2
    for t in result.trials:
        assert t.ok, t
    assert result.total("events_acked") > 0 and result.total("reports_acked") > 0
    assert result.total("events_lost") == result.total("reports_lost") == result.total("double_applied") == 0
    assert result.alarms["tracebacks"] == 0


def test_the_fault_cases_are_refused_and_change_nothing(tmp_path: Path) -> None:
    cases = run_faults(tmp_path)
    failed = [c for c in cases if not c.ok and not c.open]
    assert not failed, failed
    assert {c.issue for c in cases} == {"F2", "F3", "F5", "F6", "F7"}
    assert len(cases) >= 14


def test_schemathesis_against_a_real_server_finds_nothing_and_is_reported(tmp_path: Path) -> None:
    runs = run_fuzz(tmp_path, examples=2, stateful_examples=5, stateful_steps=4, seed=3)
    assert [r.label for r in runs] == ["open", "tokens"]
    for r in runs:
        assert r.ok, r.failures
        assert all(r.requests.get(phase, 0) > 0 for phase in ("coverage", "fuzzing")), r.requests
    page = render(Results([], None, [], 1.0, runs), Path.cwd())
    assert "## Fuzzing" in page and "| tokens |" in page and "result: ok" in page
