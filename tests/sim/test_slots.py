"""Closed-loop session slots: a replay never runs more sessions at once than its trace has."""

from __future__ import annotations

import numpy as np
import pytest
from test_engine import GB, random_trace, tiny_scenario

from planner_service.domain.demo import demo_scenario
from planner_service.sim.engine import simulate
from planner_service.sim.policies import create_policy
from planner_service.sim.slots import saturated, trace_concurrency
from planner_service.sim.synth import SynthParams, synth_trace
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
    """Room for one model; swap-ttl cold-starts a (8 + 30 s), so s1's turn ends at 39 s; its end record,
    10 s after its turn in the trace, is due then (the answer came after the gap). s2 arrives at 20 s but
    takes the seat only at 39 s; its timeline moves by 19 s, and b cold-starts then (8 + 30 s)."""
    result = simulate(tiny_scenario(6 * GB), two_sessions_in_turn(), create_policy("swap-ttl"))
    s2 = result.requests[1]
    assert s2.admitted_at == pytest.approx(39.0, abs=1e-3)
    assert s2.switch_seconds == pytest.approx(38.0, abs=1e-3)
    assert result.extra["session_seats"] == 1 and result.extra["peak_open_sessions"] == 1
    open_loop = simulate(tiny_scenario(6 * GB), two_sessions_in_turn(), create_policy("swap-ttl"), closed_loop=False)
    assert open_loop.requests[1].admitted_at == pytest.approx(20.0)  # open loop: on schedule


def one_session_three_turns() -> list:
    """One session on model a: turns at 0, 10 and 100 s (1000 new tokens each, no output), its end at 150 s."""
    return [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=1000, output_tokens=0),
        TraceRequest(t=10.0, session="s1", model="a", input_tokens=1000, output_tokens=0),
        TraceRequest(t=100.0, session="s1", model="a", input_tokens=1000, output_tokens=0),
        TraceEnd(t=150.0, session="s1", event="end"),
    ]


def test_the_closed_loop_keeps_the_traces_gaps_from_each_arrival_and_never_counts_service_twice() -> None:
    """By hand, on the tiny scenario (NVMe 0.5 GB/s, prefill 1 ms/token, a cold start 30 s after the copy):

    turn 1 arrives at 0; swap-ttl cold-starts a: 4 GB / 0.5 GB/s = 8 s + 30 s, ready at 38; prefill of
    1000 tokens 1 s: done at 39 (and 0.768 ms: the step stores the prompt's 768 whole-chunk tokens to host
    DRAM at 1 GB/s, sim/kv_save.py). Turn 2 is due 10 s after turn 1 arrived, at 10, but the answer comes at
    39: it arrives then (lag 29 s), finds its 1000-token history in a's KV and prefills its own 1000
    tokens: done at 40 (+ 1.024 ms, storing tokens 768 to 1792). Turn 3 keeps its 90 s gap from turn 2's
    arrival: 100 + 29 = 129, done at 130 (+ 1.024 ms, tokens 1792 to 2816); the end, 50 s later in the trace,
    at 179. Waiting the gap after each answer (start-to-start gap plus the replay's service) would have put
    turn 2 at 49 and turn 3 at 140.
    """
    result = simulate(tiny_scenario(10 * GB), one_session_three_turns(), create_policy("swap-ttl"))
    assert [r.admitted_at for r in result.requests] == pytest.approx([0.0, 39.0, 129.0], abs=1e-3)
    assert [r.done_at for r in result.requests] == pytest.approx([39.000768, 40.001792, 130.001792], abs=1e-6)
    assert result.duration_seconds == pytest.approx(179.0, abs=1e-3)
    assert saturated(result.duration_seconds, 150.0)  # 179 s > 1.05 x 150 s
    # open loop: each turn at its trace time, after the previous answer
    open_loop = simulate(
        tiny_scenario(10 * GB), one_session_three_turns(), create_policy("swap-ttl"), closed_loop=False
    )
    assert [r.admitted_at for r in open_loop.requests] == pytest.approx([0.0, 39.0, 100.0], abs=1e-3)


def test_every_synthetic_session_takes_a_seat() -> None:
    """The synthetic generator writes an end record for every session, so none runs outside the seats."""
    records = synth_trace(demo_scenario(), SynthParams(sessions=4, hours=0.5), np.random.default_rng(3))
    sessions = {r.session for r in records}
    ended = {r.session for r in records if isinstance(r, TraceEnd)}
    assert sessions == ended
    assert 1 <= trace_concurrency(records) <= 4  # a slot opens its next session only after its last one ended


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
