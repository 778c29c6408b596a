"""Derived sizes against the published and computed figures in shared/data/models.json."""

import json
from pathlib import Path
from typing import Any

import pytest
from fixtures.make_hf_configs import write_hf_configs

from planner_service.domain.architecture import PRECISION_BYTES, Architecture, AttentionKind, Precision
from planner_service.domain.model_presets import MODEL_PRESETS, model_preset

HF_CONFIGS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "hf_configs"

# Published totals (models.json published_params, with the source it names).
PUBLISHED_TOTALS = [
    pytest.param("deepseek-v3", 671e9, id="deepseek-v3=671B (README_WEIGHTS.md)"),
    pytest.param("qwen3-235b-a22b", 235e9, id="qwen3-235b=235B (Qwen3 model card)"),
    pytest.param("qwen3-30b-a3b", 30.5e9, id="qwen3-30b=30.5B (model card)"),
    pytest.param("glm-4.5-air", 106e9, id="glm-4.5-air=106B (GLM-4.5 README)"),
    pytest.param("glm-4.5v", 106e9, id="glm-4.5v=106B LM, vision left out (model card)"),
    pytest.param("qwen2.5-coder-32b-instruct", 32.5e9, id="qwen2.5-coder-32b=32.5B (Qwen2.5-32B card)"),
    pytest.param("qwen2.5-7b-instruct", 7.61e9, id="qwen2.5-7b=7.61B (Qwen2.5 card)"),
    pytest.param("qwen2.5-vl-7b-instruct", 8.29e9, id="qwen2.5-vl-7b=8.29B incl vision (HF)"),
    pytest.param("llama-3.1-8b-instruct", 8.03e9, id="llama-3.1-8b=8.03B (Meta card)"),
    pytest.param("llama-3.3-70b-instruct", 70.6e9, id="llama-3.3-70b=70.6B (Meta card)"),
]


@pytest.mark.parametrize(("preset", "published"), PUBLISHED_TOTALS)
def test_total_params_within_2pct_of_published(preset: str, published: float) -> None:
    p = model_preset(preset)
    assert p.published_total_params == published
    assert p.architecture.total_params == pytest.approx(published, rel=0.02)


# models.json computed_params_total (computed_params_total_incl_vision for Qwen2.5-VL): our formulas
# are those of models.json, so the counts agree to the parameter.
COMPUTED_TOTALS = {
    "deepseek-v3": 671_026_419_200,
    "qwen3-235b-a22b": 235_093_634_560,
    "qwen3-30b-a3b": 30_532_122_624,
    "glm-4.5-air": 106_852_251_264,
    "glm-4.5v": 106_852_251_264,
    "qwen2.5-coder-32b-instruct": 32_763_876_352,
    "qwen2.5-7b-instruct": 7_615_616_512,
    "qwen2.5-vl-7b-instruct": 8_292_166_656,
    "llama-3.1-8b-instruct": 8_030_261_248,
    "llama-3.3-70b-instruct": 70_553_706_496,
}


@pytest.mark.parametrize(("preset", "expected"), COMPUTED_TOTALS.items())
def test_total_params_equal_models_json(preset: str, expected: int) -> None:
    assert model_preset(preset).architecture.total_params == expected


# Published active counts follow each publisher's convention; ours (models.json active_params_convention)
# excludes the input embedding only. Qwen includes it (models.json active_params_note); GLM's 12B matches
# only when the output head is left out too (12.80B - 0.62B lm_head) -- inferred, models.json does not say.
PUBLISHED_ACTIVE = [
    pytest.param("deepseek-v3", 37e9, "ours", id="deepseek-v3=37B (README_WEIGHTS.md)"),
    pytest.param("qwen3-235b-a22b", 22e9, "incl_embedding", id="qwen3-235b=22B incl embedding (card)"),
    pytest.param("qwen3-30b-a3b", 3.3e9, "incl_embedding", id="qwen3-30b=3.3B incl embedding (card)"),
    pytest.param("glm-4.5-air", 12e9, "excl_head", id="glm-4.5-air=12B excl embedding+head (README)"),
    pytest.param("glm-4.5v", 12e9, "excl_head", id="glm-4.5v=12B excl embedding+head (card)"),
]


