"""The policy registry and what distinguishes each policy."""

from __future__ import annotations

import pytest

from planner_service.domain.scenario import parse_scenario
from planner_service.sim.engine import Simulator, simulate
from planner_service.sim.metrics import summarize
from planner_service.sim.policies import PolicyName, PolicyRegistry, create_policy, default_registry
from planner_service.sim.policies.lru import LruPolicy
from planner_service.sim.trace import TraceRequest

GB = 10**9


def scenario(gpus: int = 1, gpu_bytes: int = 10 * GB):
    model = {"weights_bytes": {"bf16": 4 * GB}, "kv_bytes_per_token": 1000, "active_params": 250_000_000}
    return parse_scenario(
        {
            "cluster": {
                "nodes": [
                    {
                        "id": "n1",
                        "nvme_read_bytes_per_s": 0.5 * GB,
                        "gpus": [
                            {
                                "id": f"g{i}",
                                "hbm_bytes": gpu_bytes,
                                "hbm_bytes_per_s": 1000 * GB,
                                "bf16_flops": 1e12,
                                "h2d_bytes_per_s": 1 * GB,
                            }
                            for i in range(gpus)
                        ],
                    }
                ]
            },
            "models": [{"id": m, **model} for m in ("a", "b", "c")],
            "residency": [
                {
                    "object": {"kind": "weights", "model": m, "precision": "bf16"},
                    "location": {"tier": "nvme", "node": "n1"},
                    "bytes": 4 * GB,
                }
                for m in ("a", "b", "c")
            ],
        }
    )


def test_every_policy_is_registered_under_its_name() -> None:
    assert default_registry().names() == [str(n) for n in PolicyName]
    for name in PolicyName:
        options = {"partition": {}} if name is PolicyName.STATIC_TUNED else {}  # (its searched partition)
        assert create_policy(name, **options).name == name


def test_unknown_policy_lists_the_choices() -> None:
    with pytest.raises(
        ValueError, match="unknown policy 'nope'; choose one of: statebudget, statebudget-groups, static, lru"
    ):
        create_policy("nope")


def test_registering_twice_raises() -> None:
    registry = PolicyRegistry()
    registry.register(PolicyName.LRU, LruPolicy)
    with pytest.raises(ValueError, match="registered already"):
        registry.register(PolicyName.LRU, LruPolicy)


def test_lru_unloads_after_the_keep_alive() -> None:
    records = [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=0, output_tokens=0),
        TraceRequest(t=1000.0, session="s1", model="a", input_tokens=0, output_tokens=0),
    ]
    result = simulate(scenario(), records, LruPolicy(keep_alive_seconds=300.0))
    # a cold start, 8 s of copy from NVMe + 30 s; put to sleep at the first tick past 300 s idle (level 1: the
    # first load left a host copy, the backup); woken from it: 0.1 s + 4 s of copy
    assert [r.switch_seconds for r in result.requests] == pytest.approx([38.0, 4.1])
    kept = simulate(scenario(), records, LruPolicy(keep_alive_seconds=5000.0))
    assert [r.switch_seconds for r in kept.requests] == pytest.approx([38.0, 0.0])


def test_static_keeps_its_fixed_models_and_loads_the_rest_into_the_room_left() -> None:
    # a and b fill two 5 GB GPUs (4 GB each); c is asked for rarely and has no room left: the fixed ones stay
    records = [
        TraceRequest(t=float(i), session=f"s{i}", model="a" if i % 2 else "b", input_tokens=0, output_tokens=0)
        for i in range(8)
    ]
    sim = Simulator(scenario(gpus=2, gpu_bytes=5 * GB), records, create_policy("static"))
    result = sim.run()
    assert set(sim.models) == {"a", "b"}
    assert all(r.switch_seconds == pytest.approx(0.0) for r in result.requests)


def test_independent_partitions_gpus_between_models() -> None:
    records = [
        TraceRequest(t=float(i), session="s", model=m, input_tokens=0, output_tokens=0) for i, m in enumerate("aab")
    ]
    sim = Simulator(scenario(gpus=2), records, create_policy("independent"))
    sim.run()
    parts = sim.policy.partition
    assert parts["a"] != parts["b"] and not parts["a"] & parts["b"]


def test_independent_gives_a_model_the_group_its_engine_is_declared_on() -> None:
    data = scenario(gpus=4).model_dump(mode="json", exclude_none=True)
    engine = {"kind": "vllm", "features": ["sleep_mode", "dev_mode"]}
    data["cluster"]["nodes"][0]["engines"] = [{"model": "a", **engine, "gpus": ["g2"]}] + [
        {"model": m, **engine} for m in ("b", "c")
    ]
    records = [
        TraceRequest(t=float(i), session="s", model=m, input_tokens=0, output_tokens=0) for i, m in enumerate("aab")
    ]
    free = Simulator(scenario(gpus=4), records, create_policy("independent"))
    free.run()
    assert free.policy.partition["a"] == {"g0", "g3"}  # one GPU each, the spare one to a by demand share
    declared = Simulator(parse_scenario(data), records, create_policy("independent"))
    result = declared.run()
    # a's engine runs on g2 only: that is its partition, and the spare GPU goes to b (a's could not use it)
    assert declared.policy.partition["a"] == {"g2"} and declared.policy.partition["b"] == {"g0", "g3"}
    assert result.fallback_loads == 0 and all(r.state == "done" for r in result.requests)


def test_statebudget_calls_the_planner_online() -> None:
    records = [
        TraceRequest(t=10.0 * i, session="s1", model="abc"[i % 3], input_tokens=500, output_tokens=10) for i in range(9)
    ]
    sim = Simulator(scenario(gpu_bytes=6 * GB), records, create_policy("statebudget"))
    result = sim.run()
    assert result.planner_seconds and result.violations == 0
    assert all(r.state == "done" for r in result.requests)


def test_the_report_counts_requests_served_below_their_models_preferred_precision() -> None:
    # a's bf16 (8 GB) fits no 5 GB GPU, so every policy serves it at int4; b serves at its only precision
    data = scenario(gpus=2, gpu_bytes=5 * GB).model_dump(mode="json", exclude_none=True)
    a = next(m for m in data["models"] if m["id"] == "a")
    a["precisions"], a["weights_bytes"] = ["bf16", "int4"], {"bf16": 8 * GB, "int4": 2 * GB}
    data["residency"][0] = {
        "object": {"kind": "weights", "model": "a", "precision": "int4"},
        "location": {"tier": "nvme", "node": "n1"},
        "bytes": 2 * GB,
    }
    records = [
        TraceRequest(t=float(i), session=f"s{i}", model="a" if i == 0 else "b", input_tokens=0, output_tokens=0)
        for i in range(4)
    ]
    for policy in ("lru", "static", "statebudget"):
        result = simulate(parse_scenario(data), records, create_policy(policy))
        assert [r.degraded for r in result.requests] == [True, False, False, False], policy
        assert summarize(result)["degraded_precision_rate"] == 0.25
