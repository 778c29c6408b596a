"""The simulator's mechanism: hand-checked latencies, conservation, determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest

from planner_service.domain.demo import demo_scenario
from planner_service.domain.scenario import Scenario, parse_scenario
from planner_service.domain.state import Location
from planner_service.sim.engine import simulate
from planner_service.sim.metrics import summarize
from planner_service.sim.policies import create_policy
from planner_service.sim.report import replay
from planner_service.sim.state import SWITCH_PARTS
from planner_service.sim.trace import TraceEnd, TraceRecord, TraceRequest

GB = 10**9


def tiny_scenario(gpu_bytes: int = 10 * GB) -> Scenario:
    """One node, one GPU; round numbers: PCIe 1 GB/s, NVMe 0.5 GB/s, prefill 1 ms/token.

    Prefill: 2 FLOPs * 2.5e8 active params / (1e12 FLOP/s * 0.5 efficiency) = 1e-3 s/token.
    Weights of each model 4 GB: from NVMe max(4/1, 4/0.5) = 8 s, from host 4 s. The node declares no
    engines, so it runs `local` ones: a cold start adds `cold_start_fixed_seconds` (30 s), a level-1 wake
    `wake_fixed_seconds` (0.1 s), by the engine model's defaults (domain/engines.py).
    """
    model = {"weights_bytes": {"bf16": 4 * GB}, "kv_bytes_per_token": 1000, "active_params": 250_000_000}
    return parse_scenario(
        {
            "cluster": {
                "nodes": [
                    {
                        "id": "n1",
                        "host_dram_bytes": 100 * GB,
                        "nvme_bytes": 1000 * GB,
                        "nvme_read_bytes_per_s": 0.5 * GB,
                        "nvme_write_bytes_per_s": 0.5 * GB,
                        "gpus": [
                            {
                                "id": "g0",
                                "hbm_bytes": gpu_bytes,
                                "hbm_bytes_per_s": 1000 * GB,
                                "bf16_flops": 1e12,
                                "h2d_bytes_per_s": 1 * GB,
                                "d2h_bytes_per_s": 1 * GB,
                            }
                        ],
                    }
                ]
            },
            "models": [{"id": "a", **model}, {"id": "b", **model}],
            "residency": [
                {
                    "object": {"kind": "weights", "model": m, "precision": "bf16"},
                    "location": {"tier": "nvme", "node": "n1"},
                    "bytes": 4 * GB,
                }
                for m in ("a", "b")
            ],
        }
    )


def tiny_trace() -> list[TraceRecord]:
    """One session: a (1000 tokens in) at t=0, hand-off to b at 100 s, back to a at 200 s; no output."""
    return [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=1000, output_tokens=0),
        TraceRequest(t=100.0, session="s1", model="b", input_tokens=1000, output_tokens=0),
        TraceRequest(t=200.0, session="s1", model="a", input_tokens=1000, output_tokens=0),
    ]


def random_trace(models: list[str], sessions: int, requests: int, seed: int) -> list[TraceRecord]:
    rng = np.random.default_rng(seed)
    out: list[TraceRecord] = []
    t = 0.0
    for _ in range(requests):
        t += float(rng.exponential(4.0))
        s = f"s{int(rng.integers(sessions))}"
        out.append(
            TraceRequest(
                t=round(t, 3),
                session=s,
                model=str(rng.choice(models)),
                input_tokens=int(rng.integers(50, 3000)),
                output_tokens=int(rng.integers(0, 300)),
            )
        )
    out.append(TraceEnd(t=round(t + 1, 3), session="s0", event="end"))
    return out


def latencies(scenario: Scenario, records, policy: str) -> list[float]:
    result = simulate(scenario, records, create_policy(policy))
    assert result.violations == 0
    return [round(r.switch_seconds, 4) for r in result.requests]


# Room for both models (10 GB): what each policy pays, worked out by hand.
@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        # a: a cold start, 8 s of copy from NVMe + 30 s; b the same + re-prefill of the 1000-token history, 1 s;
        # a warm, re-prefill 1000
        ("lru", [38.0, 39.0, 1.0]),
        # both fixed on the GPU from t=0: only the uncovered history is re-prefilled
        ("static", [0.0, 1.0, 1.0]),
        ("static-nokv", [0.0, 1.0, 1.0]),
        ("independent", [0.0, 1.0, 1.0]),
        ("statebudget", [0.0, 1.0, 1.0]),
        # starts from the same fixed placement as static: both on the GPU
        ("oracle", [0.0, 1.0, 1.0]),
    ],
)
def test_hand_checked_latencies_with_room_for_both(policy: str, expected: list[float]) -> None:
    assert latencies(tiny_scenario(), tiny_trace(), policy) == pytest.approx(expected, abs=1e-3)


# Room for one model (6 GB): every hand-off evicts.
@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        # b: a sleeps (level 1: its first load left a host copy, the backup), b cold-starts, 8 + 30, re-prefill 1;
        # a again: a level-1 wake, 0.1 s + 4 s of copy from the host backup, and its sleep freed its KV:
        # re-prefill the 2000-token history, 2 (the ablation without KV write-through)
        ("lru-nokv", [38.0, 39.0, 6.1]),
        # the same, but LMCache stored a's turn-1 prompt in host DRAM in whole 256-token chunks, 768 of its 1000
        # tokens (sim/kv_save.py): they restore in 0.768 ms and the other 1232 of the history are re-prefilled,
        # 0.1 + 4 + 0.000768 + 1.232
        ("lru", [38.0, 39.0, 5.332768]),
        # a fixed on the GPU at t=0 (static's placement); b prefetched after turn 1 (a is needed only at 200 s,
        # later than b at 100 s); a prefetched after turn 2; at 200 s the 768 tokens of a's KV stored to host
        # restore in 0.768 ms and the other 1232 are re-prefilled
        ("oracle", [0.0, 1.0, 1.232768]),
    ],
)
def test_hand_checked_latencies_with_room_for_one(policy: str, expected: list[float]) -> None:
    assert latencies(tiny_scenario(6 * GB), tiny_trace(), policy) == pytest.approx(expected, abs=1e-3)


def test_ttft_adds_the_prefill_of_the_new_input() -> None:
    """Each prefill's step also waits for LMCache's store of the prompt's whole 256-token chunks not yet in host
    DRAM (sim/kv_save.py), at 1000 B a token over the 1 GB/s D2H link: a's 1000-token prompt stores 768 tokens,
    0.768 ms; b's 2000, 1792 tokens, 1.792 ms; a's 3000 the 2816 - 768 = 2048 its first turn left out, 2.048 ms."""
    result = simulate(tiny_scenario(), tiny_trace(), create_policy("lru"))
    assert [r.ttft_seconds for r in result.requests] == pytest.approx([39.000768, 40.001792, 2.002048])
    assert [r.save_seconds for r in result.requests] == pytest.approx([0.000768, 0.001792, 0.002048])


def test_completion_adds_the_decode_to_the_ttft() -> None:
    """The last turn decodes 200 tokens: each reads the 4 GB of weights at 0.8 * 1000 GB/s, 5 ms."""
    trace = tiny_trace()
    trace[-1] = TraceRequest(t=200.0, session="s1", model="a", input_tokens=1000, output_tokens=200)
    result = simulate(tiny_scenario(), trace, create_policy("lru"))
    # (the TTFTs of the test above; the last turn's decode also reads its KV, 0.8 ms in all)
    expected = [39.000768, 40.001792, 3.002048]
    assert [r.done_at - r.admitted_at for r in result.requests] == pytest.approx(expected, abs=1e-3)
    by_model = summarize(result)["completion_seconds_by_model"]
    assert by_model["a"]["p50"] == pytest.approx((expected[0] + expected[2]) / 2, abs=1e-3)
    assert by_model["b"] == pytest.approx({"p50": expected[1], "p95": expected[1]}, abs=1e-3)


def test_handoffs_are_model_changes_within_a_session() -> None:
    result = simulate(tiny_scenario(), tiny_trace(), create_policy("lru"))
    assert [r.handoff for r in result.requests] == [False, True, True]


@pytest.mark.parametrize(
    "policy",
    [
        "statebudget",
        "static",
        "lru",
        "static-nokv",
        "lru-nokv",
        "sleep-router",
        "swap-ttl",
        "clairvoyant",
    ],
)
def test_conservation_on_the_demo(policy: str) -> None:
    check_conservation(demo_scenario(), policy)


def demo_without_declared_engines() -> Scenario:
    from planner_service.domain.demo import demo_scenario_json

    data = demo_scenario_json()
    for node in data["cluster"]["nodes"]:
        node.pop("engines", None)
    return parse_scenario(data)


# `independent` and `oracle` choose their own GPU groups: on the demo's declared vLLM engines a MoE they load on one
# GPU fixes its expert share at launch beside its waiting request's KV (else it would reload without end), and
# `independent` partitions on the declared groups. On the same demo with no engines declared they conserve too.
@pytest.mark.parametrize("policy", ["independent", "oracle"])
def test_conservation_on_the_engine_demo_of_the_policies_that_choose_their_own_groups(policy: str) -> None:
    check_conservation(demo_scenario(), policy)


@pytest.mark.parametrize("policy", ["independent", "oracle"])
def test_conservation_on_the_demo_without_declared_engines(policy: str) -> None:
    check_conservation(demo_without_declared_engines(), policy)


def check_conservation(scenario: Scenario, policy: str) -> None:
    records = random_trace([m.id for m in scenario.models], sessions=4, requests=40, seed=3)
    result = simulate(scenario, records, create_policy(policy))
    requests = [r for r in records if isinstance(r, TraceRequest)]
    assert len(result.requests) == len(requests)
    assert all(r.state == "done" and math.isfinite(r.done_at) for r in result.requests)
    assert all(r.done_at >= r.t + r.switch_seconds - 1e-9 and r.switch_seconds >= 0 for r in result.requests)
    for r in result.requests:  # where each switch latency went: non-negative parts that sum to it
        assert r.parts is not None and set(r.parts) == set(SWITCH_PARTS)
        assert min(r.parts.values()) >= -1e-9
        assert sum(r.parts.values()) == pytest.approx(r.switch_seconds, abs=1e-6)
    assert result.violations == 0  # capacity at every change, bandwidth at every re-rate
    assert result.link_peak_ratio <= 1 + 1e-9
    capacity = sum(g.capacity_bytes for g in scenario_gpus(scenario))
    assert result.peak_gpu_bytes <= capacity


def scenario_gpus(scenario: Scenario):
    from planner_service.sim.engine import base_problem

    return base_problem(scenario).gpus.values()


def test_concurrent_transfers_share_a_link() -> None:
    """Two requests at once for two cold models on one GPU: both loads share the NVMe read and the PCIe link."""
    records = [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=0, output_tokens=0),
        TraceRequest(t=0.0, session="s2", model="b", input_tokens=0, output_tokens=0),
    ]
    result = simulate(tiny_scenario(), records, create_policy("lru"))
    # 8 GB through a 0.5 GB/s drive shared by both: 16 s, + a 30 s cold start each
    assert [round(r.switch_seconds, 3) for r in result.requests] == [46.0, 46.0]
    assert result.link_peak_ratio == pytest.approx(1.0)


def test_replay_is_deterministic() -> None:
    scenario = demo_scenario()
    records = random_trace([m.id for m in scenario.models], sessions=3, requests=25, seed=5)
    first = replay(scenario, records, ["statebudget", "lru", "oracle"], seed=1).report
    second = replay(scenario, records, ["statebudget", "lru", "oracle"], seed=1).report
    for report in (first, second):
        for metrics in report["policies"].values():
            metrics.pop("planner_seconds")  # wall-clock time of the planner
            metrics.pop("replay_wall_seconds")
    assert first == second


def test_a_request_no_engine_can_hold_fails_after_the_timeout_and_its_session_goes_on() -> None:
    """s1's first turn needs 10 TB of KV: no GPU ever holds it. `lru` cold-starts a (8 s from NVMe + 30 s),
    finds the KV stuck and takes a down; s2's b cold-starts meanwhile (38 s, switch 38). At 600 s (the
    client's timeout) s1's turn fails: its whole wait is placement or cold start, never served. Its next turn
    (due at 100 s, after the answer) arrives then with an unchanged (empty) history and wakes a from its
    level-1 sleep: 4 s from host DRAM + 0.1 s, TTFT + 1,000 tokens x 1 ms + the store of 768 of them to host
    DRAM, 0.768 ms (sim/kv_save.py). The replay ends at 605.100768 s."""
    records = [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=10_000_000, output_tokens=0),
        TraceRequest(t=100.0, session="s1", model="a", input_tokens=1000, output_tokens=0),
        TraceRequest(t=10.0, session="s2", model="b", input_tokens=1000, output_tokens=0),
    ]
    result = simulate(tiny_scenario(), records, create_policy("lru"))
    lost, later, other = result.requests[0], result.requests[2], result.requests[1]
    assert (lost.state, lost.failed_at) == ("failed", 600.0) and math.isnan(lost.switch_seconds)
    assert lost.parts == pytest.approx({"placement": 562.0, "cold_start": 38.0, "wake": 0.0, "queue": 0.0})
    assert (later.state, later.admitted_at, later.history_tokens) == ("done", 600.0, 0)
    assert (later.switch_seconds, later.ttft_seconds) == pytest.approx((4.1, 5.100768))
    assert later.parts is not None and later.parts["wake"] == pytest.approx(4.1)
    assert (other.state, other.switch_seconds) == ("done", pytest.approx(38.0))
    assert result.duration_seconds == pytest.approx(605.100768)
    summary = summarize(result)
    assert summary["failed_requests"] == {"all": 1, "handoff": 0, "too_long": 0}
    assert summary["requests"] == 3 and summary["switch_latency_seconds"]["all"]["p50"] == pytest.approx(21.05)


def test_a_prompt_beyond_its_model_s_maximum_context_fails_at_once() -> None:
    """a launched with a 5,000-token maximum context (vLLM's --max-model-len): s1's first turn, a 5,000-token
    prompt, leaves no room for one output token and is refused at its arrival, as vLLM and SGLang refuse it,
    instead of holding a's queue until the client's 600 s timeout; s1's next turn follows at once with its
    history unchanged (empty) and is served, and so is s2's 4,999-token prompt."""
    scenario = tiny_scenario()
    data = scenario.model_dump(mode="json")
    for m in data["models"]:
        m["max_context_tokens"] = 5_000
    records = [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=5_000, output_tokens=0),
        TraceRequest(t=0.5, session="s1", model="a", input_tokens=1_000, output_tokens=0),
        TraceRequest(t=10.0, session="s2", model="a", input_tokens=4_999, output_tokens=0),
    ]
    result = simulate(parse_scenario(data), records, create_policy("lru"))
    refused, next_turn, other = result.requests
    assert (refused.state, refused.failed_at, refused.too_long) == ("failed", 0.0, True)
    assert next_turn.state == "done" and next_turn.history_tokens == 0 and not next_turn.too_long
    assert (other.state, other.too_long) == ("done", False)
    assert summarize(result)["failed_requests"] == {"all": 1, "handoff": 0, "too_long": 1}
    assert result.duration_seconds < 100  # nobody waited for a timeout


