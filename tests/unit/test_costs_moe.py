"""The MoE miss rule (`costs.expert_miss_seconds`): PCIe streaming or CPU compute, the cheaper."""

import pytest

from planner_service.domain.demo import demo_scenario
from planner_service.domain.problem import Gpu
from planner_service.planner.costs import CPU_EXPERT_BYTES_PER_S, decode_slowdown_seconds, expert_miss_seconds
from planner_service.sim.engine import base_problem


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
    assert expert_miss_seconds(1, reasoner, 0.0, one, c, cpu_experts=False) == pytest.approx(miss / gpu.h2d_bytes_per_s)
    assert expert_miss_seconds(1, reasoner, 0.0, one, c, cpu_experts=True) == pytest.approx(
        miss / CPU_EXPERT_BYTES_PER_S
    )
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
    assert expert_miss_seconds(1, reasoner, 0.0, wide, c, cpu_experts=True) == pytest.approx(miss / 800e9)
    assert expert_miss_seconds(1, reasoner, 1.0, one, c) == 0.0
    assert expert_miss_seconds(1, problem.models["planner"], 0.0, one, c) == 0.0


def test_the_planners_slowdown_is_the_same_rule_over_its_predicted_tokens() -> None:
    problem = base_problem(demo_scenario())
    reasoner, c = problem.models["reasoner"], problem.constants
    one = (next(iter(problem.gpus.values())),)
    for fraction in (0.0, 0.3, 1.0):
        assert decode_slowdown_seconds(reasoner, fraction, one, c) == pytest.approx(
            c.output_tokens_per_request * expert_miss_seconds(1, reasoner, fraction, one, c)
        )
