"""A MoE's prefill with routed experts off GPU, against numbers worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from planner_service.domain.problem import ModelSpec, resolve_model
from planner_service.domain.scenario import CostConstants, ModelIn
from planner_service.domain.state import Tier
from planner_service.planner import costs
from tests.unit.test_costs import node
from tests.unit.test_costs_tensor_parallel import preset_gpus

C = CostConstants()


def deepseek_v3_fp8() -> ModelSpec:
    return resolve_model(ModelIn.model_validate({"id": "dsv3", "preset": "deepseek-v3", "precisions": ["fp8"]}), "dsv3")


def test_deepseek_v3_re_prefill_on_four_l40s_with_a_tenth_of_its_experts() -> None:
    """DeepSeek-V3 at fp8 (config.json: 58 MoE layers of 256 routed experts, 8 a token, each 3 * 7168 * 2048
    parameters at 1 B: 44,040,192 B) on 4 x L40 (gpus.json: 24e9 B/s host -> GPU each, 48 GB: vLLM's
    2048-token chunks, vllm/engine/arg_utils.py), 10 % of its experts on GPU, re-prefilling 30,000 tokens:

        experts      = 58 * 256 * 44,040,192 B                 = 653,908,770,816 B
        per pass     = 0.9 * 653,908,770,816 B / (4 * 24e9 B/s) = 6.13040 s
        chunks       = 14 of 2048 tokens + one of 1328; each touches 1 - (1 - 8/256)^c of the experts:
                       1 - 5e-29 at 2048, 1 - 5e-19 at 1328: 15 passes
        pcie         = 15 * 6.13040 s                           = 91.956 s
        cpu          = 30,000 * (1 - 0.1^0.5) * 20,434,649,088 params / (74.36 * 20,434,649,088 params/s)
                     = 30,000 * 0.683772 / 74.36 tokens/s       = 275.86 s  (KTransformers' rate, perf_anchors.md 3)
    so the PCIe stream is the cheaper even with the experts in host DRAM: 91.956 s on top of the 15.890 s
    the GPUs compute (9.679 s of weights and all-reduce, 6.210 s of attention: costs.prefill_seconds with
    every expert on GPU), 6.8 times the prefill priced before.
    """
    model, gpus = deepseek_v3_fp8(), preset_gpus("l40", 4)
    assert model.experts_bytes == 653_908_770_816
    assert model.active_expert_bytes_per_token / model.experts_bytes == 8 / 256
    assert costs.prefill_chunk_tokens(gpus) == 2048
    assert costs.expert_prefill_passes(30_000, 8 / 256, 2048) == pytest.approx(15.0, abs=1e-12)
    pcie = costs.expert_prefill_seconds(30_000, model, 0.1, gpus, C)
    assert pcie == pytest.approx(15 * 0.9 * 653_908_770_816 / 96e9, rel=1e-12)
    assert pcie == pytest.approx(91.956, abs=1e-3)
    assert costs.expert_prefill_seconds(30_000, model, 0.1, gpus, C, cpu_experts=True) == pcie
    on_gpu = costs.prefill_seconds(30_000, 0, model, gpus, C)
    assert on_gpu == pytest.approx(15.890, abs=1e-3)
    assert costs.prefill_seconds(30_000, 0, model, gpus, C, 0.1) == pytest.approx(on_gpu + 91.956, abs=1e-3)
    assert costs.prefill_seconds(30_000, 0, model, gpus, C, 1.0) == on_gpu


def test_a_short_prefill_is_cheaper_on_the_cpu() -> None:
    """The same group, 100 input tokens: one pass touching 1 - (31/32)^100 = 1 - e^(100 ln 0.96875) = 0.958200
    of the experts, 0.958200 * 6.130395 s = 5.8741 s over PCIe, against 100 * 0.683772 / 74.36 = 0.91954 s on
    the CPU where host DRAM holds them all."""
    model, gpus = deepseek_v3_fp8(), preset_gpus("l40", 4)
    assert costs.expert_prefill_seconds(100, model, 0.1, gpus, C) == pytest.approx(5.8741, abs=1e-4)
    assert costs.expert_prefill_seconds(100, model, 0.1, gpus, C, cpu_experts=True) == pytest.approx(0.91954, abs=1e-5)


def test_a_prefill_packed_with_other_requests_pays_its_tokens_share_of_each_pass() -> None:
    """The same 100 tokens in passes full of other requests' tokens: 100 / 2048 of a full chunk's pass,
    100 * 6.130395 s / 2048 = 0.29934 s (the chunk touches 1 - 5e-29 of the experts), cheaper than the CPU's
    0.91954 s; 30,000 packed tokens cost the long prefill's rate, 89.801 s."""
    model, gpus = deepseek_v3_fp8(), preset_gpus("l40", 4)
    assert costs.expert_prefill_seconds(100, model, 0.1, gpus, C, packed=True) == pytest.approx(0.29934, abs=1e-5)
    assert costs.expert_prefill_seconds(100, model, 0.1, gpus, C, True, True) == pytest.approx(0.29934, abs=1e-5)
    assert costs.expert_prefill_seconds(30_000, model, 0.1, gpus, C, packed=True) == pytest.approx(89.801, abs=1e-3)
    on_gpu = costs.prefill_seconds(100, 0, model, gpus, C)
    assert costs.prefill_seconds(100, 0, model, gpus, C, 0.1, packed=True) == pytest.approx(on_gpu + 0.29934, abs=1e-5)


def test_larger_cards_prefill_in_larger_chunks() -> None:
    """vLLM's OpenAI server takes 8192 tokens a pass on cards of 70 GiB or more that are not A100s (H100,
    H200), 2048 elsewhere (vllm/engine/arg_utils.py): 30,000 tokens are 4 passes on 4 x H200 (3 of 8192, one
    of 5424), 15 on 4 x A100 80GB."""
    assert costs.prefill_chunk_tokens(preset_gpus("h200", 4)) == 8192
    assert costs.prefill_chunk_tokens(preset_gpus("a100-80gb-pcie", 4)) == 2048
    assert costs.expert_prefill_passes(30_000, 8 / 256, 8192) == pytest.approx(4.0, abs=1e-12)


def test_every_form_prices_the_same_prefill() -> None:
    """The restore-or-prefill rule, its grouped form and the long-prefill rate the greedy estimates with agree
    with `prefill_seconds` on the 30,000-token re-prefill above (nothing to restore), and the rate is within
    one pass: 30,000 * 6.13040 / 2048 = 89.801 s."""
    model, gpus = deepseek_v3_fp8(), preset_gpus("l40", 4)
    whole = costs.prefill_seconds(30_000, 0, model, gpus, C, 0.1)
    assert costs.kv_ready_seconds(30_000, 0, model, gpus, Tier.HOST, node(), C, 0, 0.1) == whole
    rates = costs.expert_prefill_rates(model, 0.1, gpus, C)
    grouped = costs.kv_ready_seconds_grouped(
        np.array([30_000]),
        np.array([0]),
        np.array([True]),
        model.kv_bytes_per_token,
        4,
        24e9,
        1e9,
        costs.prefill_seconds_per_token(model, gpus, C),
        costs.attention_seconds_per_pair(model, gpus, C),
        0,
        (np.array([rates[0]]), np.array([rates[1]]), np.array([rates[2]]), np.array([rates[3]])),
    )
    assert grouped[0] == pytest.approx(whole, rel=1e-12)
    assert 30_000 * costs.expert_prefill_seconds_per_token(*rates) == pytest.approx(89.801, abs=1e-3)