def test_a_history_beyond_the_next_model_s_maximum_context_is_compacted_and_sent_again() -> None:
    """b launched with a 5,000-token maximum context: s1's hand-off to b carries a 4,800-token history and a
    300-token input, which b refuses; the agent compacts its context and the turn is served at once on a
    fresh history. Back on a, the KV a kept of the old history covers nothing of the new one: the turn
    re-prefills its 300 tokens of history. An input alone beyond the maximum context still fails."""
    data = tiny_scenario().model_dump(mode="json")
    data["models"][1]["max_context_tokens"] = 5_000
    records = [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=4_000, output_tokens=500),
        TraceRequest(t=100.0, session="s1", model="a", input_tokens=300, output_tokens=0),
        TraceRequest(t=200.0, session="s1", model="b", input_tokens=300, output_tokens=0),
        TraceRequest(t=300.0, session="s1", model="a", input_tokens=100, output_tokens=0),
        TraceRequest(t=400.0, session="s2", model="b", input_tokens=5_000, output_tokens=0),
    ]
    result = simulate(parse_scenario(data), records, create_policy("lru"))
    _, kept, handoff, back, alone = result.requests
    assert (kept.history_tokens, kept.reprefill_tokens) == (4_500, 0)
    assert (handoff.state, handoff.compacted_tokens, handoff.history_tokens, handoff.too_long) == (
        "done",
        4_800,
        0,
        False,
    )
    assert (back.state, back.history_tokens, back.reprefill_tokens) == ("done", 300, 300)
    assert (alone.state, alone.too_long, alone.compacted_tokens) == ("failed", True, 0)
    summary = summarize(result)
    assert summary["compacted_requests"] == 1
    assert summary["failed_requests"] == {"all": 1, "handoff": 0, "too_long": 1}


