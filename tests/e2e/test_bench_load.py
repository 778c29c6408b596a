"""`statebudget bench load` against a real server, briefly: every event acknowledged, no error, and the
warm-up's latencies (every agent and lane connecting at once) kept apart from the measured ones."""

from __future__ import annotations

from planner_service.bench_load import LoadConfig, run_phase


def test_a_short_load_phase_acknowledges_every_event_and_reports_the_warmup_apart():
    config = LoadConfig(
        agents=4, events_per_s=100.0, duration_seconds=4.0, warmup_seconds=1.0, replan_every_seconds=2.0
    )
    figures = run_phase(config)
    assert figures["errors_total"] == 0, figures["errors"]
    events = figures["events"]
    assert events["sent"] == events["acknowledged"] > 0
    measured = events["requests"] - figures["warmup"]["events"]["requests"]
    assert figures["warmup"]["events"]["requests"] > 0 and measured > 0
    assert events["p99_ms"] is not None and figures["warmup"]["events"]["p99_ms"] is not None
    assert figures["lease"]["polls"] + figures["warmup"]["lease"]["requests"] > 0
    assert figures["client_loop_lag"]["samples"] > 0
    assert figures["server"]["replans"]  # the server's counters were scraped
