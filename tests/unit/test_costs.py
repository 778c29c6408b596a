"""The cost model's formulas against numbers worked by hand."""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
import pytest

from planner_service.domain.problem import Gpu, ModelSpec, Node
from planner_service.domain.scenario import CostConstants
from planner_service.domain.state import Tier
from planner_service.domain.units import GB, GIB
from planner_service.planner import costs

C = CostConstants()  # prefill_efficiency 0.5, engine overhead 0.3 s, price 0.02 s/GiB, skew 0.5, 256 output tokens


def gpu(gpu_id: str, *, h2d: float = 20 * GB, flops: float = 100e12, capacity: int = 24 * GIB, type_: str = "x") -> Gpu:
    return Gpu(gpu_id, "n0", type_, capacity, 1e12, flops, h2d, 10 * GB)


def node(*gpu_ids: str, nvme_read: float = 5 * GB, nvme_write: float = 2 * GB) -> Node:
    return Node("n0", 256 * GIB, 4096 * GIB, nvme_read, nvme_write, frozenset(), gpu_ids)


def dense(weights_bytes: int = 20 * GB, active_params: int = 10 * 10**9, kv: int = 100_000) -> ModelSpec:
    return ModelSpec(
        "m", ("bf16",), MappingProxyType({"bf16": weights_bytes}), kv, 0, 0, active_params, 0, MappingProxyType({})
    )


def test_copy_seconds_is_bound_by_nvme_when_the_drive_is_slower_than_the_links() -> None:
    g = [gpu("a"), gpu("b")]
    # PCIe: 10 GB per link at 20 GB/s = 0.5 s in parallel; NVMe: 20 GB at 5 GB/s = 4 s -> NVMe binds
    assert costs.copy_seconds([10 * GB, 10 * GB], g, Tier.NVME, node("a", "b")) == pytest.approx(4.0)
    # from host only the links count
    assert costs.copy_seconds([10 * GB, 10 * GB], g, Tier.HOST, node("a", "b")) == pytest.approx(0.5)
    # a fast drive (100 GB/s: 0.2 s) leaves PCIe as the bottleneck
    fast = node("a", "b", nvme_read=100 * GB)
    assert costs.copy_seconds([10 * GB, 10 * GB], g, Tier.NVME, fast) == pytest.approx(0.5)


def test_copy_seconds_waits_for_the_slowest_link() -> None:
    g = [gpu("a", h2d=20 * GB), gpu("b", h2d=10 * GB)]
    assert costs.copy_seconds([10 * GB, 10 * GB], g, Tier.HOST, node("a", "b")) == pytest.approx(1.0)
    assert costs.copy_seconds([], [], Tier.HOST, node()) == 0.0


def test_tensor_parallel_shards_load_in_parallel() -> None:
    one, two = [gpu("a")], [gpu("a"), gpu("b")]
    n = node("a", "b")
    # 20 GB from host: 1.0 s over one link, 0.5 s over two (each GPU copies its 10 GB shard at 20 GB/s)
    assert costs.even_copy_seconds(20 * GB, one, Tier.HOST, n) == pytest.approx(1.0)
    assert costs.even_copy_seconds(10 * GB, two, Tier.HOST, n) == pytest.approx(0.5)
    assert costs.even_copy_seconds(0, two, Tier.HOST, n) == 0.0


def test_write_down_seconds() -> None:
    g = gpu("a")  # d2h 10 GB/s
    n = node("a")  # NVMe write 2 GB/s
    assert costs.write_down_seconds(10 * GB, g, Tier.HOST, n) == pytest.approx(1.0)
    assert costs.write_down_seconds(10 * GB, g, Tier.NVME, n) == pytest.approx(5.0)
    assert costs.write_down_seconds(10 * GB, None, Tier.NVME, n) == pytest.approx(5.0)


def test_prefill_is_compute_bound_on_the_groups_flops() -> None:
    m = dense(active_params=10 * 10**9)
    # 2 * 1e10 FLOP per token / (2 GPUs * 100 TFLOP/s * 0.5) = 2e-4 s per token
    assert costs.prefill_seconds_per_token(m, [gpu("a"), gpu("b")], C) == pytest.approx(2e-4)


