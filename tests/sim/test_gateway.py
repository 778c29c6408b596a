"""The gateway model in the replay (sim/gateway.py): warm-ups on idle cards, checked by hand on one GPU."""

from __future__ import annotations

import json

import pytest
from test_engine import random_trace, tiny_scenario

from planner_service.planner.gateway_directives import DirectiveLimits
from planner_service.settings import Settings
from planner_service.sim.engine import SimResult, simulate
from planner_service.sim.evidence import render_section
from planner_service.sim.gateway import DEFAULT_LIMITS
from planner_service.sim.gateway_study import gateway_study, synthetic
from planner_service.sim.policies import create_policy
from planner_service.sim.synth import SynthParams
from planner_service.sim.trace import TraceEnd, TraceRecord, TraceRequest

# the tiny scenario has two models: warm the one a session is not on, whatever the predictor's odds
ANY_HANDOFF = DirectiveLimits(max_warmups_per_instance=2, min_probability=0.0, target="handoff")


def run(records: list[TraceRecord], gateway: str) -> SimResult:
    """`static` (a and b both on the one 10 GB GPU from t=0), prefill 1 ms a token (tests/sim/test_engine.py)."""
    return simulate(tiny_scenario(), records, create_policy("static"), gateway=gateway, gateway_limits=ANY_HANDOFF)


def test_a_warm_up_in_the_tool_call_leaves_the_hand_off_nothing_to_prefill() -> None:
    """s1's turn on a prefills 1,000 tokens, t=0 to 1, and its step stores 768 of them to host DRAM, 0.768 ms
    (sim/kv_save.py: whole 256-token chunks at 1 GB/s). In its tool call (to t=100) the card is idle: the warm-up
    prefills the 1,000-token history on b and stores 768 of it, t=1.000768 to 2.001536. The hand-off to b at
    t=100 finds it: switch 0 s instead of the 1 s re-prefill, then 1 s of input and the store of the 1792 - 768
    = 1024 tokens of its 2000-token prompt not in host DRAM yet, 1.024 ms (without the warm-up all 1792,
    1.792 ms). GPU bytes: a's and b's 4 GB weights and s1's 1 MB of KV on a throughout, the run ending at
    t=101.001024 instead of 102.001792; s1's KV on b, 1 MB from t=1.000768 instead of t=100, then 2 MB for the
    hand-off until the end."""
    records: list[TraceRecord] = [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=1000, output_tokens=0),
        TraceRequest(t=100.0, session="s1", model="b", input_tokens=1000, output_tokens=0),
    ]
    plain, warmed = run(records, "none"), run(records, "affinity+warmups")
    assert plain.requests[1].handoff and plain.requests[1].switch_seconds == pytest.approx(1.0)
    assert warmed.requests[1].switch_seconds == pytest.approx(0.0)
    assert warmed.requests[1].reprefill_tokens == 0
    gateway = warmed.extra["gateway"]
    assert (gateway["warmups_started"], gateway["warmups_completed"], gateway["warmups_used"]) == (1, 1, 1)
    assert gateway["warmups_cancelled"] == 0 and gateway["warmup_prefill_seconds"] == pytest.approx(1.001)
    assert warmed.duration_seconds == pytest.approx(101.001024) and plain.duration_seconds == pytest.approx(102.001792)
    warmed_bytes = 8.001e9 * 101.001024 + 1e6 * (100 - 1.000768) + 2e6 * 1.001024
    plain_bytes = 8.001e9 * 102.001792 + 2e6 * 2.001792
    assert warmed.gpu_byte_seconds - plain.gpu_byte_seconds == pytest.approx(warmed_bytes - plain_bytes)


def test_the_priced_default_warms_only_where_the_saving_pays_for_the_room() -> None:
    """The trace above under the service's default target: the warm-up of b spares an expected p * w * 1 s of
    re-prefill for 1 MB of KV, 0.02 s a GiB (1.9e-5 s): it runs and is used. At 1e4 s a GiB (9.3 s for the MB)
    no probability and SLO weight (at most 4, and 1 s under every target: no penalty) pays for it."""
    records: list[TraceRecord] = [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=1000, output_tokens=0),
        TraceRequest(t=100.0, session="s1", model="b", input_tokens=1000, output_tokens=0),
    ]
    scenario = tiny_scenario()
    warmed = simulate(scenario, records, create_policy("static"), gateway="affinity+warmups")
    assert warmed.extra["gateway"]["warmups_used"] == 1 and warmed.requests[1].switch_seconds == pytest.approx(0.0)
    dear = scenario.model_copy(
        update={"constants": scenario.constants.model_copy(update={"gpu_price_seconds_per_gib": 1e4})}
    )
    plain = simulate(dear, records, create_policy("static"), gateway="affinity+warmups")
    assert plain.extra["gateway"]["warmups_started"] == 0 and plain.requests[1].switch_seconds == pytest.approx(1.0)


