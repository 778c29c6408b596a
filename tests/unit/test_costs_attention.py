"""The attention terms of the cost model at long contexts, against numbers worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from planner_service.domain.model_presets import model_preset
from planner_service.domain.problem import resolve_model
from planner_service.domain.scenario import CostConstants, ModelIn
from planner_service.domain.state import Tier
from planner_service.planner import costs
from planner_service.sim.engine import Simulator
from planner_service.sim.policies.oracle import OraclePolicy
from planner_service.sim.trace import TraceRequest
from tests.sim.test_engine import GB, tiny_scenario
from tests.unit.test_costs import node
from tests.unit.test_costs_tensor_parallel import coder, preset_gpus

C = CostConstants()


def test_decode_reads_the_requests_kv_each_token() -> None:
    """Qwen2.5-Coder-32B (KV 262,144 B/token: 2 * 64 layers * 8 KV heads * 128 * 2 B) on 2 x L40, at 30,000
    tokens of context: 7.864e9 B of KV / (0.8 * 2 * 864e9 B/s) = 5.689 ms a token on top of the weights'
    47.40 ms and the all-reduce's 0.060 ms: 12 % more per decoded token."""
    model, pair = coder(), preset_gpus("l40", 2)
    assert model.kv_bytes_per_token == 262_144
    short = costs.decode_seconds_per_token(model, "bf16", pair, 0.0, C)
    long = costs.decode_seconds_per_token(model, "bf16", pair, 0.0, C, context_tokens=30_000)
    assert long - short == pytest.approx(5.689e-3, rel=1e-3)
    assert long == pytest.approx(47.40e-3 + 5.689e-3 + 60.12e-6, rel=1e-3)


def test_the_replay_decodes_at_the_mean_context_of_the_output() -> None:
    """tiny_scenario (one card, 1000 GB/s HBM, 4 GB of weights, 1000 B of KV per token). The second turn
    starts with 1100 tokens of history (1000 in + 100 out), reads 1000 more and writes 100: output token k
    attends to 2100 + k tokens, 2149.5 on average, so
        decode = 100 * (4e9 + 1000 * 2149.5) B / (0.8 * 1e12 B/s) = 0.500268688 s
    (0.5 s without the KV read)."""
    trace = [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=1000, output_tokens=100),
        TraceRequest(t=100.0, session="s1", model="a", input_tokens=1000, output_tokens=100),
    ]
    second = Simulator(tiny_scenario(10 * GB), trace, OraclePolicy()).run().requests[1]
    assert second.history_tokens == 1100
    decode = second.done_at - (second.admitted_at + second.ttft_seconds)
    assert decode == pytest.approx(0.500268688, abs=1e-9)


def test_attention_flops_per_pair_from_the_configs() -> None:
    """2 FLOPs per multiply-add of q . k and of p . v, in every head of every layer:
    Qwen2.5-Coder-32B (GQA) 64 * 2 * 40 * (128 + 128) = 1,310,720; Llama-3.1-8B 32 * 2 * 32 * 256 = 524,288;
    DeepSeek-V3 (MLA, prefilled with full heads) 61 * 2 * 128 * ((128 + 64) + 128) = 4,997,120."""
    assert coder().attention_flops_per_pair == 1_310_720
    assert model_preset("llama-3.1-8b-instruct").architecture.attention_flops_per_pair == 524_288
    assert model_preset("deepseek-v3").architecture.attention_flops_per_pair == 4_997_120


def test_prefill_grows_with_the_context() -> None:
    """Qwen2.5-Coder-32B on 2 x L40 (2 * 181.05e12 FLOP/s at 0.5): 1,310,720 / 1.8105e14 = 7.2395e-9 s a pair.

    A 30,000-token history from scratch: 30,000 * 30,001 / 2 = 450,015,000 pairs = 3.2580 s of attention on
    12.4037 s of per-token prefill (30,000 * 413.46 us): 15.6616 s, 26 % more.
    1,000 input tokens after it: 1,000 * 30,000 + 1,000 * 1,001 / 2 = 30,500,500 pairs = 0.22081 s on 0.41346 s.
    """
    model, pair = coder(), preset_gpus("l40", 2)
    assert costs.attention_seconds_per_pair(model, pair, C) == pytest.approx(7.2395e-9, rel=1e-4)
    assert costs.causal_pairs(30_000, 0) == 450_015_000
    assert costs.prefill_seconds(30_000, 0, model, pair, C) == pytest.approx(12.4037 + 3.2580, rel=1e-4)
    assert costs.prefill_seconds(1_000, 30_000, model, pair, C) == pytest.approx(0.41346 + 0.22081, rel=1e-4)
    assert costs.prefill_seconds(0, 30_000, model, pair, C) == 0.0