def test_kv_ready_takes_the_cheaper_of_restore_and_prefill() -> None:
    g, n = [gpu("a")], node("a")
    m = dense(active_params=10 * 10**9, kv=100_000)  # prefill 4e-4 s/token on one GPU
    tokens = 10_000  # 1 GB of KV
    prefill = tokens * 4e-4  # 4 s
    # nothing to restore: prefill everything
    assert costs.kv_ready_seconds(tokens, 0, m, g, Tier.HOST, n, C) == pytest.approx(prefill)
    # from host: 1 GB at 20 GB/s = 0.05 s beats 4 s of prefill
    assert costs.kv_ready_seconds(tokens, 1 * GB, m, g, Tier.HOST, n, C) == pytest.approx(0.05)
    # half restorable from NVMe (0.5 GB at 5 GB/s = 0.1 s) + prefill of the other half (2 s)
    assert costs.kv_ready_seconds(tokens, GB // 2, m, g, Tier.NVME, n, C) == pytest.approx(2.1)
    # a model that prefills very fast: re-prefill (4e-4 s) beats the NVMe read (0.2 s)
    cheap = dense(active_params=10**7, kv=100_000)
    assert costs.kv_ready_seconds(tokens, 1 * GB, cheap, g, Tier.NVME, n, C) == pytest.approx(tokens * 4e-7)
    assert costs.kv_ready_seconds(0, GB, m, g, Tier.HOST, n, C) == 0.0


def test_expert_hit_rate_is_concave_in_the_fraction_on_gpu() -> None:
    assert costs.expert_hit_rate(0.0, C) == 0.0
    assert costs.expert_hit_rate(0.25, C) == pytest.approx(0.5)  # 0.25 ** 0.5
    assert costs.expert_hit_rate(1.0, C) == 1.0
    assert costs.expert_hit_rate(1.5, C) == 1.0
    uniform = CostConstants(expert_popularity_skew=1.0)
    assert costs.expert_hit_rate(0.25, uniform) == pytest.approx(0.25)


def test_decode_slowdown_fetches_missed_experts_over_pcie() -> None:
    moe = ModelSpec(
        "moe", ("bf16",), MappingProxyType({"bf16": GB}), 0, 64 * GB, GB // 64, 10**9, GB // 100, MappingProxyType({})
    )
    g = [gpu("a"), gpu("b")]  # 40 GB/s together
    # 256 tokens * (1 - 0.5) * 0.01 GB / 40 GB/s at f = 0.25
    assert costs.decode_slowdown_seconds(moe, 0.25, g, C) == pytest.approx(256 * 0.5 * 0.01 / 40)
    assert costs.decode_slowdown_seconds(moe, 1.0, g, C) == 0.0
    assert costs.decode_slowdown_seconds(dense(), 0.0, g, C) == 0.0


def test_gpu_hold_cost_is_price_per_gib() -> None:
    assert costs.gpu_hold_cost(10 * GIB, C) == pytest.approx(0.2)
    assert costs.gpu_hold_cost(0, C) == 0.0


def test_kv_ready_for_many_sessions_matches_one_at_a_time() -> None:
    model = dense()
    group = [gpu("a", h2d=20 * GB), gpu("b", h2d=12 * GB)]
    where = node("a", "b")
    per_token = costs.prefill_seconds_per_token(model, group, C)
    cases = [  # (missing tokens, restorable bytes, from host)
        (0, 0, True), (-5, 10**9, True), (1000, 0, True), (1000, 40 * 10**6, True), (1000, 200 * 10**6, False),
        (50_000, 5 * 10**9, True), (50_000, 5 * 10**9, False), (7, 100_000 * 3, False),
    ]  # fmt: skip
    many = costs.kv_ready_seconds_grouped(
        np.array([m for m, _, _ in cases]),
        np.array([r for _, r, _ in cases]),
        np.array([h for _, _, h in cases]),
        model.kv_bytes_per_token, len(group), min(g.h2d_bytes_per_s for g in group), where.nvme_read_bytes_per_s,
        per_token,
    )  # fmt: skip
    for (missing, restorable, host), seconds in zip(cases, many, strict=True):
        tier = Tier.HOST if host else Tier.NVME
        assert seconds == pytest.approx(
            costs.kv_ready_seconds(missing, restorable, model, group, tier, where, C), rel=1e-12
        )