def test_a_timeout_moves_no_clock_and_takes_a_bound() -> None:
    """A request served in time leaves its timer behind without effect: the replay ends at its answer (38 s
    cold start + 1 s + 0.768 ms of store to host DRAM), not at the timer's 600 s. The timeout must be positive."""
    records = [TraceRequest(t=0.0, session="s1", model="a", input_tokens=1000, output_tokens=0)]
    result = simulate(tiny_scenario(), records, create_policy("lru"))
    assert result.duration_seconds == pytest.approx(39.000768)
    short = simulate(tiny_scenario(), records, create_policy("lru"), request_timeout_seconds=10.0)
    assert short.requests[0].state == "failed" and short.requests[0].failed_at == pytest.approx(10.0)
    with pytest.raises(ValueError, match="request_timeout_seconds"):
        simulate(tiny_scenario(), records, create_policy("lru"), request_timeout_seconds=0.0)


def test_a_hand_off_s_switch_latency_splits_into_its_parts() -> None:
    """Room for both (10 GB): a cold-starts (38 s); the hand-off to b at 100 s cold-starts b (8 s from NVMe +
    30 s) and re-prefills the 1,000-token history b never saw (1 s): 39 s = 38 cold start + 1 re-prefill."""
    records = [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=1000, output_tokens=0),
        TraceRequest(t=100.0, session="s1", model="b", input_tokens=1000, output_tokens=0),
    ]
    result = simulate(tiny_scenario(), records, create_policy("lru"))
    first, handoff = result.requests
    assert first.parts == pytest.approx({**dict.fromkeys(SWITCH_PARTS, 0.0), "cold_start": 38.0})
    assert handoff.handoff and handoff.switch_seconds == pytest.approx(39.0)
    assert handoff.parts == pytest.approx({**dict.fromkeys(SWITCH_PARTS, 0.0), "cold_start": 38.0, "reprefill": 1.0})
    parts = summarize(result)["handoff_switch_parts"]
    assert parts["mean"]["cold_start"] == pytest.approx(38.0) and parts["tail_count"] == 1


