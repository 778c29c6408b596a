"""Closed-loop session slots: a replay never runs more sessions at once than its trace has."""

from __future__ import annotations

import pytest
from test_engine import GB, random_trace, tiny_scenario

from planner_service.domain.demo import demo_scenario
from planner_service.sim.engine import simulate
from planner_service.sim.policies import create_policy
from planner_service.sim.slots import saturated, trace_concurrency
from planner_service.sim.trace import TraceEnd, TraceRequest


def two_sessions_in_turn() -> list:
    """s1 at 0-10 s, s2 at 20-30 s: one session at a time in the trace."""
    return [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=1000, output_tokens=0),
        TraceEnd(t=10.0, session="s1", event="end"),
        TraceRequest(t=20.0, session="s2", model="b", input_tokens=1000, output_tokens=0),
        TraceEnd(t=30.0, session="s2", event="end"),
    ]


def test_trace_concurrency_counts_sessions_open_at_once() -> None:
    assert trace_concurrency(two_sessions_in_turn()) == 1
    assert trace_concurrency([r.model_copy(update={"t": 0.0}) for r in two_sessions_in_turn()]) == 2
    # a session without an end record has no known length: it takes no seat
    assert trace_concurrency([r for r in two_sessions_in_turn() if isinstance(r, TraceRequest)]) == 0


def test_a_session_waits_for_the_seat_of_the_one_before() -> None:
    """Room for one model; swap-ttl cold-starts a (8 + 30 s), so s1's turn ends at 39 s and its end record,
    10 s after its turn in the trace, is due at 49 s (the lag of 39 s). s2 arrives at 20 s but takes the
    seat only at 49 s; its timeline moves by 29 s, and b cold-starts then (8 + 30 s)."""
    result = simulate(tiny_scenario(6 * GB), two_sessions_in_turn(), create_policy("swap-ttl"))
    s2 = result.requests[1]
    assert s2.admitted_at == pytest.approx(49.0, abs=1e-3)
    assert s2.switch_seconds == pytest.approx(38.0, abs=1e-3)
    assert result.extra["session_seats"] == 1 and result.extra["peak_open_sessions"] == 1
    open_loop = simulate(tiny_scenario(6 * GB), two_sessions_in_turn(), create_policy("swap-ttl"), closed_loop=False)
    assert open_loop.requests[1].admitted_at == pytest.approx(20.0)  # open loop: on schedule


@pytest.mark.parametrize("policy", ["statebudget", "sleep-router", "swap-ttl", "static", "lru"])
def test_closed_loop_never_exceeds_the_traces_concurrency(policy: str) -> None:
    scenario = demo_scenario()
    records = [r for r in random_trace([m.id for m in scenario.models], sessions=4, requests=40, seed=5)]
    ends = {}
    for r in records:
        ends[r.session] = r.t + 30.0  # every session ends 30 s after its last turn
    records = sorted(
        [r for r in records if isinstance(r, TraceRequest)]
        + [TraceEnd(t=t, session=sid, event="end") for sid, t in ends.items()],
        key=lambda r: r.t,
    )
    assert trace_concurrency(records) >= 2
    result = simulate(scenario, records, create_policy(policy))
    assert result.extra["peak_open_sessions"] <= trace_concurrency(records)
    assert all(r.state == "done" for r in result.requests)


def test_a_run_that_overruns_the_trace_by_more_than_five_percent_is_saturated() -> None:
    assert not saturated(105.0, 100.0)
    assert saturated(105.1, 100.0)
