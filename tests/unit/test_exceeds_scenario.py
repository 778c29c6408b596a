"""The catalog-exceeds-HBM scenario: about 1 TB of weights on about 550 GB of HBM, sizes from the presets."""

from __future__ import annotations

from planner_service.domain.demo import demo_scenario
from planner_service.domain.exceeds import EXCEEDS_MODELS, exceeds_scenario, exceeds_sizes
from planner_service.domain.hardware import gpu_preset
from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.units import GIB


def test_the_catalog_needs_about_a_terabyte_at_native_precision() -> None:
    sizes = exceeds_sizes()
    native = {m["id"]: m["precisions"][0] for m in EXCEEDS_MODELS}
    total = sum(sizes[m][native[m]] + sizes[m].get("experts", 0) for m in sizes)
    assert 0.95e12 < total < 1.05e12
    # by hand: Llama-3.3-70B's 70.6 B parameters at 2 bytes (its model card's count)
    assert abs(sizes["longctx"]["bf16"] - 2 * 70.6e9) < 0.01 * 2 * 70.6e9


def test_the_cluster_is_the_demos_with_about_550_gb_of_hbm() -> None:
    problem = problem_from_scenario(exceeds_scenario())
    hbm = sum(gpu_preset(g.type).hbm_bytes for g in problem.gpus.values())
    assert hbm == 4 * 45 * GIB + 4 * 40 * GIB + 8 * 24 * GIB  # L40, A100 40GB, RTX 3090 (hardware.py)
    assert 540e9 < hbm < 600e9
    assert sorted(problem.gpus) == sorted(problem_from_scenario(demo_scenario()).gpus)
    assert sorted(problem.models) == sorted(m["id"] for m in EXCEEDS_MODELS)
    # nothing starts on a GPU; every node keeps every checkpoint on NVMe
    assert all(loc.tier.value == "nvme" for _, loc in problem.residency)
    assert {problem.node_of(loc) for _, loc in problem.residency} == set(problem.nodes)
