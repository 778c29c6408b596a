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
    tokens: int, prefix_tokens: int, model: ModelSpec, gpus: Sequence[Gpu], constants: CostConstants
) -> float:
    """Prefill of `tokens` after `prefix_tokens` of cached context: the weights' per-token cost plus the
    attention, which grows with the context (quadratic in a prefill from scratch):

        t = tokens * prefill_seconds_per_token + causal_pairs(tokens, prefix) * attention_seconds_per_pair
    """
    if tokens <= 0:
        return 0.0
    return tokens * prefill_seconds_per_token(model, gpus, constants) + causal_pairs(
        tokens, prefix_tokens
    ) * attention_seconds_per_pair(model, gpus, constants)


def kv_ready_seconds(
    missing_tokens: int,
    restorable_bytes: int,
    model: ModelSpec,
    gpus: Sequence[Gpu],
    source: Tier,
    node: Node,
    constants: CostConstants,
    prefix_tokens: int = 0,
) -> float:
    """Make a session's KV ready on GPU: restore what a lower tier holds, or re-prefill; the cheaper.
    The missing tokens follow `prefix_tokens` already on the group; restored ones come first.

    restore  = copy(restorable) + prefill(missing - restorable tokens after prefix + restorable)
    prefill  = prefill(missing tokens after prefix)          (`prefill_seconds`)
    t        = min(restore, prefill)       (LMCache's load-or-prefill crossover)
    """
    return kv_ready(missing_tokens, restorable_bytes, model, gpus, source, node, constants, prefix_tokens)[1]


def kv_ready(
    missing_tokens: int,
    restorable_bytes: int,
    model: ModelSpec,
    gpus: Sequence[Gpu],
    source: Tier,
    node: Node,
    constants: CostConstants,
    prefix_tokens: int = 0,
) -> tuple[int, float]:
    """`kv_ready_seconds` with its choice: (tokens to restore, 0 to re-prefill them all; seconds). A restore
    is chosen only where it is strictly cheaper; its copy loads each rank's share over that rank's own link
    (`ModelSpec.kv_bytes_per_gpu`: the whole latent on every rank under MLA, one KV head's share on each of the
    ranks that replicate it where the model has fewer KV heads than the group has GPUs)."""
    if missing_tokens <= 0:
        return 0, 0.0
    per_token = prefill_seconds_per_token(model, gpus, constants)
    per_pair = attention_seconds_per_pair(model, gpus, constants)
    prefill_all = missing_tokens * per_token + causal_pairs(missing_tokens, prefix_tokens) * per_pair
    if restorable_bytes <= 0 or model.kv_bytes_per_token == 0:
        return 0, prefill_all
    restored_tokens = min(missing_tokens, restorable_bytes // model.kv_bytes_per_token)
    shard = model.kv_bytes_per_gpu(restored_tokens, len(gpus))
    rest = missing_tokens - restored_tokens
    restore = (
        even_copy_seconds(shard, gpus, source, node)
        + rest * per_token
        + causal_pairs(rest, prefix_tokens + restored_tokens) * per_pair
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
    split_ways: np.ndarray | int | None = None,
) -> np.ndarray:
    """`kv_ready_seconds` for many sessions at once, of one or several models and groups: each parameter
    is an array with one entry per session, or one number for all (KV bytes per token must not be 0).
    `from_host[i]` says whether session i's restorable bytes are in host DRAM (else on NVMe); the
    restore loads each rank's share over its own link, as `kv_ready` does.

    `group_size`, `slowest_h2d` and `nvme_read` describe the group the KV is restored onto: its GPU count,
    its smallest host->GPU bandwidth and its node's NVMe read bandwidth; `per_token` and `per_pair` its
    prefill seconds per token and per attention pair, `prefix_tokens` the tokens already on it; `split_ways`
    over how many of its GPUs one token's KV splits (engines.kv_split_ways; None: all of them).
    """
    missing = np.maximum(missing_tokens, 0)
    prefill_all = missing * per_token + causal_pairs(missing, prefix_tokens) * per_pair
    restored = np.minimum(missing, restorable_bytes // kv_bytes_per_token)
    shard = np.ceil(restored * kv_bytes_per_token / (group_size if split_ways is None else split_ways))
    restore = shard / slowest_h2d
    restore = np.where(from_host, restore, np.maximum(restore, shard * group_size / nvme_read))
    rest = missing - restored
    restore = restore + rest * per_token + causal_pairs(rest, prefix_tokens + restored) * per_pair
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
) -> float:
    """Memory-bound decode: a step reads the weights, the active experts and the request's KV once from HBM,
    plus the tensor-parallel all-reduce of a group of several cards, plus the MoE miss.

        t/token = (weights_bytes + active_expert_bytes_per_token + kv_bytes_per_token * context_tokens)
                  / (HBM_EFFICIENCY * sum_i hbm_i)                                     [B / (B/s)]
                  + tp_allreduce_seconds_per_token(model, gpus)
                  + expert_miss_seconds(1 token, f)         (unless `expert_misses` is off)
    `context_tokens` is the context the step attends to (the KV is sharded over the group, each card reading
    its share). Concurrent requests of a model share its steps (a batch), so the weights are read once for
    all; each request is priced with its own KV and the all-reduce of a batch of one (a step of b requests
    reads each one's KV and sends b times the bytes), a lower bound on a loaded group's step.
    """
    step: float = (
        model.weights_bytes[precision] + model.active_expert_bytes_per_token + model.kv_bytes_per_token * context_tokens
    ) / (HBM_EFFICIENCY * sum(map(_HBM, gpus))) + tp_allreduce_seconds_per_token(model, gpus)
    if not model.is_moe or not expert_misses:
        return step
    return step + expert_miss_seconds(1, model, gpu_expert_fraction, gpus, constants, cpu_experts)


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
