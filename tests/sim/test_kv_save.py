"""LMCache's store of a prompt's KV to host DRAM in the replay (sim/kv_save.py), checked by hand."""

from __future__ import annotations

import pytest

from planner_service.domain.problem import Gpu
from planner_service.domain.state import Location, StateObject
from planner_service.sim.engine import Simulator, simulate
from planner_service.sim.kv_save import save_seconds, saved_tokens
from planner_service.sim.policies import create_policy
from planner_service.sim.trace import TraceRequest
from tests.sim.test_engine import GB, tiny_scenario


def card(gid: str, d2h: float) -> Gpu:
    return Gpu(
        id=gid,
        node="n1",
        type="test",
        capacity_bytes=10 * GB,
        hbm_bytes_per_s=1000 * GB,
        bf16_flops=1e12,
        h2d_bytes_per_s=1 * GB,
        d2h_bytes_per_s=d2h,
    )


def test_whole_chunks_only() -> None:
    assert [saved_tokens(n) for n in (0, 255, 256, 1000, 4000, 5010)] == [0, 0, 256, 768, 3840, 4864]


def test_the_group_waits_for_its_slowest_card_s_shard() -> None:
    # 3,000,001 B over two cards: 1,500,001 B at 1 GB/s (1.500001 ms) and 1,500,000 B at 0.5 GB/s (3 ms)
    assert save_seconds(3_000_001, [card("g0", 1 * GB), card("g1", 0.5 * GB)]) == pytest.approx(3e-3)
    assert save_seconds(3_000_000, [card("g0", 1 * GB)]) == pytest.approx(3e-3)
    assert save_seconds(0, [card("g0", 1 * GB)]) == 0.0
    # docs/evidence.md's example: Qwen2.5-Coder-32B (262,144 B of KV a token) on 2 x L40 (24 GB/s D2H each,
    # domain/hardware.py), a 31,000-token prompt: 30,976 tokens stored, 8,120,172,544 B, 4,060,086,272 B a card
    l40s = [card("g0", 24 * GB), card("g1", 24 * GB)]
    assert saved_tokens(31_000) * 262_144 == 8_120_172_544
    assert save_seconds(8_120_172_544, l40s) == pytest.approx(4_060_086_272 / 24e9)  # 0.1692 s


def test_the_store_lengthens_the_turn_and_decode_is_not_stored() -> None:
    """One turn on a (tiny scenario: 1 ms a prefilled token, 1000 B of KV a token, D2H 1 GB/s): 38 s cold start,
    1 s of prefill, then its step stores the prompt's 768 whole-chunk tokens, 768,000 B at 1 GB/s = 0.768 ms,
    before the first token. Its 512 decoded tokens are not stored: host DRAM holds 768 tokens, not 1512."""
    records = [TraceRequest(t=0.0, session="s1", model="a", input_tokens=1000, output_tokens=512)]
    sim = Simulator(tiny_scenario(), records, create_policy("lru"))
    result = sim.run()
    (req,) = result.requests
    assert req.save_seconds == pytest.approx(768_000 / 1e9)
    assert req.ttft_seconds == pytest.approx(38.0 + 1.0 + 0.000768)
    kv = StateObject.kv("a", "s1")
    assert sim.cluster.bytes_of(kv, Location.host("n1")) == 768_000 and sim.host_tokens[kv] == 768
    # the ablation without the host copy pays no store
    plain = simulate(tiny_scenario(), records, create_policy("lru-nokv")).requests[0]
    assert plain.save_seconds == 0.0 and plain.ttft_seconds == pytest.approx(39.0)
