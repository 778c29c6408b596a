"""GET /v1/engines: the demo's vLLM engines, now and once the current plan is done."""

from __future__ import annotations

from planner_service.wire.engines import EngineOut


def test_the_demo_lists_its_engines_with_state_settings_gpus_and_bytes(demo):
    demo.post("/v1/plan")
    response = demo.get("/v1/engines")
    assert response.status_code == 200
    rows = [EngineOut.model_validate(r) for r in response.json()]
    assert len(rows) == 4 * 7 and all(r.kind.value == "vllm" for r in rows)
    coder = next(r for r in rows if (r.node, r.model) == ("n2", "coder"))
    assert (coder.state.value, coder.gpus, coder.id) == ("running", ["n2-g0", "n2-g1"], "coder@bf16@n2-g0+n2-g1")
    assert {f.value for f in coder.features} == {"lmcache", "sleep_mode", "dev_mode"}
    # weights shard + KV pool + CUDA context per GPU; LMCache's CPU tier in host RAM
    assert coder.gpu_bytes_per_gpu > 30 * 2**30 and coder.host_bytes == 2 * 5 * 2**30
    vision = next(r for r in rows if (r.node, r.model) == ("n4", "vision"))
    assert (vision.state.value, vision.gpus, vision.gpu_bytes_per_gpu) == ("asleep_host", ["n4-g1"], 2**30)
    assert any(r.planned_step is not None for r in rows)


def test_each_engine_lists_the_calls_the_plan_makes_of_it_in_order(demo):
    plan = demo.post("/v1/plan").json()
    expected: dict[tuple[str, str], list[str]] = {}
    for op in plan["operations"]:
        if op.get("engine"):
            calls = expected.setdefault((op["node"], op["object"]["model"]), [])
            if not calls or calls[-1] != op["engine"]["transition"]:
                calls.append(op["engine"]["transition"])
    rows = [EngineOut.model_validate(r) for r in demo.get("/v1/engines").json()]
    assert (
        expected
        and {(r.node, r.model): [t.value for t in r.planned_steps] for r in rows if r.planned_steps} == expected
    )