def test_a_session_runs_in_a_closed_loop() -> None:
    """The second turn keeps its 100 s start-to-start trace gap from the first turn's arrival: the first answer
    comes at 38 s (a cold start), within the gap, so the turn arrives at 100 s as in the trace, not 100 s after
    the answer (that would count the first turn's service twice; tests/sim/test_slots.py checks a longer case)."""
    records = [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=0, output_tokens=0),
        TraceRequest(t=100.0, session="s1", model="a", input_tokens=0, output_tokens=0),
    ]
    closed = simulate(tiny_scenario(), records, create_policy("lru"))
    assert [r.admitted_at for r in closed.requests] == pytest.approx([0.0, 100.0])
    assert closed.requests[0].done_at == pytest.approx(38.0)
    opened = simulate(tiny_scenario(), records, create_policy("lru"), closed_loop=False)
    assert [r.admitted_at for r in opened.requests] == pytest.approx([0.0, 100.0])


def test_hand_offs_follow_trace_order_not_completion() -> None:
    """A turn that arrives while the previous one still runs is a hand-off by the trace, for every policy."""
    records = [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=0, output_tokens=0),
        TraceRequest(t=1.0, session="s1", model="b", input_tokens=0, output_tokens=0),
    ]
    for policy in ("lru", "static"):
        result = simulate(tiny_scenario(), records, create_policy(policy))
        assert [r.handoff for r in result.requests] == [False, True]