@pytest.mark.parametrize(("preset", "published", "convention"), PUBLISHED_ACTIVE)
def test_active_params_within_5pct_of_published(preset: str, published: float, convention: str) -> None:
    p = model_preset(preset)
    arch = p.architecture
    derived = {
        "ours": arch.active_params,
        "incl_embedding": arch.active_params + arch.embedding_params,
        "excl_head": arch.active_params - arch.lm_head_params,
    }[convention]
    assert p.published_active_params == published
    assert derived == pytest.approx(published, rel=0.05)


def test_active_params_equal_models_json() -> None:
    # models.json computed_params_active.
    assert model_preset("deepseek-v3").architecture.active_params == 36_625_618_432
    assert model_preset("qwen3-30b-a3b").architecture.active_params == 3_041_867_776
    assert model_preset("glm-4.5-air").architecture.active_params == 12_803_372_672


@pytest.mark.parametrize("preset", [p for p, a in MODEL_PRESETS.items() if not a.architecture.is_moe])
def test_dense_models_read_everything_but_the_embedding(preset: str) -> None:
    arch = model_preset(preset).architecture
    assert arch.n_moe_layers == arch.routed_expert_params == arch.expert_bytes("bf16") == 0
    assert arch.dense_params == arch.total_params
    assert arch.active_params == arch.total_params - arch.embedding_params


# models.json kv_cache.bytes_per_token_bf16.
KV_BYTES_PER_TOKEN_BF16 = {
    "deepseek-v3": 70_272,  # MLA: 61 * (512 + 64) * 2
    "qwen3-235b-a22b": 192_512,
    "qwen3-30b-a3b": 98_304,
    "glm-4.5-air": 188_416,
    "glm-4.5v": 188_416,
    "qwen2.5-coder-32b-instruct": 262_144,
    "qwen2.5-7b-instruct": 57_344,
    "qwen2.5-vl-7b-instruct": 57_344,
    "llama-3.1-8b-instruct": 131_072,
    "llama-3.3-70b-instruct": 327_680,
}


@pytest.mark.parametrize(("preset", "expected"), KV_BYTES_PER_TOKEN_BF16.items())
def test_kv_bytes_per_token(preset: str, expected: int) -> None:
    arch = model_preset(preset).architecture
    assert arch.kv_bytes_per_token() == expected
    assert arch.kv_bytes_per_token(PRECISION_BYTES["fp8"]) == expected // 2  # models.json bytes_per_token_fp8


# models.json routed_expert: bytes_per_expert.bf16, bytes_all_routed_experts.bf16, moe_layers.
ROUTED_EXPERTS_BF16 = {
    "deepseek-v3": (88_080_384, 1_307_817_541_632, 58),
    "qwen3-235b-a22b": (37_748_736, 454_192_791_552, 94),
    "qwen3-30b-a3b": (9_437_184, 57_982_058_496, 48),
    "glm-4.5-air": (34_603_008, 199_313_326_080, 45),
    "glm-4.5v": (34_603_008, 199_313_326_080, 45),
}


@pytest.mark.parametrize(("preset", "expected"), ROUTED_EXPERTS_BF16.items())
def test_expert_bytes(preset: str, expected: tuple[int, int, int]) -> None:
    one_bf16, all_bf16, moe_layers = expected
    arch = model_preset(preset).architecture
    assert arch.is_moe
    assert arch.n_moe_layers == moe_layers
    assert arch.expert_bytes("bf16") == one_bf16
    assert arch.experts_bytes("bf16") == all_bf16
    assert arch.experts_bytes(Precision.int4) == all_bf16 // 4
    assert arch.dense_weight_bytes("bf16") + arch.experts_bytes("bf16") == arch.weight_bytes("bf16")


def test_weight_bytes_per_precision() -> None:
    # models.json DeepSeek-V3 weight_bytes.
    arch = model_preset("deepseek-v3").architecture
    assert arch.weight_bytes("bf16") == 1_342_052_838_400
    assert arch.weight_bytes("fp8") == 671_026_419_200
    assert arch.weight_bytes("int4") == 335_513_209_600
    with pytest.raises(ValueError, match="bf16, fp8, int4"):
        arch.weight_bytes("fp4")


