"""A MoE's decode step grows with its batch: the union of the experts the batch's tokens touch, every request's
KV and the all-reduce of every token; the node's CPU shared by the engines whose misses it computes."""

from __future__ import annotations

import pytest

from planner_service.domain.problem import ModelSpec, resolve_model
from planner_service.domain.scenario import CostConstants, ModelIn, Scenario, parse_scenario
from planner_service.domain.state import Location, StateObject, Tier
from planner_service.planner import costs
from planner_service.planner.costs import CPU_EXPERT_BYTES_PER_S
from planner_service.sim.engine import Simulator
from planner_service.sim.policies.oracle import OraclePolicy
from planner_service.sim.state import SimRequest
from planner_service.sim.trace import TraceRequest
from tests.sim.test_engine import GB, tiny_scenario
from tests.unit.test_costs_tensor_parallel import preset_gpus

C = CostConstants()  # expert_popularity_skew 0.5: hit(f) = f ** 0.5


def deepseek_v3() -> ModelSpec:
    return resolve_model(ModelIn.model_validate({"id": "ds", "preset": "deepseek-v3"}), "ds")


def test_deepseek_v3_on_four_l40s_with_a_tenth_of_its_experts_on_gpu() -> None:
    """DeepSeek-V3 at fp8 (config: 256 routed experts, 8 a token, 58 MoE layers of 61, experts of
    3 * 7168 * 2048 = 44,040,192 B): X = 58 * 256 * 44,040,192 = 653,908,770,816 B of routed experts,
    a = 58 * 8 * 44,040,192 = 20,434,649,088 B of them a token (a / X = k / E = 1 / 32), 17,117,648,384 B of
    other weights, 70,272 B of KV a token. 4 x L40: HBM 0.8 * 4 * 864e9 = 2.7648e12 B/s, PCIe 4 * 24e9 = 96e9 B/s,
    all-reduce 2 * 61 * 2 * 3/4 * 7168 * 2 B = 2,623,488 B at 21.8e9 B/s = 120.34 us a token.

    f = 0.1 of the experts on GPU take hit = 0.1 ** 0.5 = 0.316228 of the reads:
        p_gpu = 0.316228 / 32 / 0.1 = 0.0988212,   p_off = 0.683772 / 32 / 0.9 = 0.0237421
    b = 1 (10,000 tokens of context): on GPU 0.316228 * a = 6.4620e9 B, off 0.683772 * a = 13.9726e9 B
        HBM  (17.1176e9 + 6.4620e9 + 13.9726e9 + 0.70272e9) / 2.7648e12 = 13.836 ms
        PCIe 13.9726e9 / 96e9 = 145.548 ms;  step 13.836 + 0.120 + 145.548 = 159.505 ms a token
    b = 8 (8 requests of 10,000 tokens): 0.901179 ** 8 = 0.434999, 0.976258 ** 8 = 0.825119
        on GPU 0.1 X * 0.565001 = 36.946e9 B, off 0.9 X * 0.174881 = 102.921e9 B (8 alone: 111.78e9)
        HBM  (17.1176e9 + 36.946e9 + 102.921e9 + 5.6218e9) / 2.7648e12 = 58.813 ms
        all-reduce 8 * 120.34 us = 0.963 ms;  PCIe 102.921e9 / 96e9 = 1,072.090 ms
        step 58.813 + 0.963 + 1,072.090 = 1,131.866 ms a token for each of the 8 requests (7.1 x alone)
    With a complete copy in host DRAM the CPU (129.28e9 B/s) computes the misses instead: 796.12 ms, a step of
    855.90 ms; sharing the CPU with as many requests of another engine (half its rate) makes it 1,592.24 ms,
    dearer than PCIe, which is charged again.
    """
    ds, four = deepseek_v3(), preset_gpus("l40", 4)
    assert (ds.experts_bytes, ds.active_expert_bytes_per_token, ds.weights_bytes["fp8"]) == (
        653_908_770_816,
        20_434_649_088,
        17_117_648_384,
    )
    assert ds.kv_bytes_per_token == 70_272
    assert costs.expert_step_bytes(ds, 0.1, C, 1) == pytest.approx((6.4620e9, 13.9726e9), rel=1e-4)
    assert costs.expert_step_bytes(ds, 0.1, C, 8) == pytest.approx((36.946e9, 102.921e9), rel=1e-4)

    def step(batch: int, **options: float) -> float:
        return costs.decode_seconds_per_token(
            ds, "fp8", four, 0.1, C, context_tokens=10_000 * batch, batch=batch, **options
        )

    assert step(1) == pytest.approx(159.505e-3, rel=1e-4)
    assert step(8) == pytest.approx(1_131.866e-3, rel=1e-4)
    assert step(8, cpu_experts=True) == pytest.approx(855.90e-3, rel=1e-4)
    assert step(8, cpu_experts=True, cpu_share=0.5) == pytest.approx(step(8), rel=1e-12)


