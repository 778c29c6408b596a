"""The cost model: how long moving state takes and what holding it costs.

Every function returns seconds (or seconds per token) and takes bytes and
bytes/s; the formulas, with units, are in each docstring. Planners, the
evaluator and the simulator all use these, so their numbers agree; what an engine transition adds
to a copy is the engine model's (domain/engines.py, planner/engine_costs.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from operator import attrgetter, truediv
from typing import Any, overload

import numpy as np

from planner_service.domain import engines
from planner_service.domain.architecture import bytes_per_param
from planner_service.domain.problem import Gpu, ModelSpec, Node, Problem
from planner_service.domain.scenario import CostConstants
from planner_service.domain.state import Tier
from planner_service.domain.units import GIB

_NVME = Tier.NVME  # bound once: on Python 3.11 an `Enum.MEMBER` lookup costs about ten global reads
_H2D = attrgetter("h2d_bytes_per_s")
_HBM = attrgetter("hbm_bytes_per_s")
_FLOPS = attrgetter("bf16_flops")
_PEER = attrgetter("peer_bytes_per_s")
_pipelined = engines.pipelined_copy_seconds

HBM_EFFICIENCY = 0.8  # achieved / spec HBM bandwidth (aiconfigurator, InferSim; perf_anchors.md section 6)

# A tensor-parallel group sums each layer's partial outputs twice per token: after the attention's o_proj and
# after the MLP's down_proj (or the routed experts), both RowParallelLinear, whose forward all-reduces when
# reduce_results and tp_size > 1 (vllm/model_executor/layers/linear.py; vllm/model_executor/models/llama.py).
ALLREDUCES_PER_LAYER = 2
# The reduced hidden state is in the model's dtype: bfloat16 for every preset, fp8 checkpoints included
# (config.json torch_dtype, ../shared/data/hf_configs).
ACTIVATION_BYTES = 2

# The CPU's rate on routed experts it computes from host DRAM (KTransformers, llama.cpp `--override-tensor
# exps=CPU`), measured, not assumed: KTransformers decodes DeepSeek-V3/R1 at Q4_K_M with every routed
# expert on the CPU at 11.26 tokens/s on 2 x 32-core Xeon Gold 6454S (perf_anchors.md section 3, from
# kvcache-ai/ktransformers doc/en/DeepseekR1_V3_tutorial.md). Each token reads 8 routed experts in each of
# 58 MoE layers, 3 * 7168 * 2048 parameters each (DeepSeek-V3 config.json: num_experts_per_tok 8, 61
# layers of which the first 3 are dense, hidden 7168, moe_intermediate 2048), at the Q4_K_M size of 377 GB
# for 671 B parameters (unsloth/DeepSeek-V3-GGUF). The tokens/s include the GPU's attention time, so the
# derived rate is a lower bound on what the CPU sustains (the cost it implies is an upper bound).
KTRANSFORMERS_DECODE_TOKENS_PER_S = 11.26
DEEPSEEK_V3_ROUTED_PARAMS_PER_TOKEN = 8 * 58 * 3 * 7168 * 2048  # experts/token * MoE layers * (gate, up, down) * dims
DEEPSEEK_V3_Q4_K_M_BYTES_PER_PARAM = 377e9 / 671e9  # GGUF size / parameters
CPU_EXPERT_BYTES_PER_S = (
    KTRANSFORMERS_DECODE_TOKENS_PER_S * DEEPSEEK_V3_ROUTED_PARAMS_PER_TOKEN * DEEPSEEK_V3_Q4_K_M_BYTES_PER_PARAM
)  # about 129 GB/s of expert weights read by the CPU

# A prefill is compute-bound on the CPU too (a chunk of C tokens reuses each expert's weights for about C * k / E
# of them), so its rate scales with the routed parameters a token computes, not their bytes: KTransformers
# prefills DeepSeek-V3 at Q4_K_M at 74.36 tokens/s on the same 2 x 32 cores (perf_anchors.md section 3; 255.26
# with the AMX kernel, which not every CPU has). With the GPU's attention in that time, a lower bound again.
KTRANSFORMERS_PREFILL_TOKENS_PER_S = 74.36
CPU_EXPERT_PREFILL_PARAMS_PER_S = (
    KTRANSFORMERS_PREFILL_TOKENS_PER_S * DEEPSEEK_V3_ROUTED_PARAMS_PER_TOKEN
)  # about 1.52e12 routed parameters a second

# vLLM prefills in chunks: a forward pass schedules at most max_num_batched_tokens tokens, which the OpenAI
# server sets to 8192 on a GPU of at least 70 GiB that is not an A100 (H100, H200), else 2048
# (vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults: default_max_num_batched_tokens).
PREFILL_CHUNK_TOKENS = 2048
PREFILL_CHUNK_TOKENS_LARGE_GPU = 8192
LARGE_GPU_BYTES = 70 * GIB  # against the card's capacity less 2 GiB reserved: the presets fall on the same sides


def copy_seconds(shard_bytes: Sequence[int], gpus: Sequence[Gpu], source: Tier, node: Node) -> float:
    """Time to copy tensor-parallel shards from `source` into their GPUs (no engine overhead).

    Shards move in parallel, each over its own GPU's PCIe link:
        t_pcie = max_i shard_i / h2d_i                      [B / (B/s)]
    From NVMe the node's drive is read once for all shards and feeds PCIe:
        t_nvme = sum_i shard_i / nvme_read                  [B / (B/s)]
    The path's bottleneck decides: t = max(t_pcie, t_nvme) (reads are pipelined
    through pinned host buffers, so the two stages overlap).
    From the host only the PCIe stage applies.
    """
    if len(shard_bytes) != len(gpus):
        raise ValueError(f"{len(shard_bytes)} shards for {len(gpus)} GPUs")
    if not shard_bytes:
        return 0.0
    t_pcie: float = max(map(truediv, shard_bytes, map(_H2D, gpus)))  # (attrgetter's values are typed Any)
    if source is _NVME:
        return _pipelined(t_pcie, sum(shard_bytes), node.nvme_read_bytes_per_s)
    return t_pcie


def even_copy_seconds(shard: int, gpus: Sequence[Gpu], source: Tier, node: Node) -> float:
    """`copy_seconds` of one equal shard per GPU (a shard alone: one GPU), without building the lists.

    Division rounds monotonically, so the slowest link's time is the shard over the smallest bandwidth.
    """
    t_pcie: float = shard / min(map(_H2D, gpus))
    if source is _NVME:
        return _pipelined(t_pcie, shard * len(gpus), node.nvme_read_bytes_per_s)
    return t_pcie


def write_down_seconds(nbytes: int, gpu: Gpu | None, target: Tier, node: Node) -> float:
    """Time to demote `nbytes` to `target`: d2h over the GPU's link, then the NVMe write if bound there.

    t = max(nbytes / d2h, nbytes / nvme_write)    (GPU -> NVMe)
    t = nbytes / d2h                              (GPU -> host)
    t = nbytes / nvme_write                       (host -> NVMe)
    """
    t = nbytes / gpu.d2h_bytes_per_s if gpu is not None else 0.0
    if target is Tier.NVME:
        t = max(t, nbytes / node.nvme_write_bytes_per_s)
    return t


def tp_allreduce_seconds_per_token(model: ModelSpec, gpus: Sequence[Gpu]) -> float:
    """What a tensor-parallel group of p = len(gpus) cards spends per token summing its partial outputs.

    Each of the model's layers all-reduces its hidden state twice per token (ALLREDUCES_PER_LAYER), a message
    of hidden_size * ACTIVATION_BYTES bytes. A ring all-reduce sends 2 (p - 1) / p of the message out of each
    card (NCCL's bus bandwidth: NVIDIA/nccl-tests doc/PERFORMANCE.md), over the slowest link of the group:
        bytes/token = ALLREDUCES_PER_LAYER * layers * 2 (p - 1) / p * hidden_size * ACTIVATION_BYTES   [B]
        t/token     = bytes/token / min_i peer_i                                              [B / (B/s)]
    with peer_i the card's GPU -> GPU rate (`Gpu.peer_bytes_per_s`; its h2d rate where that is unknown).
    It is serial with the compute (the next layer needs the sum) and the same per prefilled and per decoded
    token; 0 for one card, or where the model's layers or hidden size are unknown. The per-call latency of
    a small all-reduce is left out: this is the bandwidth term alone.
    """
    p = len(gpus)
    if p < 2 or not model.num_layers or not model.hidden_size:
        return 0.0
    link: float = min(peer or h2d for peer, h2d in zip(map(_PEER, gpus), map(_H2D, gpus), strict=True))
    sent = ALLREDUCES_PER_LAYER * model.num_layers * 2 * (p - 1) / p * model.hidden_size * ACTIVATION_BYTES
    return sent / link


def prefill_seconds_per_token(model: ModelSpec, gpus: Sequence[Gpu], constants: CostConstants) -> float:
    """Compute-bound prefill: 2 FLOPs per active parameter per token, on the group's dense bf16 FLOP/s, plus
    the tensor-parallel all-reduce of a group of several cards.

        t/token = 2 * active_params / (sum_i bf16_flops_i * prefill_efficiency)   [FLOP / (FLOP/s)]
                  + tp_allreduce_seconds_per_token(model, gpus)                    [s]
    The attention, which grows with the context, is `attention_seconds_per_pair` (`prefill_seconds`).
    """
    flops: float = sum(map(_FLOPS, gpus)) * constants.prefill_efficiency
    return 2 * model.active_params / flops + tp_allreduce_seconds_per_token(model, gpus)


@overload
def causal_pairs(tokens: float, prefix_tokens: float) -> float: ...
@overload
def causal_pairs(tokens: np.ndarray, prefix_tokens: np.ndarray | float) -> np.ndarray: ...
def causal_pairs(tokens: Any, prefix_tokens: Any) -> Any:
    """(query, key) pairs a causal prefill of `tokens` computes after `prefix_tokens` already cached: each new
    token attends to the prefix, the new tokens before it and itself.

        pairs = tokens * prefix + tokens * (tokens + 1) / 2
    Numbers or numpy arrays alike."""
    return tokens * prefix_tokens + tokens * (tokens + 1) / 2


def attention_seconds_per_pair(model: ModelSpec, gpus: Sequence[Gpu], constants: CostConstants) -> float:
    """Prefill seconds of one (query, key) pair, on the group's dense bf16 FLOP/s at the prefill efficiency:

        t/pair = attention_flops_per_pair / (sum_i bf16_flops_i * prefill_efficiency)   [FLOP / (FLOP/s)]
    (attention_flops_per_pair = layers * 2 * heads * (qk_head_dim + v_head_dim): 4 * layers * heads * head_dim
    for GQA). 0 where the model's shape is unknown."""
    flops: float = sum(map(_FLOPS, gpus)) * constants.prefill_efficiency
    return model.attention_flops_per_pair / flops


def prefill_seconds(
    tokens: int,
    prefix_tokens: int,
    model: ModelSpec,
    gpus: Sequence[Gpu],
    constants: CostConstants,
    gpu_expert_fraction: float = 1.0,
    cpu_experts: bool = False,
    packed: bool = False,
) -> float:
    """Prefill of `tokens` after `prefix_tokens` of cached context: the weights' per-token cost plus the
    attention, which grows with the context (quadratic in a prefill from scratch), plus a MoE's routed experts
    off GPU (the share 1 - `gpu_expert_fraction` of them; `cpu_experts`: a complete copy in host DRAM;
    `packed`: in passes shared with other requests' tokens, `expert_prefill_seconds`):

        t = tokens * prefill_seconds_per_token + causal_pairs(tokens, prefix) * attention_seconds_per_pair
            + expert_prefill_seconds(tokens, f)
    """
    if tokens <= 0:
        return 0.0
    return (
        tokens * prefill_seconds_per_token(model, gpus, constants)
        + causal_pairs(tokens, prefix_tokens) * attention_seconds_per_pair(model, gpus, constants)
        + expert_prefill_seconds(tokens, model, gpu_expert_fraction, gpus, constants, cpu_experts, packed)
    )


def kv_ready_seconds(
    missing_tokens: int,
    restorable_bytes: int,
    model: ModelSpec,
    gpus: Sequence[Gpu],
    source: Tier,
    node: Node,
    constants: CostConstants,
    prefix_tokens: int = 0,
    gpu_expert_fraction: float = 1.0,
    cpu_experts: bool = False,
) -> float:
    """Make a session's KV ready on GPU: restore what a lower tier holds, or re-prefill; the cheaper.
    The missing tokens follow `prefix_tokens` already on the group; restored ones come first.

    restore  = copy(restorable) + prefill(missing - restorable tokens after prefix + restorable)
    prefill  = prefill(missing tokens after prefix)          (`prefill_seconds`, a MoE's experts off GPU included)
    t        = min(restore, prefill)       (LMCache's load-or-prefill crossover)
    """
    return kv_ready(
        missing_tokens,
        restorable_bytes,
        model,
        gpus,
        source,
        node,
        constants,
        prefix_tokens,
        gpu_expert_fraction,
        cpu_experts,
    )[1]


def kv_ready(
    missing_tokens: int,
    restorable_bytes: int,
    model: ModelSpec,
    gpus: Sequence[Gpu],
    source: Tier,
    node: Node,
    constants: CostConstants,
    prefix_tokens: int = 0,
    gpu_expert_fraction: float = 1.0,
    cpu_experts: bool = False,
) -> tuple[int, float]:
    """`kv_ready_seconds` with its choice: (tokens to restore, 0 to re-prefill them all; seconds). A restore
    is chosen only where it is strictly cheaper; its copy loads each rank's share over that rank's own link
    (`ModelSpec.kv_bytes_per_gpu`: the whole latent on every rank under MLA, one KV head's share on each of the
    ranks that replicate it where the model has fewer KV heads than the group has GPUs)."""
    if missing_tokens <= 0:
        return 0, 0.0
    per_token = prefill_seconds_per_token(model, gpus, constants)
    per_pair = attention_seconds_per_pair(model, gpus, constants)
    prefill_all = (
        missing_tokens * per_token
        + causal_pairs(missing_tokens, prefix_tokens) * per_pair
        + expert_prefill_seconds(missing_tokens, model, gpu_expert_fraction, gpus, constants, cpu_experts)
    )
    if restorable_bytes <= 0 or model.kv_bytes_per_token == 0:
        return 0, prefill_all
    restored_tokens = min(missing_tokens, restorable_bytes // model.kv_bytes_per_token)
    shard = model.kv_bytes_per_gpu(restored_tokens, len(gpus))
    rest = missing_tokens - restored_tokens
    restore = (
        even_copy_seconds(shard, gpus, source, node)
        + rest * per_token
        + causal_pairs(rest, prefix_tokens + restored_tokens) * per_pair
        + expert_prefill_seconds(rest, model, gpu_expert_fraction, gpus, constants, cpu_experts)
    )
    return (restored_tokens, restore) if restore < prefill_all else (0, prefill_all)


def kv_ready_seconds_grouped(
    missing_tokens: np.ndarray,
    restorable_bytes: np.ndarray,
    from_host: np.ndarray,
    kv_bytes_per_token: np.ndarray | int,
    group_size: np.ndarray | int,
    slowest_h2d: np.ndarray | float,
    nvme_read: np.ndarray | float,
    per_token: np.ndarray | float,
    per_pair: np.ndarray | float = 0.0,
    prefix_tokens: np.ndarray | int = 0,
    experts: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
    split_ways: np.ndarray | int | None = None,
) -> np.ndarray:
    """`kv_ready_seconds` for many sessions at once, of one or several models and groups: each parameter
    is an array with one entry per session, or one number for all (KV bytes per token must not be 0).
    `from_host[i]` says whether session i's restorable bytes are in host DRAM (else on NVMe); the
    restore loads each rank's share over its own link, as `kv_ready` does.

    `group_size`, `slowest_h2d` and `nvme_read` describe the group the KV is restored onto: its GPU count,
    its smallest host->GPU bandwidth and its node's NVMe read bandwidth; `per_token` and `per_pair` its
    prefill seconds per token and per attention pair, `prefix_tokens` the tokens already on it; `experts`, a MoE's
    routed experts off GPU there: `expert_prefill_rates` (per pass, CPU per token, chunk, k / E) per session;
    `split_ways` over how many of its GPUs one token's KV splits (engines.kv_split_ways; None: all of them).
    """
    missing = np.maximum(missing_tokens, 0)
    prefill_all = missing * per_token + causal_pairs(missing, prefix_tokens) * per_pair
    if experts is not None:
        per_pass, cpu, chunk, share = experts
        prefill_all = prefill_all + expert_prefill_seconds_many(missing, per_pass, cpu, chunk, share)
    restored = np.minimum(missing, restorable_bytes // kv_bytes_per_token)
    shard = np.ceil(restored * kv_bytes_per_token / (group_size if split_ways is None else split_ways))
    restore = shard / slowest_h2d
    restore = np.where(from_host, restore, np.maximum(restore, shard * group_size / nvme_read))
    rest = missing - restored
    restore = restore + rest * per_token + causal_pairs(rest, prefix_tokens + restored) * per_pair
    if experts is not None:
        restore = restore + expert_prefill_seconds_many(rest, *experts)
    seconds: np.ndarray = np.where(restorable_bytes > 0, np.minimum(prefill_all, restore), prefill_all)
    return seconds


def expert_hit_rate(gpu_fraction: float, constants: CostConstants) -> float:
    """Share of routed-expert reads served from GPU when the hottest `gpu_fraction` of experts sits there.

        hit(f) = f ** skew,  skew in (0, 1]   (skew = 1: uniform routing, hit = f)
    Concave: the first experts kept on GPU are the popular ones.
    """
    if gpu_fraction <= 0:
        return 0.0
    hit: float = min(1.0, gpu_fraction) ** constants.expert_popularity_skew  # (a positive base: a real power)
    return hit


def expert_miss_seconds(
    tokens: int,
    model: ModelSpec,
    gpu_fraction: float,
    gpus: Sequence[Gpu],
    constants: CostConstants,
    cpu_experts: bool = False,
) -> float:
    """Decode seconds that `tokens` lose to routed experts off GPU: the MoE miss rule of planner and replay.

    miss  = tokens * (1 - hit(f)) * active_expert_bytes_per_token              [B]
    pcie  = miss / sum_i h2d_i            (stream the missed experts to the GPUs: MoE-Infinity)
    cpu   = miss / CPU_EXPERT_BYTES_PER_S (compute them where they sit in host DRAM: KTransformers)
    t     = min(pcie, cpu) where `cpu_experts` (a complete copy in host DRAM), else pcie
    """
    if not model.is_moe:
        return 0.0
    miss = 1.0 - expert_hit_rate(gpu_fraction, constants)
    pcie: float = tokens * miss * model.active_expert_bytes_per_token / sum(map(_H2D, gpus))
    if not cpu_experts:
        return pcie
    return min(pcie, tokens * miss * model.active_expert_bytes_per_token / CPU_EXPERT_BYTES_PER_S)


def decode_slowdown_seconds(
    model: ModelSpec, gpu_fraction: float, gpus: Sequence[Gpu], constants: CostConstants, cpu_experts: bool = False
) -> float:
    """Extra decode time of one predicted request (`output_tokens_per_request` tokens) when routed experts
    miss the GPU (`expert_miss_seconds`). The planner does not track where a MoE's experts sit below GPU
    per request, so it prices the PCIe stream (`cpu_experts` False), an upper bound on the replay's cost."""
    return expert_miss_seconds(constants.output_tokens_per_request, model, gpu_fraction, gpus, constants, cpu_experts)


def expert_step_bytes(
    model: ModelSpec, gpu_fraction: float, constants: CostConstants, batch: int = 1
) -> tuple[float, float]:
    """Bytes of routed experts one decode step of `batch` tokens touches: (on the GPUs, off them).

    Every MoE layer routes each token to k of its E experts (config.json `num_experts_per_tok`, and
    `n_routed_experts` or `num_experts`: 8 of 256 for DeepSeek-V3, 8 of 128 for Qwen3-235B-A22B and
    Qwen3-30B-A3B, ../shared/data/hf_configs); a step reads each expert its tokens route to once, whatever
    the number of tokens routed to it: vLLM's fused MoE kernel sorts the step's tokens by expert and runs
    each expert's block of them against its weights (vllm/model_executor/layers/fused_moe/
    moe_align_block_size.py), KTransformers' CPU operator counts the tokens per expert and runs one GEMM
    per expert (ktransformers/ktransformers_ext/operators/llamafile/moe.cpp, `MOE::forward_many`). With the
    hottest share f of the experts on GPU taking hit(f) of the reads (`expert_hit_rate`), and the experts of
    each side equally likely among themselves, an expert of side c (n_c of each layer's E experts, read
    share s_c) is routed a token with probability p_c = k * s_c / n_c, and b tokens, routed independently,
    touch

        touched_c(b) = n_c * (1 - (1 - p_c) ** b)     experts per layer
        gpu:  n = f E,        s = hit(f)       ->  bytes = f * experts_bytes * (1 - (1 - p_gpu) ** b)
        off:  n = (1 - f) E,  s = 1 - hit(f)   ->  bytes = (1 - f) * experts_bytes * (1 - (1 - p_off) ** b)
        p_gpu = hit(f) * a / (f X),  p_off = (1 - hit(f)) * a / ((1 - f) X)   (k / E = a / X)
    with X = experts_bytes (all routed experts) and a = active_expert_bytes_per_token, both [B]. One token
    touches hit(f) * a and (1 - hit(f)) * a, the per-token rule of `expert_miss_seconds`; under uniform
    routing (skew 1: p_gpu = p_off = k / E) the sum is the whole layer's E * (1 - (1 - k / E) ** b). A
    probability is at most 1 (the hit curve's head can ask more reads of each GPU expert than one token
    makes when the GPU holds under (k / E) ** (1 / (1 - skew)) of the experts: then each is touched once).
    (0, 0) for a dense model.
    """
    if not model.is_moe or batch <= 0:
        return 0.0, 0.0
    f = min(1.0, max(0.0, gpu_fraction))
    hit = expert_hit_rate(f, constants)
    total = float(model.experts_bytes)
    active = model.active_expert_bytes_per_token
    on_gpu = 0.0
    if f > 0:
        p_gpu = min(1.0, hit * active / (f * total))
        on_gpu = f * total * (1 - (1 - p_gpu) ** batch)
    off_gpu = 0.0
    if f < 1:
        p_off = min(1.0, (1 - hit) * active / ((1 - f) * total))
        off_gpu = (1 - f) * total * (1 - (1 - p_off) ** batch)
    return on_gpu, off_gpu


def decode_seconds_per_token(
    model: ModelSpec,
    precision: str,
    gpus: Sequence[Gpu],
    gpu_expert_fraction: float,
    constants: CostConstants,
    *,
    context_tokens: float = 0.0,
    cpu_experts: bool = False,
    expert_misses: bool = True,
    batch: int = 1,
    cpu_share: float = 1.0,
) -> float:
    """One memory-bound decode step of `batch` requests on the group, each request's time per output token
    (every request of the batch waits for the whole step): the weights read once, the experts the batch's
    tokens touch, every request's KV, the tensor-parallel all-reduce of the batch's tokens, and the MoE miss.

        on, off  = expert_step_bytes(model, f, constants, b)                            [B]
        t_step(b) = (weights_bytes + on + off + kv_bytes_per_token * context_tokens)
                    / (HBM_EFFICIENCY * sum_i hbm_i)                                    [B / (B/s)]
                    + b * tp_allreduce_seconds_per_token(model, gpus)                   [s]
                    + miss(b)                          (unless `expert_misses` is off)
        miss(b)  = off / sum_i h2d_i         (stream the touched experts off GPU to it: MoE-Infinity)
                   min(that, off / (cpu_share * CPU_EXPERT_BYTES_PER_S))   where `cpu_experts` (a complete
                   copy in host DRAM, computed there: KTransformers)            [B / (B/s)]
    `context_tokens` is the context the step attends to, summed over the batch's requests (the KV is
    sharded over the group, each card reading its share). Every touched expert is read from HBM, a streamed
    one after its copy (as at b = 1 before: for those the CPU computes, an upper bound). The CPU's rate is
    the batch-of-one KTransformers measurement (`CPU_EXPERT_BYTES_PER_S`), here the bytes of the experts a
    step touches, each read once for its tokens; its compute, which grows with the tokens per expert, is
    left out. `cpu_share` is the part of the node's CPU this engine's steps get where several engines'
    misses share it. At b = 1 this is the per-token price of a request decoding alone (`expert_miss_seconds`
    of one token, the whole active experts read from HBM).
    """
    on_gpu, off_gpu = expert_step_bytes(model, gpu_expert_fraction, constants, batch)
    hbm_bytes = model.weights_bytes[precision] + on_gpu + off_gpu + model.kv_bytes_per_token * context_tokens
    step: float = hbm_bytes / (HBM_EFFICIENCY * sum(map(_HBM, gpus))) + batch * tp_allreduce_seconds_per_token(
        model, gpus
    )
    if not model.is_moe or not expert_misses or off_gpu <= 0:
        return step
    pcie: float = off_gpu / sum(map(_H2D, gpus))
    if not cpu_experts:
        return step + pcie
    return step + min(pcie, off_gpu / (cpu_share * CPU_EXPERT_BYTES_PER_S))


def prefill_chunk_tokens(gpus: Sequence[Gpu]) -> int:
    """Tokens a forward pass of the group's engine prefills at most (vLLM's default max_num_batched_tokens)."""
    large = all(g.capacity_bytes >= LARGE_GPU_BYTES and "a100" not in g.type for g in gpus)
    return PREFILL_CHUNK_TOKENS_LARGE_GPU if large and gpus else PREFILL_CHUNK_TOKENS


@overload
def expert_prefill_passes(tokens: float, routing_share: float, chunk: int) -> float: ...
@overload
def expert_prefill_passes(
    tokens: np.ndarray, routing_share: np.ndarray | float, chunk: np.ndarray | int
) -> np.ndarray: ...
def expert_prefill_passes(tokens: Any, routing_share: Any, chunk: Any) -> Any:
    """Forward passes' worth of routed experts a prefill of `tokens` touches, in chunks of `chunk` tokens.

    Each token routes to k of E experts in every MoE layer (routing_share = k / E); with uniform routing a
    chunk of c tokens leaves an expert untouched with probability (1 - k / E)^c, so it touches a share
        touched(c) = 1 - (1 - k / E)^c                    (DeepSeek-V3, k / E = 8 / 256: 1 - 4e-29 at 2048)
        passes     = floor(tokens / chunk) * touched(chunk) + touched(tokens mod chunk)
    Numbers or numpy arrays of tokens alike."""
    full = tokens // chunk
    keep = 1.0 - routing_share
    return full * (1.0 - keep**chunk) + (1.0 - keep ** (tokens - full * chunk))


def expert_prefill_rates(
    model: ModelSpec, gpu_fraction: float, gpus: Sequence[Gpu], constants: CostConstants, cpu_experts: bool = False
) -> tuple[float, float, int, float]:
    """What `expert_prefill_seconds` needs of the model and group: (seconds to stream every routed expert off
    GPU once, CPU seconds per token where `cpu_experts` else 0, the chunk, k / E); zeros for a dense model or
    one whose experts are all on GPU."""
    if not model.is_moe or gpu_fraction >= 1.0:
        return 0.0, 0.0, 1, 0.0
    off = max(0.0, 1.0 - gpu_fraction)
    per_pass: float = off * model.experts_bytes / sum(map(_H2D, gpus))
    cpu = cpu_expert_prefill_seconds_per_token(model, gpu_fraction, constants) if cpu_experts else 0.0
    share = model.active_expert_bytes_per_token / model.experts_bytes
    return per_pass, cpu, prefill_chunk_tokens(gpus), share


def cpu_expert_prefill_seconds_per_token(model: ModelSpec, gpu_fraction: float, constants: CostConstants) -> float:
    """The CPU's part of `expert_prefill_seconds` per token: the routed parameters a token computes off GPU."""
    routed_params = model.active_expert_bytes_per_token / bytes_per_param(model.preferred)
    return (1.0 - expert_hit_rate(gpu_fraction, constants)) * routed_params / CPU_EXPERT_PREFILL_PARAMS_PER_S


def expert_prefill_seconds(
    tokens: int,
    model: ModelSpec,
    gpu_fraction: float,
    gpus: Sequence[Gpu],
    constants: CostConstants,
    cpu_experts: bool = False,
    packed: bool = False,
) -> float:
    """Prefill seconds that `tokens` lose to routed experts off GPU (the share 1 - f of them, f = `gpu_fraction`
    the group's node holds on GPU), priced as an engine runs them:

    pcie = passes(tokens) * (1 - f) * experts_bytes / sum_i h2d_i                   [B / (B/s)]
        vLLM and SGLang prefill in chunks (`prefill_chunk_tokens`), each a forward pass that touches almost
        every expert (`expert_prefill_passes`), and weights offloaded with --cpu-offload-gb are streamed to
        the GPU in every forward pass (perf_anchors.md section 8); f is the share held, not the hit rate: in
        a chunk the unpopular experts are used too.
    cpu  = tokens * (1 - hit(f)) * routed_params_per_token / CPU_EXPERT_PREFILL_PARAMS_PER_S   [params / (params/s)]
        KTransformers computes the experts off GPU on the CPU from host DRAM (its measured prefill rate,
        scaled by the routed parameters a token computes: DeepSeek-V3's 8 * 58 * 3 * 7168 * 2048).
    t    = min(pcie, cpu) where `cpu_experts` (a complete copy in host DRAM), else pcie
    One request's prefill alone pays each pass it touches whole. `packed`: its tokens ride in passes full of
    other requests' tokens (an engine with prefills queued fills each step's token budget from its waiting
    requests), so it pays a full chunk's passes per token, `expert_prefill_seconds_per_token`.
    """
    if tokens <= 0:
        return 0.0
    per_pass, cpu, chunk, share = expert_prefill_rates(model, gpu_fraction, gpus, constants, cpu_experts)
    if per_pass <= 0.0:
        return 0.0
    if packed:
        return tokens * expert_prefill_seconds_per_token(per_pass, cpu, chunk, share)
    pcie: float = expert_prefill_passes(tokens, share, chunk) * per_pass
    return min(pcie, tokens * cpu) if cpu > 0.0 else pcie


def expert_prefill_seconds_per_token(per_pass: float, cpu: float, chunk: int, share: float) -> float:
    """`expert_prefill_seconds` per token of a long prefill, from `expert_prefill_rates`: a full chunk's passes
    per token, or the CPU's rate where it is cheaper (`expert_prefill_seconds` of n tokens lies within one
    pass of n times this)."""
    pcie = per_pass * expert_prefill_passes(chunk, share, chunk) / chunk
    return min(pcie, cpu) if cpu > 0.0 else pcie


def expert_prefill_seconds_many(
    tokens: np.ndarray,
    per_pass: np.ndarray | float,
    cpu: np.ndarray | float,
    chunk: np.ndarray | int,
    share: np.ndarray | float,
) -> np.ndarray:
    """`expert_prefill_seconds` of many prefills at once from `expert_prefill_rates` (one chunk for all; the
    others an entry per prefill or one number for all)."""
    pcie = expert_prefill_passes(np.maximum(tokens, 0), share, chunk) * per_pass
    seconds: np.ndarray = np.where(np.asarray(cpu) > 0, np.minimum(pcie, np.maximum(tokens, 0) * cpu), pcie)
    return seconds


def gpu_hold_cost(nbytes: int, constants: CostConstants) -> float:
    """The warm memory tax: price [s/GiB] * bytes held on GPU / GiB."""
    return constants.gpu_price_seconds_per_gib * nbytes / GIB


def cold_group(problem: Problem, model: ModelSpec, precision: str, node: Node) -> tuple[Gpu, ...] | None:
    """The GPUs of `node` a cold load of the model would use: the fewest, largest cards that hold it, or its
    engine's GPUs where it runs on fixed ones (None if they cannot hold it, or the node cannot serve it)."""
    if not node.can_serve(model.id):
        return None
    nbytes = model.weights_bytes[precision]
    fixed = node.engine_gpus.get(model.id)
    if fixed is not None:
        group = tuple(problem.gpus[g] for g in fixed)
        return group if holds_evenly(group, model, nbytes) else None
    gpus = sorted((problem.gpus[g] for g in node.gpus), key=lambda g: (-g.capacity_bytes, g.id))
    kind = node.engine_kind(model.id)
    return next(
        (
            tuple(gpus[:k])
            for k in range(1, len(gpus) + 1)
            if engines.tensor_parallel_ok(kind, model.attention_heads, k) and holds_evenly(gpus[:k], model, nbytes)
        ),
        None,
    )


def holds_evenly(group: Sequence[Gpu], model: ModelSpec, nbytes: int) -> bool:
    """Whether each card of the group holds an even shard of `nbytes`, at the model's tensor-parallel minimum there."""
    if len(group) < max(model.min_gpus.get(g.type, 1) for g in group):
        return False
    return all(math.ceil(nbytes / len(group)) <= g.capacity_bytes for g in group)
