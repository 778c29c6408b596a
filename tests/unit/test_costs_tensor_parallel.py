"""The tensor-parallel all-reduce term of the cost model against numbers worked by hand."""

from __future__ import annotations

import dataclasses

import pytest

from planner_service.domain.hardware import gpu_preset
from planner_service.domain.problem import Gpu, ModelSpec, resolve_model
from planner_service.domain.scenario import CostConstants, ModelIn
from planner_service.planner import costs

C = CostConstants()  # prefill_efficiency 0.5


def preset_gpus(kind: str, count: int) -> list[Gpu]:
    spec = gpu_preset(kind)
    return [
        Gpu(
            f"{kind}-{i}",
            "n0",
            kind,
            spec.hbm_bytes,
            spec.hbm_bytes_per_s,
            spec.bf16_flops,
            spec.h2d_bytes_per_s,
            spec.d2h_bytes_per_s,
            spec.peer_bytes_per_s,
        )
        for i in range(count)
    ]


def coder() -> ModelSpec:
    return resolve_model(ModelIn.model_validate({"id": "coder", "preset": "qwen2.5-coder-32b-instruct"}), "coder")


def test_qwen_coder_32b_on_two_l40s_over_pcie4() -> None:
    """Qwen2.5-Coder-32B (config: 64 layers, hidden 5120), bf16 activations, on 2 x L40 (PCIe4 peer 21.8 GB/s):

        bytes/token = 2 all-reduces * 64 layers * 2 (2 - 1) / 2 * 5120 * 2 B = 1,310,720 B
        t/token     = 1,310,720 B / 21.8e9 B/s = 60.12 us

    Prefill was 2 * 31,985,308,672 params / (2 * 181.05e12 FLOP/s * 0.5) = 353.3 us/token: the all-reduce adds
    17 %. Decode was 65,527,752,704 B / (0.8 * 2 * 864e9 B/s) = 47.40 ms/token: it adds 0.13 %.
    """
    model, pair = coder(), preset_gpus("l40", 2)
    assert (model.num_layers, model.hidden_size, model.active_params) == (64, 5120, 31_985_308_672)
    assert costs.tp_allreduce_seconds_per_token(model, pair) == pytest.approx(60.12e-6, rel=1e-4)
    assert costs.prefill_seconds_per_token(model, pair, C) == pytest.approx(353.3e-6 + 60.12e-6, rel=1e-4)
    assert costs.decode_seconds_per_token(model, "bf16", pair, 0.0, C) == pytest.approx(47.40e-3 + 60.12e-6, rel=1e-4)


def test_four_rtx_3090s_all_reduce_through_host() -> None:
    """4 x RTX 3090 (no peer access: 11 GB/s through host): 2 * 64 * 2 * 3 / 4 * 5120 * 2 B = 1,966,080 B,
    / 11e9 B/s = 178.7 us per token."""
    assert costs.tp_allreduce_seconds_per_token(coder(), preset_gpus("rtx-3090", 4)) == pytest.approx(
        178.73e-6, rel=1e-4
    )


def test_one_card_adds_nothing() -> None:
    model, one = coder(), preset_gpus("l40", 1)
    assert costs.tp_allreduce_seconds_per_token(model, one) == 0.0
    assert costs.prefill_seconds_per_token(model, one, C) == 2 * model.active_params / (one[0].bf16_flops * 0.5)


def test_unknown_layers_add_nothing() -> None:
    model = dataclasses.replace(coder(), num_layers=0, hidden_size=0)
    assert costs.tp_allreduce_seconds_per_token(model, preset_gpus("l40", 4)) == 0.0


def test_the_slowest_link_decides_and_h2d_stands_in_for_an_unknown_peer_rate() -> None:
    l40 = preset_gpus("l40", 1)[0]
    custom = dataclasses.replace(l40, id="custom", type="custom", h2d_bytes_per_s=10e9, peer_bytes_per_s=0.0)
    # 1,310,720 B (two cards) over the custom card's 10 GB/s h2d
    assert costs.tp_allreduce_seconds_per_token(coder(), [l40, custom]) == pytest.approx(131.072e-6, rel=1e-12)