def test_first_come_first_served_per_model() -> None:
    """Room for one KV at a time: the large request that came first starts before the small one after it."""
    records = [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=0, output_tokens=1000),
        TraceRequest(t=1.0, session="s2", model="a", input_tokens=4000, output_tokens=0),
        TraceRequest(t=2.0, session="s3", model="a", input_tokens=100, output_tokens=0),
    ]
    # 4 GB of weights on a 4.0045 GB GPU: 4.5 MB of KV room. s1 holds 1 MB while it decodes, so s2 (4 MB)
    # waits for s1 to end; s3 (0.1 MB) would fit beside s1 but waits behind s2, then starts with it
    result = simulate(tiny_scenario(4 * GB + 4_500_000), records, create_policy("lru"))
    s1, s2, s3 = result.requests
    assert s2.started_at == pytest.approx(s1.done_at)
    assert s3.started_at == pytest.approx(s2.started_at)


def prefill_while_another_runs(second_model: str) -> list[TraceRequest]:
    """a and b warm on the one GPU; s1 prefills 4,000 tokens on a at t=100, s2 asks `second_model` at t=101."""
    return [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=0, output_tokens=0),
        TraceRequest(t=0.0, session="s2", model="b", input_tokens=0, output_tokens=0),
        TraceRequest(t=100.0, session="s1", model="a", input_tokens=4000, output_tokens=0),
        TraceRequest(t=101.0, session="s2", model=second_model, input_tokens=1000, output_tokens=0),
    ]


