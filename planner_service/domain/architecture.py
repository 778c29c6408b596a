"""Model geometry read from a Hugging Face ``config.json``, and the sizes the planner derives from it.

Parameter, KV and expert formulas are those of ``shared/data/models.json`` ("formulas"); the totals they give
for the presets are checked against the published figures in ``tests/unit/test_architecture.py``.
MTP / nextn layers (DeepSeek-V3, GLM-4.5) are not counted: ``num_hidden_layers`` excludes them and
models.json lists them separately.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any


class Precision(StrEnum):
    bf16 = "bf16"
    fp8 = "fp8"
    int4 = "int4"


# Bytes per parameter (models.json formulas.weight_bytes). A uniform-precision estimate: real checkpoints
# add quantisation scales (fp8 128x128 blocks ~+0.02 %, int4 g128 ~+3-6 %) and keep norms/routers in bf16.
PRECISION_BYTES: Mapping[str, float] = MappingProxyType({"bf16": 2, "fp8": 1, "int4": 0.5})


def bytes_per_param(precision: str) -> float:
    try:
        return PRECISION_BYTES[precision]
    except KeyError:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISION_BYTES)}") from None


class AttentionKind(StrEnum):
    gqa = "gqa"  # grouped-query (MHA and MQA are the edge cases)
    mla = "mla"  # DeepSeek multi-head latent attention


# Supported HF model_type -> family; the family decides which fields are read and which implicit weights exist.
_FAMILIES: Mapping[str, str] = MappingProxyType(
    {
        "llama": "llama",
        "qwen2": "qwen2",
        "qwen2_5_vl": "qwen2",
        "qwen2_5_vl_text": "qwen2",
        "qwen3": "qwen3",
        "qwen3_moe": "qwen3",
        "deepseek_v3": "deepseek_v3",
        "kimi_k2": "deepseek_v3",  # Kimi-K2 ships DeepseekV3ForCausalLM
        "glm4_moe": "glm4_moe",
        "glm4v_moe": "glm4_moe",
        "glm4v_moe_text": "glm4_moe",
    }
)


def _int(cfg: Mapping[str, Any], field: str, default: int | None = None, minimum: int = 1) -> int:
    """An integer field, `default` when absent (no default: the field is required)."""
    # HF writes null for "not used" (e.g. DeepSeek-V2-Lite q_lora_rank), so None counts as absent.
    value = cfg.get(field)
    if value is None:
        if default is None:
            raise ValueError(f"config field {field!r} is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config field {field!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"config field {field!r} must be >= {minimum}, got {value}")
    return value


def _bool(cfg: Mapping[str, Any], field: str, default: bool) -> bool:
    value = cfg.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config field {field!r} must be a boolean, got {value!r}")
    return value


def _language_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The LM part of a config: vision-language configs (GLM-4.5V, newer Qwen-VL) nest it in text_config."""
    text = config.get("text_config")
    if "hidden_size" in config or not isinstance(text, Mapping):
        return config
    # Top-level keys (model_type, tie_word_embeddings) fill in what text_config leaves out.
    outer = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
    return {**outer, **text}