def test_deepseek_geometry() -> None:
    arch = model_preset("deepseek-v3").architecture
    assert arch.attention == AttentionKind.mla == "mla"
    assert (arch.n_routed_experts, arch.experts_per_token, arch.n_shared_experts) == (256, 8, 1)
    assert arch.moe_layers == tuple(range(3, 61))  # first_k_dense_replace = 3
    assert arch.router_correction_bias


def test_presets_catalog() -> None:
    assert set(MODEL_PRESETS) == set(COMPUTED_TOTALS)
    assert model_preset("deepseek-v3").default_precisions == ("fp8", "int4")
    assert all(p.default_precisions[0] == "bf16" for k, p in MODEL_PRESETS.items() if k != "deepseek-v3")
    assert all(p.source for p in MODEL_PRESETS.values())
    with pytest.raises(KeyError) as info:
        model_preset("nope")
    assert "deepseek-v3" in str(info.value) and "llama-3.3-70b-instruct" in str(info.value)


def test_nested_text_config_matches_flat() -> None:
    # GLM-4.5V keeps the LM in text_config; the LM is GLM-4.5-Air's.
    nested = model_preset("glm-4.5v").architecture
    flat = model_preset("glm-4.5-air").architecture
    assert nested.total_params == flat.total_params
    assert nested.kv_bytes_per_token() == flat.kv_bytes_per_token()


# models.json computed_params_total for the verbatim configs in shared/data/hf_configs.
HF_CONFIG_TOTALS = {
    "aiconfigurator__deepseek-ai--DeepSeek-V3.json": 671_026_419_200,
    "aiconfigurator__moonshotai--Kimi-K2-Instruct.json": 1_026_408_232_448,
    "aiconfigurator__Qwen--Qwen3-235B-A22B.json": 235_093_634_560,
    "aiconfigurator__Qwen--Qwen3-30B-A3B.json": 30_532_122_624,
    "aiconfigurator__meta-llama--Meta-Llama-3.1-8B.json": 8_030_261_248,
}


def test_parses_config_files_to_their_hand_worked_sizes(tmp_path: Path) -> None:
    for path, sizes in write_hf_configs(tmp_path).items():
        arch = Architecture.from_hf_config(json.loads(path.read_text()))
        got = (arch.total_params, arch.dense_params, arch.active_params, arch.kv_bytes_per_token())
        assert got == sizes, path.name


def test_parses_shared_hf_configs() -> None:
    """The verbatim configs of ../shared, when they are there (an extra check on real files)."""
    if not HF_CONFIGS.is_dir():
        pytest.skip(f"{HF_CONFIGS} absent")
    paths = sorted(HF_CONFIGS.glob("*.json"))
    assert {p.name for p in paths} >= set(HF_CONFIG_TOTALS)
    for path in paths:
        config = json.loads(path.read_text())
        if path.name in HF_CONFIG_TOTALS:
            arch = Architecture.from_hf_config(config)
            assert arch.total_params == pytest.approx(HF_CONFIG_TOTALS[path.name], rel=0.005), path.name
            continue
        # Unsupported architectures (DeepSeek-V4) may parse, but may only fail with a clear ValueError.
        try:
            Architecture.from_hf_config(config)
        except ValueError as err:
            assert str(err), path.name


def _llama_config(**overrides: Any) -> dict[str, Any]:
    config = dict(model_preset("llama-3.1-8b-instruct").config)
    config.update(overrides)
    return {k: v for k, v in config.items() if v is not None}


def test_missing_field_is_named() -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        Architecture.from_hf_config(_llama_config(hidden_size=None))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
        ({"vocab_size": "128256"}, "vocab_size"),
        ({"model_type": "mamba"}, "model_type"),
        ({"model_type": ["llama"]}, "model_type"),  # not a name at all (JSON allows it): no TypeError
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ],
)
def test_inconsistent_field_is_named(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Architecture.from_hf_config(_llama_config(**overrides))


def test_moe_inconsistency_is_named() -> None:
    config = dict(model_preset("qwen3-30b-a3b").config, num_experts_per_tok=200)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        Architecture.from_hf_config(config)