def test_a_batch_of_one_is_the_per_token_rule() -> None:
    """At b = 1 the step is the former per-token price: the whole active experts from HBM, plus
    `expert_miss_seconds` of one token."""
    ds, four = deepseek_v3(), preset_gpus("l40", 4)
    for fraction in (0.0, 0.1, 0.5, 1.0):
        for cpu in (False, True):
            former = (
                (ds.weights_bytes["fp8"] + ds.active_expert_bytes_per_token + ds.kv_bytes_per_token * 5_000)
                / (costs.HBM_EFFICIENCY * 4 * 864e9)
                + costs.tp_allreduce_seconds_per_token(ds, four)
                + costs.expert_miss_seconds(1, ds, fraction, four, C, cpu)
            )
            now = costs.decode_seconds_per_token(ds, "fp8", four, fraction, C, context_tokens=5_000, cpu_experts=cpu)
            assert now == pytest.approx(former, rel=1e-12)


def test_under_uniform_routing_a_step_touches_the_layers_union() -> None:
    """Skew 1 (every expert as likely): b tokens touch E (1 - (1 - k/E) ** b) of each layer's experts, wherever
    they sit; all 256 of DeepSeek-V3's in the limit, and one token's 8 at b = 1."""
    ds, uniform = deepseek_v3(), CostConstants(expert_popularity_skew=1.0)
    for fraction in (0.0, 0.25, 1.0):
        for batch in (1, 8, 64):
            on, off = costs.expert_step_bytes(ds, fraction, uniform, batch)
            assert on + off == pytest.approx(ds.experts_bytes * (1 - (31 / 32) ** batch), rel=1e-12)
            assert on == pytest.approx(fraction * (on + off), rel=1e-12)
    assert sum(costs.expert_step_bytes(ds, 0.3, C, 10_000)) == pytest.approx(ds.experts_bytes, rel=1e-9)


def moe_node(hbm_bytes: int, models: tuple[str, ...]) -> Scenario:
    """tiny_scenario's node (one card of 1000 GB/s HBM and 1 GB/s PCIe) serving MoEs of round sizes: 2 GB of
    other weights, 16 experts of 1 GB (one layer), one a token, 1000 B of KV a token, prefill 1 ms a token;
    a complete copy of the experts in host DRAM, so the CPU computes the misses. The card leaves no room for an
    expert (its 10 % headroom kept), so every expert misses."""
    data = tiny_scenario(hbm_bytes).model_dump(mode="json", exclude_none=True)
    moe = {
        "weights_bytes": {"bf16": 2 * GB},
        "kv_bytes_per_token": 1000,
        "active_params": 250_000_000,
        "experts_bytes": 16 * GB,
        "expert_bytes": GB,
        "active_expert_bytes_per_token": GB,
    }
    data["models"] = [{"id": m, **moe} for m in models]
    data["residency"] = [
        entry
        for m in models
        for entry in (
            {
                "object": {"kind": "weights", "model": m, "precision": "bf16"},
                "location": {"tier": "nvme", "node": "n1"},
                "bytes": 2 * GB,
            },
            {"object": {"kind": "experts", "model": m}, "location": {"tier": "host", "node": "n1"}, "bytes": 16 * GB},
        )
    ]
    return parse_scenario(data)


