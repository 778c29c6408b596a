"""Decode time lost to routed experts off GPU: PCIe streaming or CPU compute, the cheaper."""

import pytest

from planner_service.domain.demo import demo_scenario
from planner_service.domain.problem import Gpu
from planner_service.sim.engine import base_problem
from planner_service.sim.moe import CPU_EXPERT_BYTES_PER_S, miss_seconds_per_token


def test_the_cpu_rate_comes_from_the_ktransformers_measurement() -> None:
    # 11.26 tokens/s * 20.43e9 routed parameters/token * 0.5618 bytes/parameter (Q4_K_M) ~ 129 GB/s
    assert CPU_EXPERT_BYTES_PER_S == pytest.approx(129.3e9, rel=1e-3)


def test_the_cheaper_path_is_charged() -> None:
    problem = base_problem(demo_scenario())
    reasoner = problem.models["reasoner"]
    gpu = next(iter(problem.gpus.values()))
    one = (gpu,)
    c = problem.constants
    miss = reasoner.active_expert_bytes_per_token  # nothing on GPU: every routed expert misses
    assert miss_seconds_per_token(reasoner, 0.0, one, c, cpu_experts=False) == pytest.approx(miss / gpu.h2d_bytes_per_s)
    assert miss_seconds_per_token(reasoner, 0.0, one, c) == pytest.approx(miss / CPU_EXPERT_BYTES_PER_S)
    # many wide links beat the CPU: PCIe is charged
    wide = tuple(
        Gpu(
            f"g{i}",
            gpu.node,
            gpu.type,
            gpu.capacity_bytes,
            gpu.hbm_bytes_per_s,
            gpu.bf16_flops,
            200e9,
            gpu.d2h_bytes_per_s,
        )
        for i in range(4)
    )
    assert miss_seconds_per_token(reasoner, 0.0, wide, c) == pytest.approx(miss / 800e9)
    assert miss_seconds_per_token(reasoner, 1.0, one, c) == 0.0
    assert miss_seconds_per_token(problem.models["planner"], 0.0, one, c) == 0.0