def test_kv_ready_prices_the_missing_tokens_after_what_the_group_holds() -> None:
    """The last 1,000 tokens of a 30,000-token history, re-prefilled after the 29,000 the group holds, cost
    what the input above costs at that position; restoring 500 of them first leaves 500 after 29,500."""
    model, pair = coder(), preset_gpus("l40", 2)
    where = node(*(g.id for g in pair))
    alone = costs.kv_ready_seconds(1_000, 0, model, pair, Tier.HOST, where, C, prefix_tokens=29_000)
    assert alone == pytest.approx(costs.prefill_seconds(1_000, 29_000, model, pair, C), rel=1e-12)
    assert alone > costs.kv_ready_seconds(1_000, 0, model, pair, Tier.HOST, where, C)  # later tokens cost more
    restored, seconds = costs.kv_ready(1_000, 500 * model.kv_bytes_per_token, model, pair, Tier.HOST, where, C, 29_000)
    copy = costs.even_copy_seconds(500 * model.kv_bytes_per_token // 2, pair, Tier.HOST, where)
    assert restored == 500
    assert seconds == pytest.approx(copy + costs.prefill_seconds(500, 29_500, model, pair, C), rel=1e-12)


def test_the_grouped_kv_ready_prices_the_attention_as_the_scalar_one() -> None:
    model, pair = coder(), preset_gpus("l40", 2)
    where = node(*(g.id for g in pair))
    kvpt = model.kv_bytes_per_token
    cases = [(1_000, 0, 29_000, True), (1_000, 500 * kvpt, 29_000, True), (30_000, 30_000 * kvpt, 0, False)]
    many = costs.kv_ready_seconds_grouped(
        np.array([c[0] for c in cases]),
        np.array([c[1] for c in cases]),
        np.array([c[3] for c in cases]),
        kvpt,
        2,
        min(g.h2d_bytes_per_s for g in pair),
        where.nvme_read_bytes_per_s,
        costs.prefill_seconds_per_token(model, pair, C),
        costs.attention_seconds_per_pair(model, pair, C),
        np.array([c[2] for c in cases]),
    )
    for (missing, restorable, prefix, from_host), seconds in zip(cases, many, strict=True):
        tier = Tier.HOST if from_host else Tier.NVME
        alone = costs.kv_ready_seconds(missing, restorable, model, pair, tier, where, C, prefix)
        assert seconds == pytest.approx(alone, rel=1e-12)


def test_a_restore_loads_each_rank_s_share_of_replicated_kv_heads() -> None:
    """Qwen3-235B-A22B (4 KV heads, 192,512 B/token) on 8 x L40: each rank holds one KV head of four, so
    restoring 1,000 tokens from host DRAM copies 1,000 x 192,512 / 4 = 48,128,000 B over each card's own link
    (not 1,000 x 192,512 / 8 = 24,064,000); re-prefilling 1,000 tokens of a 235B model costs far more, so the
    restore is chosen. The grouped form, told the split, prices it alike."""
    model = resolve_model(ModelIn.model_validate({"id": "q", "preset": "qwen3-235b-a22b"}), "q")
    eight = preset_gpus("l40", 8)
    where = node(*(g.id for g in eight))
    restored, seconds = costs.kv_ready(1_000, 1_000 * model.kv_bytes_per_token, model, eight, Tier.HOST, where, C)
    assert restored == 1_000
    assert seconds == costs.even_copy_seconds(48_128_000, eight, Tier.HOST, where)
    assert seconds == pytest.approx(48_128_000 / min(g.h2d_bytes_per_s for g in eight), rel=1e-12)
    grouped = costs.kv_ready_seconds_grouped(
        np.array([1_000]),
        np.array([1_000 * model.kv_bytes_per_token]),
        np.array([True]),
        model.kv_bytes_per_token,
        8,
        min(g.h2d_bytes_per_s for g in eight),
        where.nvme_read_bytes_per_s,
        costs.prefill_seconds_per_token(model, eight, C),
        costs.attention_seconds_per_pair(model, eight, C),
        split_ways=4,
    )
    assert grouped[0] == pytest.approx(seconds, rel=1e-12)