def test_models_sharing_a_gpu_take_its_prefill_in_turn() -> None:
    """a and b both warm on the one GPU: b's prefill, arriving while a's runs, starts when a's ends."""
    result = simulate(tiny_scenario(), prefill_while_another_runs("b"), create_policy("lru"))
    a, b = result.requests[2:]
    # both weights fit the 10 GB card and stay warm; a prefills 4,000 tokens at 1 ms each from t=100 to 104,
    # and its step waits for the store of 3840 of them (15 whole chunks) to host DRAM, 3.84 ms
    assert a.ttft_seconds == pytest.approx(4.00384) and a.prefill_queue_seconds == 0.0
    # b arrives at 101 with its model warm: it waits the 3.00384 s left of a's prefill and store, then takes 1 s
    # and stores 768 tokens, 0.768 ms
    assert b.prefill_queue_seconds == pytest.approx(3.00384)
    assert b.ttft_seconds == pytest.approx(4.004608)


def test_the_report_parts_a_hand_off_s_wait_for_its_cards_from_its_switch_latency() -> None:
    """s2 hands off from b to a while a prefills s1 on the one GPU: its switch latency is that wait alone."""
    result = simulate(tiny_scenario(), prefill_while_another_runs("a"), create_policy("lru"))
    handoff = result.requests[3]
    # no history: nothing to re-prefill; a's prefill and its store of 3840 tokens to host DRAM (3.84 ms) hold the card
    assert handoff.handoff and handoff.switch_seconds == pytest.approx(3.00384)
    waits = summarize(result)["handoff_prefill_wait_seconds"]
    assert waits["wait"]["mean"] == pytest.approx(3.00384)
    assert waits["switch_latency_without_wait"]["p95"] == pytest.approx(0.0)