def test_a_real_request_cancels_the_warm_up_on_its_card_and_waits_for_nothing() -> None:
    """s1's turn on a ends at t=5.004864 (5,000 tokens, and the store of 4864 of them to host DRAM, 4.864 ms); its
    warm-up on b would take the card from then for 5 s. s2 asks b at t=7: the warm-up gives way at once (its KV
    freed), s2 prefills at t=7 as without the gateway (1 s, and 0.768 ms of store), and the warm-up is not tried
    again in that tool call: s1's hand-off at t=100 re-prefills its history as without it."""
    records: list[TraceRecord] = [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=5000, output_tokens=0),
        TraceRequest(t=7.0, session="s2", model="b", input_tokens=1000, output_tokens=0),
        TraceEnd(t=7.5, session="s2", event="end"),  # s2 leaves after its answer: no tool call of its own to warm
        TraceRequest(t=100.0, session="s1", model="b", input_tokens=10, output_tokens=0),
    ]
    plain, warmed = run(records, "none"), run(records, "affinity+warmups")
    for mine, theirs in zip(warmed.requests, plain.requests, strict=True):
        assert (mine.started_at, mine.ttft_seconds, mine.done_at) == (
            theirs.started_at,
            theirs.ttft_seconds,
            theirs.done_at,
        )
    s2 = warmed.requests[1]
    assert s2.prefill_queue_seconds == 0.0 and s2.ttft_seconds == pytest.approx(1.000768)
    assert warmed.requests[2].switch_seconds == pytest.approx(5.0)
    gateway = warmed.extra["gateway"]
    assert (gateway["warmups_started"], gateway["warmups_cancelled"], gateway["warmups_used"]) == (1, 1, 0)
    assert gateway["cancelled_by"] == {"request": 1}
    assert gateway["cancelled_prefill_seconds"] == pytest.approx(1.995, abs=1e-3)  # t=5.004864 to 7
    # the cancelled warm-up's KV was on the card t=5.004864 to 7 only: 5,000 tokens x 1,000 B x 1.995136 s
    assert warmed.gpu_byte_seconds - plain.gpu_byte_seconds == pytest.approx(5000 * 1000 * 1.995136)


def test_affinity_replays_as_none_with_one_engine_per_model() -> None:
    """The replay serves each model from one instance, the only one that can hold a session's KV of it: the
    affinity rule has no other instance to choose, so the replay is the same request by request."""
    records = random_trace(["a", "b"], sessions=3, requests=30, seed=5)
    plain = simulate(tiny_scenario(6 * 10**9), records, create_policy("statebudget"), gateway="none")
    routed = simulate(tiny_scenario(6 * 10**9), records, create_policy("statebudget"), gateway="affinity")
    assert [(r.switch_seconds, r.done_at) for r in routed.requests] == [
        (r.switch_seconds, r.done_at) for r in plain.requests
    ]
    assert routed.gpu_byte_seconds == plain.gpu_byte_seconds
    assert routed.extra["gateway"]["warmups_started"] == 0


def test_the_replay_s_directive_limits_are_the_service_s_defaults() -> None:
    settings = Settings()
    assert DEFAULT_LIMITS.max_warmups_per_instance == settings.warmups_per_instance
    assert DEFAULT_LIMITS.min_probability == settings.warmup_min_probability
    assert DEFAULT_LIMITS.target == settings.warmup_target == "priced"


def test_the_study_pairs_each_arm_with_none_and_renders() -> None:
    from planner_service.domain.demo import demo_scenario
    from planner_service.domain.problem import native_precision_scenario

    scenario = native_precision_scenario(demo_scenario())
    params = SynthParams(sessions=3, hours=0.05, arrival_spread_seconds=45, departure_spread_seconds=45, gap_scale=8)
    arms = ("none", "warmups", "warmups-handoff")
    data = gateway_study(scenario, [synthetic(scenario, params, "tiny")], ["sleep-router"], [1, 2], arms=arms)
    assert list(data["arms"]) == list(arms) and data["arms"]["warmups"]["target"] == "priced"
    data.update(scenario="demo", precision="native")
    work = data["workloads"][0]
    none, warm = work["runs"]["sleep-router"]["none"], work["runs"]["sleep-router"]["warmups-handoff"]
    ratios = [w["gpu_gib_hours"] / n["gpu_gib_hours"] for w, n in zip(warm, none, strict=True)]
    assert work["paired"]["sleep-router"]["warmups-handoff"]["gpu_memory_time_ratio"]["mean"] == pytest.approx(
        sum(ratios) / 2
    )
    assert all(r["warmups_started"] == 0 for r in none)
    for r in warm:  # every completed warm-up is either used by its session's next request or not
        assert r["warmups_completed"] == r["warmups_used"] + r["warmups_unused"]
        assert r["warmups_started"] == r["warmups_completed"] + r["warmups_cancelled"]
    page = render_section("gateway", json.loads(json.dumps(data)))
    assert "### gateway: synthetic, 3 sessions" in page and "| sleep-router | warmups-handoff |" in page
    assert "`warmups`: warm-up target `priced`, those worth more than the HBM price" in page


def test_an_eager_warm_up_holds_its_card_and_the_real_prefill_waits_behind_it() -> None:
    """The ablation on the same trace: the warm-up takes the card as a real prefill does, from t=5.004864 for
    5 s and the store of 4864 tokens to host DRAM (4.864 ms), to t=10.009728, so s2's prefill, arriving at t=7,
    waits 3.009728 s, then takes 1 s and 0.768 ms of store; the warm-up completes and s1's hand-off finds its
    history on b."""
    records: list[TraceRecord] = [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=5000, output_tokens=0),
        TraceRequest(t=7.0, session="s2", model="b", input_tokens=1000, output_tokens=0),
        TraceEnd(t=7.5, session="s2", event="end"),
        TraceRequest(t=100.0, session="s1", model="b", input_tokens=10, output_tokens=0),
    ]
    eager = run(records, "affinity+eager-warmups")
    s2 = eager.requests[1]
    assert s2.prefill_queue_seconds == pytest.approx(3.009728) and s2.ttft_seconds == pytest.approx(4.010496)
    assert eager.requests[2].switch_seconds == pytest.approx(0.0)
    gateway = eager.extra["gateway"]
    assert (gateway["warmups_started"], gateway["warmups_cancelled"], gateway["warmups_used"]) == (1, 0, 1)
