"""The SRV: fractions per model, state kind and tier, on a tiny hand-built problem."""

from __future__ import annotations

from planner_service.domain.problem import compile_problem
from planner_service.domain.scenario import parse_scenario
from planner_service.domain.state import Location, StateObject
from planner_service.domain.units import GIB
from planner_service.planner.srv import srv_rows

KV_PER_TOKEN = 1024


def problem():
    return compile_problem(
        parse_scenario(
            {
                "cluster": {
                    "nodes": [
                        {
                            "id": "a",
                            "gpus": [
                                {
                                    "id": "a0",
                                    "hbm_bytes": 40 * GIB,
                                    "hbm_bytes_per_s": 1e12,
                                    "bf16_flops": 1e14,
                                    "h2d_bytes_per_s": 2e10,
                                },
                                {
                                    "id": "a1",
                                    "hbm_bytes": 40 * GIB,
                                    "hbm_bytes_per_s": 1e12,
                                    "bf16_flops": 1e14,
                                    "h2d_bytes_per_s": 2e10,
                                },
                            ],
                        },
                        {"id": "b"},
                    ]
                },
                "models": [
                    {
                        "id": "dense",
                        "precisions": ["bf16", "int4"],
                        "weights_bytes": {"bf16": 16 * GIB, "int4": 4 * GIB},
                        "kv_bytes_per_token": KV_PER_TOKEN,
                    },
                    {
                        "id": "moe",
                        "precisions": ["fp8"],
                        "weights_bytes": {"fp8": 2 * GIB},
                        "kv_bytes_per_token": KV_PER_TOKEN,
                        "experts_bytes": 64 * GIB,
                        "expert_bytes": GIB,
                    },
                ],
                "sessions": [
                    {"id": "s1", "model": "dense", "context_tokens": 1000},
                    {"id": "s2", "model": "dense", "context_tokens": 3000},
                ],
            }
        ),
        {},
    )


def rows(placement):
    return {(r.model, r.state.value, r.tier.value): (r.fraction, r.bytes) for r in srv_rows(problem(), placement)}


def test_tensor_parallel_shards_add_up_and_copies_cap_at_one():
    w = StateObject.weights("dense", "bf16")
    out = rows(
        {
            (w, Location.gpu("a0")): 8 * GIB,
            (w, Location.gpu("a1")): 8 * GIB,
            (w, Location.nvme("a")): 16 * GIB,
            (w, Location.nvme("b")): 16 * GIB,
        }
    )
    assert out[("dense", "weights", "gpu")] == (1.0, 16 * GIB)
    assert out[("dense", "weights", "nvme")] == (1.0, 32 * GIB)


def test_weights_fraction_is_the_most_resident_precision():
    out = rows(
        {
            (StateObject.weights("dense", "int4"), Location.host("a")): 4 * GIB,
            (StateObject.weights("dense", "bf16"), Location.host("a")): 4 * GIB,
        }
    )
    assert out[("dense", "weights", "host")] == (1.0, 8 * GIB)


def test_experts_and_kv_fractions():
    out = rows(
        {
            (StateObject.experts("moe"), Location.gpu("a0")): 16 * GIB,
            (StateObject.kv("dense", "s1"), Location.gpu("a0")): 1000 * KV_PER_TOKEN,
            (StateObject.kv("dense", "s2"), Location.gpu("a0")): 1000 * KV_PER_TOKEN,
        }
    )
    assert out[("moe", "experts", "gpu")] == (0.25, 16 * GIB)
    # 2,000 of the sessions' 4,000 tokens of KV
    assert out[("dense", "kv", "gpu")] == (0.5, 2000 * KV_PER_TOKEN)
    assert ("moe", "weights", "gpu") not in out


def test_empty_placement_has_no_rows():
    assert srv_rows(problem(), {}) == ()
