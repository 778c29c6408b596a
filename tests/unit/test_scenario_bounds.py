"""Every number of a scenario is finite and within the physical bounds of wire/bounds.py, else the error names it."""

from __future__ import annotations

import math
from typing import Any

import pytest

from planner_service.domain.demo import demo_scenario_json
from planner_service.domain.hardware import GPU_PRESETS
from planner_service.domain.model_presets import MODEL_PRESETS
from planner_service.domain.scenario import ModelIn, ScenarioError, parse_scenario
from planner_service.wire import bounds


def minimal() -> dict[str, Any]:
    return {
        "cluster": {"nodes": [{"id": "n1", "gpus": [{"id": "g1", "type": "l40"}]}]},
        "models": [{"id": "m", "preset": "qwen2.5-7b-instruct"}],
        "sessions": [{"id": "s1", "model": "m"}],
    }


def gpu(**fields: Any):
    return lambda d: d["cluster"]["nodes"][0]["gpus"][0].update(fields)


def node(**fields: Any):
    return lambda d: d["cluster"]["nodes"][0].update(fields)


def model(**fields: Any):
    return lambda d: d["models"][0].update(fields)


def section(name: str, **fields: Any):
    return lambda d: d.setdefault(name, {}).update(fields)


CASES = [
    (gpu(hbm_bytes_per_s=math.inf), "cluster.nodes.0.gpus.0.hbm_bytes_per_s"),
    (gpu(h2d_bytes_per_s=math.nan), "cluster.nodes.0.gpus.0.h2d_bytes_per_s"),
    (gpu(d2h_bytes_per_s=1e308), "cluster.nodes.0.gpus.0.d2h_bytes_per_s"),
    (gpu(d2h_bytes_per_s=bounds.MIN_BANDWIDTH_BYTES_PER_S / 2), "cluster.nodes.0.gpus.0.d2h_bytes_per_s"),
    (gpu(bf16_flops=bounds.MAX_FLOPS * 2), "cluster.nodes.0.gpus.0.bf16_flops"),
    (gpu(bf16_flops=1.0), "cluster.nodes.0.gpus.0.bf16_flops"),
    (gpu(hbm_bytes=bounds.MAX_GPU_BYTES + 1), "cluster.nodes.0.gpus.0.hbm_bytes"),
    (gpu(hbm_bytes=10 * 2**30, reserved_bytes=11 * 2**30), "reserved_bytes"),
    (node(host_dram_bytes=10**400), "cluster.nodes.0.host_dram_bytes"),
    (node(nvme_bytes=bounds.MAX_BYTES + 1), "cluster.nodes.0.nvme_bytes"),
    (node(nvme_read_bytes_per_s=-1.0), "cluster.nodes.0.nvme_read_bytes_per_s"),
    (node(nvme_write_bytes_per_s=2e13), "cluster.nodes.0.nvme_write_bytes_per_s"),
    (model(kv_bytes_per_token=bounds.MAX_BYTES + 1), "models.0.kv_bytes_per_token"),
    (model(weights_bytes={"bf16": 10**16}), "models.0.weights_bytes.bf16"),
    (model(active_params=bounds.MAX_PARAMS + 1), "models.0.active_params"),
    (model(min_gpus={"l40": bounds.MAX_TENSOR_PARALLEL + 1}), "models.0.min_gpus.l40"),
    (model(config={"model_type": "qwen2", "rope_scaling": {"factor": math.inf}}), "config.rope_scaling.factor"),
    (model(config={"model_type": "qwen2", "eos_token_id": [1, 10**20]}), "config.eos_token_id[1]"),
    (lambda d: d["sessions"][0].update(context_tokens=bounds.MAX_CONTEXT_TOKENS + 1), "sessions.0.context_tokens"),
    (
        lambda d: d.update(
            residency=[
                {
                    "object": {"kind": "experts", "model": "m"},
                    "location": {"tier": "nvme", "node": "n1"},
                    "bytes": 10**16,
                }
            ]
        ),
        "residency.0.bytes",
    ),
    (section("predictor", turn_gap_seconds=bounds.MAX_SECONDS * 2), "predictor.turn_gap_seconds"),
    (section("predictor", stay_probability=math.nan), "predictor.stay_probability"),
    (section("predictor", handoff={"m": {"m": math.inf}}), "predictor.handoff.m.m"),
    (section("constants", horizon_seconds=math.inf), "constants.horizon_seconds"),
    (section("constants", unserved_penalty_seconds=1e9), "constants.unserved_penalty_seconds"),
    (section("constants", gpu_price_seconds_per_gib=math.nan), "constants.gpu_price_seconds_per_gib"),
    (section("constants", prefill_efficiency=math.nan), "constants.prefill_efficiency"),
    (section("constants", move_weight=1e300), "constants.move_weight"),
    (section("constants", output_tokens_per_request=10**9), "constants.output_tokens_per_request"),
    (
        section("constants", slo_weights={"blocking": math.inf, "interactive": 2, "background": 1}),
        "constants.slo_weights.blocking",
    ),
]


@pytest.mark.parametrize(("edit", "field"), CASES)
def test_out_of_bounds_scenario_numbers_are_refused_by_field(edit, field):
    data = minimal()
    edit(data)
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(data)
    assert field in str(caught.value)


def test_the_demo_and_every_preset_fit_the_bounds():
    """Presets are the priors calibration starts from, and the live state is re-validated with calibrated
    figures merged in: a preset outside the bounds would make that state unplannable."""
    parse_scenario(demo_scenario_json())
    for name, spec in GPU_PRESETS.items():
        for rate in (spec.hbm_bytes_per_s, spec.h2d_bytes_per_s, spec.d2h_bytes_per_s):
            assert bounds.MIN_BANDWIDTH_BYTES_PER_S <= rate <= bounds.MAX_BANDWIDTH_BYTES_PER_S, name
        assert bounds.MIN_FLOPS <= spec.bf16_flops <= bounds.MAX_FLOPS, name
        assert 0 < spec.hbm_bytes <= bounds.MAX_GPU_BYTES, name
    for name, preset in MODEL_PRESETS.items():
        ModelIn(id="m", config=dict(preset.config))  # every number of a real config.json passes
        assert preset.published_total_params <= bounds.MAX_PARAMS, name


def test_bounds_are_ordered_and_floats_stay_exact():
    assert 0 < bounds.MIN_BANDWIDTH_BYTES_PER_S < bounds.MAX_BANDWIDTH_BYTES_PER_S
    assert 0 < bounds.MIN_FLOPS < bounds.MAX_FLOPS
    assert bounds.MAX_GPU_BYTES < bounds.MAX_BYTES < 2**53  # byte counts convert to floats exactly
    assert bounds.MAX_TOKENS < bounds.MAX_CONTEXT_TOKENS
