"""The list-free and batched cost helpers give exactly what the general formulas give."""

from __future__ import annotations

import math
from types import MappingProxyType

import numpy as np

from planner_service.domain.problem import Gpu, ModelSpec, Node
from planner_service.domain.scenario import CostConstants
from planner_service.domain.state import Tier
from planner_service.domain.units import GB, GIB
from planner_service.planner import costs

C = CostConstants()


def gpu(gpu_id: str, h2d: float) -> Gpu:
    return Gpu(gpu_id, "n0", "x", 24 * GIB, 1e12, 100e12, h2d, 10 * GB)


def node(*gpu_ids: str, nvme_read: float) -> Node:
    return Node("n0", 256 * GIB, 4096 * GIB, nvme_read, 2 * GB, frozenset(), gpu_ids)


def model(kv: int) -> ModelSpec:
    return ModelSpec("m", ("bf16",), MappingProxyType({"bf16": 20 * GB}), kv, 0, 0, 10**10, 0, MappingProxyType({}))


def test_even_copy_seconds_equals_copy_seconds_of_equal_shards() -> None:
    groups = [
        [gpu("a", 20 * GB)],
        [gpu("a", 20 * GB), gpu("b", 12 * GB)],
        [gpu("a", 7e9), gpu("b", 13 * GB), gpu("c", 9e9)],
    ]
    for gpus in groups:
        for nvme_read in (1e9, 5 * GB, 100 * GB):
            where = node(*(g.id for g in gpus), nvme_read=nvme_read)
            for shard in (0, 1, 123_456_789, 7 * GB + 3):
                for tier in (Tier.HOST, Tier.NVME):
                    expected = costs.copy_seconds([shard] * len(gpus), gpus, tier, where)
                    assert costs.even_copy_seconds(shard, gpus, tier, where) == expected


def test_kv_ready_for_several_groups_at_once_matches_each_group_alone() -> None:
    rng = np.random.default_rng(0)
    groups = [  # (model, GPUs, node)
        (model(100_000), [gpu("a", 20 * GB), gpu("b", 12 * GB)], node("a", "b", nvme_read=5 * GB)),
        (model(327_680), [gpu("a", 9.6e9)], node("a", nvme_read=3e9)),
        (
            model(57_344),
            [gpu("a", 20 * GB), gpu("b", 20 * GB), gpu("c", 11e9), gpu("d", 20 * GB)],
            node("a", "b", "c", "d", nvme_read=7e9),
        ),
    ]
    columns: list[list[np.ndarray]] = [[] for _ in range(8)]
    expected = []
    for m, gpus, where in groups:
        missing = rng.integers(-50, 60_000, 9)
        restorable = rng.integers(0, 3, 9) * rng.integers(1, 10**10, 9)
        from_host = rng.random(9) < 0.5
        per_token = costs.prefill_seconds_per_token(m, gpus, C)
        slowest = min(g.h2d_bytes_per_s for g in gpus)
        expected.append(costs.kv_ready_seconds_grouped(
            missing, restorable, from_host, m.kv_bytes_per_token, len(gpus), slowest, where.nvme_read_bytes_per_s, per_token
        ))  # fmt: skip
        for values, value in zip(
            columns,
            (
                missing,
                restorable,
                from_host,
                m.kv_bytes_per_token,
                len(gpus),
                slowest,
                where.nvme_read_bytes_per_s,
                per_token,
            ),
            strict=True,
        ):
            values.append(value if isinstance(value, np.ndarray) else np.full(9, value))
        # and one session alone agrees with the scalar formula
        tier = Tier.HOST if from_host[0] else Tier.NVME
        alone = costs.kv_ready_seconds(int(missing[0]), int(restorable[0]), m, gpus, tier, where, C)
        assert math.isclose(expected[-1][0], alone, rel_tol=1e-12) or (missing[0] <= 0 and alone == 0.0)
    batched = costs.kv_ready_seconds_grouped(*(np.concatenate(values) for values in columns))
    assert np.array_equal(batched, np.concatenate(expected))
