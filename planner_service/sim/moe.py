"""Decode time lost to routed experts that are not on the GPU.

Offloading engines serve a missed expert one of two ways, and the simulator
charges the cheaper:

* **stream it over PCIe** to the GPU (MoE-Infinity, Mixtral-offloading):
  `miss * active_expert_bytes_per_token / sum_i h2d_i` per token, the
  planner's own formula (`costs.decode_slowdown_seconds`);
* **compute it on the CPU** where it sits in host DRAM (KTransformers,
  llama.cpp `--override-tensor exps=CPU`): the CPU reads the expert's
  weights from DRAM once per token, so
  `miss * active_expert_bytes_per_token / CPU_EXPERT_BYTES_PER_S`.

`miss = 1 - costs.expert_hit_rate(f)` for the share `f` of the model's routed
experts on the serving node's GPUs.

CPU_EXPERT_BYTES_PER_S is measured, not assumed: KTransformers decodes
DeepSeek-V3/R1 at Q4_K_M with every routed expert on the CPU at 11.26 tokens/s
on 2 x 32-core Xeon Gold 6454S (perf_anchors.md section 3, from
kvcache-ai/ktransformers doc/en/DeepseekR1_V3_tutorial.md). Each token reads
8 routed experts in each of 58 MoE layers, 3 * 7168 * 2048 parameters each
(DeepSeek-V3 config.json: num_experts_per_tok 8, 61 layers of which the first
3 are dense, hidden 7168, moe_intermediate 2048), at the Q4_K_M size of
377 GB for 671 B parameters (unsloth/DeepSeek-V3-GGUF). The tokens/s also
include the GPU's attention time, so the derived rate is a lower bound on
what the CPU sustains (the cost it implies is an upper bound).
"""

from __future__ import annotations

from collections.abc import Sequence

from planner_service.domain.problem import Gpu, ModelSpec
from planner_service.domain.scenario import CostConstants
from planner_service.planner import costs

KTRANSFORMERS_DECODE_TOKENS_PER_S = 11.26  # DeepSeek-V3 Q4_K_M, experts on 2 x 32 cores (perf_anchors.md section 3)
DEEPSEEK_V3_ROUTED_PARAMS_PER_TOKEN = 8 * 58 * 3 * 7168 * 2048  # experts/token * MoE layers * (gate, up, down) * dims
DEEPSEEK_V3_Q4_K_M_BYTES_PER_PARAM = 377e9 / 671e9  # GGUF size / parameters
CPU_EXPERT_BYTES_PER_S = (
    KTRANSFORMERS_DECODE_TOKENS_PER_S * DEEPSEEK_V3_ROUTED_PARAMS_PER_TOKEN * DEEPSEEK_V3_Q4_K_M_BYTES_PER_PARAM
)  # about 129 GB/s of expert weights read by the CPU


def miss_seconds_per_token(
    model: ModelSpec, gpu_fraction: float, gpus: Sequence[Gpu], constants: CostConstants, cpu_experts: bool = True
) -> float:
    """Extra decode seconds per token for routed experts off GPU: PCIe streaming or CPU compute, the cheaper."""
    if not model.is_moe:
        return 0.0
    miss_bytes = (1.0 - costs.expert_hit_rate(gpu_fraction, constants)) * model.active_expert_bytes_per_token
    pcie = miss_bytes / sum(g.h2d_bytes_per_s for g in gpus)
    return min(pcie, miss_bytes / CPU_EXPERT_BYTES_PER_S) if cpu_experts else pcie