def two_gpu_scenario() -> Scenario:
    """`tiny_scenario` with a second 10 GB GPU beside the first on the node (PCIe 1 GB/s each, NVMe 0.5 GB/s)."""
    data = tiny_scenario().model_dump(mode="json")
    node = data["cluster"]["nodes"][0]
    node["gpus"].append({**node["gpus"][0], "id": "g1"})
    return parse_scenario(data)


def test_an_on_demand_load_wakes_the_instance_sleeping_on_a_wider_group() -> None:
    """a's instance sleeps (level 1) on g0 + g1. One GPU would hold a's 4 GB as well, but a start there is a
    cold start: 8 s from NVMe (0.5 GB/s) + 30 s = 38 s; the wake on both reads 2 GB per GPU over the one NVMe,
    8 s + 0.1 s. The load wakes it where it sleeps."""
    from planner_service.domain.engines import EngineState
    from planner_service.sim.engine import Simulator
    from planner_service.sim.instances import SleepingEngine

    sim = Simulator(two_gpu_scenario(), [], create_policy("lru"))
    book, gpus = sim.engines, tuple(sim.problem.gpus[g] for g in ("g0", "g1"))
    book.asleep[("a", "n1")] = SleepingEngine(book.instance("n1", "a", "bf16", gpus), "n1", EngineState.ASLEEP_HOST)
    for g in gpus:
        sim.cluster.hold("a", Location.gpu(g.id), book.residue_bytes())
    assert sim.view.choose_group("a") == ("n1", "bf16", gpus)
    assert book.start_fixed_seconds("n1", "a", "bf16", gpus) == pytest.approx(0.1)
    assert book.start_fixed_seconds("n1", "a", "bf16", gpus[:1]) == pytest.approx(30.0)
    assert sim.view.choose_group("b") == ("n1", "bf16", gpus[:1])  # nothing of b sleeps: the fewest GPUs


def test_a_wait_is_split_by_the_engine_phases_it_overlaps() -> None:
    """a's engine: none until 10 s, cold start 10-40 s, up 40-50 s, none again from 50 s (a change back at the
    same instant as another keeps the later one). A wait from 5 s to 60 s: 5 + 10 s placement, 30 s cold start,
    10 s queue; the parts sum to the 55 s."""
    from planner_service.sim.engine import Simulator

    sim = Simulator(tiny_scenario(), [], create_policy("lru"))
    for at, phase in ((10.0, "cold_start"), (40.0, "wake"), (40.0, "ready"), (50.0, "none")):
        sim.now = at
        sim.mark_engine("a", phase)
    assert sim.engine_phases["a"] == ([0.0, 10.0, 40.0, 50.0], ["none", "cold_start", "ready", "none"])
    parts = sim.waited_parts("a", 5.0, 60.0)
    assert parts == pytest.approx({"placement": 15.0, "cold_start": 30.0, "wake": 0.0, "queue": 10.0})
    assert sim.waited_parts("b", 5.0, 60.0) == pytest.approx(
        {"placement": 55.0, "cold_start": 0.0, "wake": 0.0, "queue": 0.0}
    )