@dataclass(frozen=True, slots=True)
class Architecture:
    model_type: str
    attention: AttentionKind
    num_layers: int  # decoder layers, MTP/nextn layers excluded
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense SwiGLU width; 0 when every layer is MoE and the config omits it
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, GLM-4.5)
    # MLA only
    q_lora_rank: int = 0  # 0: q projected straight from the hidden state
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE only
    moe_layers: tuple[int, ...] = ()  # indices of decoder layers whose MLP is routed
    n_routed_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    router_correction_bias: bool = False  # sigmoid router's per-expert score bias (DeepSeek-V3, GLM-4.5)
    extra_params: int = 0  # weights outside the LM (e.g. a vision tower); counted in total, dense and active
    # the config's max_position_embeddings (0: absent): vLLM's default max_model_len and SGLang's context_len
    max_position_embeddings: int = 0

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], *, extra_params: int = 0) -> Architecture:
        """Read the fields of a HF config.json; a missing or inconsistent field raises ValueError naming it."""
        cfg = _language_config(config)
        model_type = cfg.get("model_type")
        if not isinstance(model_type, str) or model_type not in _FAMILIES:
            raise ValueError(f"config field 'model_type' is {model_type!r}; supported: {', '.join(sorted(_FAMILIES))}")
        family = _FAMILIES[model_type]
        num_layers = _int(cfg, "num_hidden_layers")
        hidden_size = _int(cfg, "hidden_size")
        num_heads = _int(cfg, "num_attention_heads")
        num_kv_heads = _int(cfg, "num_key_value_heads", default=num_heads)  # HF default: plain MHA
        if num_heads % num_kv_heads:
            raise ValueError(f"config field 'num_key_value_heads' ({num_kv_heads}) must divide {num_heads} heads")
        if cfg.get("head_dim") is None and hidden_size % num_heads:
            raise ValueError("config field 'head_dim' is missing and hidden_size is not a multiple of heads")
        rotary = cfg.get("partial_rotary_factor", 1.0)
        # GLM rotates only part of each head; that changes neither the weights nor the K cache width.
        if isinstance(rotary, bool) or not isinstance(rotary, int | float) or not 0 < rotary <= 1:
            raise ValueError(f"config field 'partial_rotary_factor' must be in (0, 1], got {rotary!r}")
        if extra_params < 0:
            raise ValueError(f"extra_params must be >= 0, got {extra_params}")

        fields: dict[str, Any] = {}
        if family == "deepseek_v3":
            fields.update(
                attention=AttentionKind.mla,
                q_lora_rank=_int(cfg, "q_lora_rank", default=0),
                kv_lora_rank=_int(cfg, "kv_lora_rank"),
                qk_rope_head_dim=_int(cfg, "qk_rope_head_dim"),
                qk_nope_head_dim=_int(cfg, "qk_nope_head_dim"),
                v_head_dim=_int(cfg, "v_head_dim"),
            )
        else:
            fields.update(
                attention=AttentionKind.gqa,
                # Qwen2 projections always carry q/k/v bias, whatever attention_bias says.
                qkv_bias=family == "qwen2" or _bool(cfg, "attention_bias", False),
                qk_norm=family == "qwen3" or (family == "glm4_moe" and _bool(cfg, "use_qk_norm", False)),
            )

        if family == "qwen3":
            n_experts = _int(cfg, "num_experts", default=0, minimum=0)
            step = _int(cfg, "decoder_sparse_step", default=1)
            mlp_only = cfg.get("mlp_only_layers") or []
            if not isinstance(mlp_only, list | tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in mlp_only
            ):
                raise ValueError(f"config field 'mlp_only_layers' must list layer indices < {num_layers}")
            # Qwen3MoeDecoderLayer: routed unless listed in mlp_only_layers, every decoder_sparse_step-th layer.
            moe_layers = tuple(i for i in range(num_layers) if n_experts and i not in mlp_only and (i + 1) % step == 0)
            n_shared = 0
            correction_bias = False
        elif family in ("deepseek_v3", "glm4_moe"):
            n_experts = _int(cfg, "n_routed_experts")
            n_shared = _int(cfg, "n_shared_experts", default=0, minimum=0)
            first_dense = _int(cfg, "first_k_dense_replace", default=0, minimum=0)
            if first_dense > num_layers:
                raise ValueError(f"config field 'first_k_dense_replace' ({first_dense}) exceeds {num_layers} layers")
            freq = _int(cfg, "moe_layer_freq", default=1)
            moe_layers = tuple(i for i in range(num_layers) if i >= first_dense and i % freq == 0)
            # DeepSeek-V3's noaux_tc router and every GLM-4.5 router learn an E-vector score correction bias.
            correction_bias = family == "glm4_moe" or cfg.get("topk_method", "noaux_tc") == "noaux_tc"
        else:
            n_experts, n_shared, moe_layers, correction_bias = 0, 0, (), False

        if moe_layers:
            top_k = _int(cfg, "num_experts_per_tok")
            if top_k > n_experts:
                raise ValueError(f"config field 'num_experts_per_tok' ({top_k}) exceeds {n_experts} experts")
            fields.update(
                moe_layers=moe_layers,
                n_routed_experts=n_experts,
                experts_per_token=top_k,
                moe_intermediate_size=_int(cfg, "moe_intermediate_size"),
                n_shared_experts=n_shared,
                router_correction_bias=correction_bias,
            )
        # Dense layers need intermediate_size; all-MoE configs may still carry an unused value.
        all_moe = len(moe_layers) == num_layers
        intermediate_size = _int(cfg, "intermediate_size", default=0 if all_moe else None)

        return cls(
            model_type=model_type,
            num_layers=num_layers,
            hidden_size=hidden_size,
            vocab_size=_int(cfg, "vocab_size"),
            num_attention_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=_int(cfg, "head_dim", default=hidden_size // num_heads),
            intermediate_size=intermediate_size,
            max_position_embeddings=_int(cfg, "max_position_embeddings", default=0, minimum=0),
            # Every supported family's config class defaults to untied embeddings.
            tie_word_embeddings=_bool(cfg, "tie_word_embeddings", False),
            extra_params=extra_params,
            **fields,
        )

    # --- counts -----------------------------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size  # input embedding table

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query, key) pair of a prefill, summed over the layers: 2 per multiply-add of q . k over
        the query-key width and of the attention weight times v over the value width, in every head. MLA
        prefills with full heads (qk_nope + qk_rope wide, v_head_dim values); GQA shares K and V between
        query heads, which saves no FLOPs."""
        if self.attention == AttentionKind.mla:
            qk, v = self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        else:
            qk = v = self.head_dim
        return self.num_layers * 2 * self.num_attention_heads * (qk + v)

    @property
    def attention_params(self) -> int:
        """Weights of one layer's attention block (formulas attn_gqa_params / attn_mla_params)."""
        h, nh = self.hidden_size, self.num_attention_heads
        if self.attention == AttentionKind.mla:
            qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                q = (
                    h * self.q_lora_rank  # q_a_proj: hidden -> q latent
                    + self.q_lora_rank  # q_a_layernorm
                    + self.q_lora_rank * nh * qk_head  # q_b_proj: latent -> per-head nope+rope query
                )
            else:
                q = h * nh * qk_head  # q_proj straight from hidden
            return (
                q
                + h * (self.kv_lora_rank + self.qk_rope_head_dim)  # kv_a_proj_with_mqa: latent + shared rope key
                + self.kv_lora_rank  # kv_a_layernorm
                + self.kv_lora_rank * nh * (self.qk_nope_head_dim + self.v_head_dim)  # kv_b_proj -> k_nope, v
                + nh * self.v_head_dim * h  # o_proj
            )
        q_dim = nh * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        return (
            h * q_dim  # q_proj
            + 2 * h * kv_dim  # k_proj, v_proj
            + q_dim * h  # o_proj
            + (q_dim + 2 * kv_dim if self.qkv_bias else 0)  # q, k, v biases
            + (2 * self.head_dim if self.qk_norm else 0)  # q_norm, k_norm weights (shared across heads)
        )

    @property
    def expert_params(self) -> int:
        """One routed expert of one layer: gate_proj and up_proj (H x I) plus down_proj (I x H)."""
        return 3 * self.hidden_size * self.moe_intermediate_size if self.is_moe else 0

    @property
    def routed_expert_params(self) -> int:
        return self.n_moe_layers * self.n_routed_experts * self.expert_params

    @property
    def total_params(self) -> int:
        h = self.hidden_size
        dense_mlp = 3 * h * self.intermediate_size  # SwiGLU gate, up, down
        moe_mlp = (
            self.n_routed_experts * h  # router weight E x H
            + (self.n_routed_experts if self.router_correction_bias else 0)  # router score correction bias
            + self.n_routed_experts * self.expert_params  # routed experts
            + self.n_shared_experts * self.expert_params  # shared experts, each as wide as a routed one
        )
        per_layer = self.attention_params + 2 * h  # + input_layernorm, post_attention_layernorm
        return (
            self.num_layers * per_layer
            + (self.num_layers - self.n_moe_layers) * dense_mlp
            + self.n_moe_layers * moe_mlp
            + h  # final norm
            + self.embedding_params
            + self.lm_head_params
            + self.extra_params
        )

    @property
    def dense_params(self) -> int:
        """Everything but the routed experts: what must be resident for any token."""
        return self.total_params - self.routed_expert_params

    @property
    def active_params(self) -> int:
        """Weights read per token (models.json active_params_convention): routed experts count top-k per
        layer; the input embedding is excluded since a token only gathers one row (kept when tied, as it
        is then also the lm_head)."""
        embedding_gather_only = 0 if self.tie_word_embeddings else self.embedding_params
        return (
            self.dense_params + self.n_moe_layers * self.experts_per_token * self.expert_params - embedding_gather_only
        )

    # --- bytes ------------------------------------------------------------------------------------------

    def kv_bytes_per_token(self, dtype_bytes: float = 2) -> int:
        if self.attention == AttentionKind.mla:
            # One compressed latent plus the shared rope key per layer (formulas kv_mla).
            elements = self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim)
        else:
            elements = 2 * self.num_layers * self.num_kv_heads * self.head_dim  # 2: K and V (formulas kv_gqa)
        return math.ceil(elements * dtype_bytes)

    def weight_bytes(self, precision: str) -> int:
        return math.ceil(self.total_params * bytes_per_param(precision))

    def dense_weight_bytes(self, precision: str) -> int:
        return math.ceil(self.dense_params * bytes_per_param(precision))

    def expert_bytes(self, precision: str) -> int:
        """One routed expert of one layer."""
        return math.ceil(self.expert_params * bytes_per_param(precision))

    def experts_bytes(self, precision: str) -> int:
        """All routed experts of all layers."""
        return math.ceil(self.routed_expert_params * bytes_per_param(precision))