def decodes(scenario: Scenario, models: tuple[str, ...]) -> list[SimRequest]:
    """One request (1,000 tokens in, 100 out) per model given, two sessions, all at t = 0."""
    trace = [
        TraceRequest(t=0.0, session=f"s{i}", model=m, input_tokens=1000, output_tokens=100)
        for i, m in enumerate(models)
    ]
    sim = Simulator(scenario, trace, OraclePolicy())
    result = sim.run()
    for m in set(models):
        assert sim.cluster.node_bytes(StateObject.experts(m), "n1", Tier.GPU) == 0
        assert sim.cluster.bytes_of(StateObject.experts(m), Location.host("n1")) == 16 * GB
    return result.requests


def decode_seconds(req: SimRequest) -> float:
    return req.done_at - (req.admitted_at + req.ttft_seconds)


# a request alone: mean context 1000 + 99 / 2 = 1049.5 tokens; a step reads 2 GB of weights, the token's one
# expert (1 GB) and 1,049,500 B of KV at 0.8e12 B/s = 3.751312 ms, and the CPU computes the missed expert,
# 1e9 / 129.2779e9 = 7.735272 ms (PCIe would take 1 s): 100 steps = 1.148658 s
ALONE = 100 * ((2e9 + 1e9 + 1_049_500) / 0.8e12 + 1e9 / CPU_EXPERT_BYTES_PER_S)


def test_two_requests_on_one_moe_engine_decode_in_one_batch() -> None:
    """Both arrive at t = 0 and start as the engine comes up; the first prefills first, decoding alone (its
    batch when it started: 1), the second in the batch of 2. Its steps read 2 tokens' union of the 16 experts,
    16 (1 - (15/16) ** 2) = 1.9375 GB, and both requests' KV, 2,099,000 B: (2e9 + 1.9375e9 + 2.099e6) /
    0.8e12 = 4.924499 ms, and the CPU computes 1.9375 GB, 14.987090 ms: 100 steps = 1.991159 s, 0.842500 s more
    than alone."""
    first, second = decodes(moe_node(3 * GB, ("m",)), ("m", "m"))
    assert decode_seconds(first) == pytest.approx(ALONE, abs=1e-9)
    assert ALONE == pytest.approx(1.148658, abs=1e-6)
    batch_of_two = 100 * ((2e9 + 1.9375e9 + 2_099_000) / 0.8e12 + 1.9375e9 / CPU_EXPERT_BYTES_PER_S)
    assert decode_seconds(second) == pytest.approx(batch_of_two, abs=1e-9)
    assert decode_seconds(second) - decode_seconds(first) == pytest.approx(0.842500, abs=1e-6)


def test_two_moe_engines_on_one_node_share_its_cpu() -> None:
    """Two MoEs on one 5 GB card, a request each: the second to start finds the other's running, and the
    node's CPU computes both engines' misses, so its steps get half its rate: the missed expert takes
    2 * 7.735272 ms, and its 100 steps 0.773527 s more than alone (PCIe's 1 s a step is still dearer)."""
    first, second = sorted(decodes(moe_node(5 * GB, ("m", "n")), ("m", "n")), key=lambda r: r.ttft_seconds)
    assert decode_seconds(first) == pytest.approx(ALONE, abs=1e-9)
    assert decode_seconds(second) == pytest.approx(ALONE + 100 * 1e9 / CPU_EXPERT_BYTES_PER_S, abs=1e-9)
    assert decode_seconds(second) - decode_seconds(first) == pytest.approx(0.773527, abs=1e-6)
