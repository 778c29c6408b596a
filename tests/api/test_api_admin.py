"""Topology, catalog and node agents' registration and telemetry."""

from __future__ import annotations

from api_helpers import FakeClock, assert_problem, request

from planner_service.domain.hardware import DEFAULT_NVME_READ_BYTES_PER_S, gpu_preset


def test_get_cluster_shape(demo):
    nodes = demo.get("/v1/cluster").json()["nodes"]
    assert [n["id"] for n in nodes] == ["n1", "n2", "n3", "n4"]
    gpu = nodes[0]["gpus"][0]
    preset = gpu_preset("l40")  # the demo's n1 holds L40s, with 2 GiB held back for the engine
    assert (gpu["id"], gpu["type"], gpu["reserved_bytes"]) == ("n1-g0", "l40", 2 * 2**30)
    assert gpu["capacity_bytes"] == preset.hbm_bytes - gpu["reserved_bytes"]
    assert (gpu["h2d_bytes_per_s"], gpu["hbm_bytes_per_s"]) == (preset.h2d_bytes_per_s, preset.hbm_bytes_per_s)
    assert gpu["calibrated"] == {}  # nothing measured yet
    assert 0 < gpu["used_bytes"] <= gpu["capacity_bytes"] and 0 < gpu["planned_bytes"] <= gpu["capacity_bytes"]
    assert nodes[0]["capabilities"] == ["kv_offload", "partial_experts", "weights_offload"]
    assert nodes[0]["nvme_read_bytes_per_s"] == DEFAULT_NVME_READ_BYTES_PER_S


def test_put_cluster_replaces_topology_and_forgets_state_on_removed_hardware(demo):
    cluster = demo.get("/v1/cluster").json()
    body = {
        "nodes": [
            {
                "id": n["id"],
                "host_dram_bytes": n["host_dram_bytes"],
                "nvme_bytes": n["nvme_bytes"],
                "gpus": [{"id": g["id"], "type": g["type"], "reserved_bytes": g["reserved_bytes"]} for g in n["gpus"]],
            }
            for n in cluster["nodes"]
            if n["id"] != "n4"
        ]
    }
    version = demo.get("/v1/srv").json()["version"]
    out = demo.client.put("/v1/cluster", json=body)
    assert out.status_code == 200 and [n["id"] for n in out.json()["nodes"]] == ["n1", "n2", "n3"]
    srv = demo.get("/v1/srv").json()
    assert srv["version"] == version + 1
    assert not [
        e
        for e in srv["placement"]
        if e["location"].get("node") == "n4" or e["location"].get("gpu", "").startswith("n4")
    ]
    demo.post("/v1/plan")
    assert all(o["node"] != "n4" for o in demo.get("/v1/plan").json()["operations"])


def test_put_cluster_rejects_bad_topology(demo):
    dup = {"nodes": [{"id": "a", "gpus": [{"id": "g", "type": "l40"}, {"id": "g", "type": "l40"}]}]}
    assert_problem(demo.client.put("/v1/cluster", json=dup), 422, "duplicate gpu id")
    bad_type = {"nodes": [{"id": "a", "gpus": [{"id": "g", "type": "h900"}]}]}
    assert_problem(demo.client.put("/v1/cluster", json=bad_type), 422, "type", "h900")
    assert_problem(demo.client.put("/v1/cluster", json={"nodes": []}), 422, "nodes")


def test_models_put_get_delete(demo):
    created = demo.client.put(
        "/v1/models/tiny-llama", json={"model": {"preset": "llama-3.1-8b-instruct"}, "nvme_nodes": ["n1"]}
    )
    assert created.status_code == 201, created.text
    assert created.json()["resolved"]["weights_bytes"]["bf16"] > 10**9
    assert created.json()["resolved"]["kv_heads"] == 8  # Llama-3.1-8B's num_key_value_heads
    assert "tiny-llama" in [m["id"] for m in demo.get("/v1/models").json()]
    assert demo.events(request("e1", "t", "tiny-llama")).json()["applied"] == 1
    replaced = demo.client.put(
        "/v1/models/tiny-llama", json={"model": {"preset": "llama-3.1-8b-instruct", "precisions": ["bf16", "fp8"]}}
    )
    assert replaced.status_code == 200 and replaced.json()["resolved"]["precisions"] == ["bf16", "fp8"]
    own = demo.client.put(
        "/v1/models/tiny-llama",
        json={"model": {"weights_bytes": {"bf16": 2**30}, "kv_bytes_per_token": 4096, "kv_heads": 2}},
    )
    assert own.status_code == 200 and own.json()["kv_heads"] == own.json()["resolved"]["kv_heads"] == 2
    assert_problem(demo.client.delete("/v1/models/tiny-llama"), 409, "tiny-llama", "active session(s) t")
    assert demo.events({"id": "e2", "type": "session_end", "session": "t"}).json()["applied"] == 1
    assert demo.client.delete("/v1/models/tiny-llama").status_code == 204
    assert "tiny-llama" not in [m["id"] for m in demo.get("/v1/models").json()]
    assert demo.get("/v1/sessions/t").status_code == 404
    assert not [e for e in demo.get("/v1/srv").json()["placement"] if e["object"]["model"] == "tiny-llama"]
    assert_problem(demo.client.delete("/v1/models/tiny-llama"), 404, "coder")


def test_models_put_rejects_bad_models(demo):
    assert_problem(demo.client.put("/v1/models/x", json={"model": {"preset": "gpt-99"}}), 422, "preset", "gpt-99")
    assert_problem(
        demo.client.put("/v1/models/x", json={"model": {"id": "y", "preset": "llama-3.1-8b-instruct"}}), 422, "model.id"
    )
    assert_problem(
        demo.client.put("/v1/models/x", json={"model": {"precisions": ["fp4"], "kv_bytes_per_token": 1}}),
        422,
        "precisions",
    )
    assert_problem(
        demo.client.put("/v1/models/x", json={"model": {"preset": "llama-3.1-8b-instruct"}, "nvme_nodes": ["n9"]}),
        422,
        "n9",
    )


def test_register_and_heartbeat(demo):
    reg = demo.post(
        "/v1/nodes/n1/register",
        json={
            "capabilities": ["weights_offload", "kv_offload"],
            "gpus": [{"id": "n1-g0", "type": "l40"}, {"id": "n1-g9"}],
            "engines": [{"name": "vllm-coder", "kind": "vllm", "models": ["coder"]}],
        },
    )
    assert reg.status_code == 200
    body = reg.json()
    assert body["capabilities"] == ["weights_offload", "kv_offload"]
    assert any("n1-g9" in w for w in body["warnings"]) and any("n1-g1" in w for w in body["warnings"])
    node = demo.get("/v1/cluster").json()["nodes"][0]
    assert node["capabilities"] == ["kv_offload", "weights_offload"] and node["registered_at"]
    before = node["gpus"][0]["h2d_bytes_per_s"]
    beat = demo.post(
        "/v1/nodes/n1/heartbeat",
        json={
            "gpus": [{"id": "n1-g0", "used_bytes": 10, "free_bytes": 20, "h2d_bytes_per_s": 10e9}],
            "nvme_read_bytes_per_s": 3e9,
            "engines": {"vllm-coder": "sleeping"},
            "expert_hit_rates": {"reasoner": 0.8},
        },
    )
    assert beat.status_code == 200, beat.text
    node = demo.get("/v1/cluster").json()["nodes"][0]
    assert node["gpus"][0]["h2d_bytes_per_s"] == 0.7 * before + 0.3 * 10e9
    assert node["telemetry"]["engines"] == {"vllm-coder": "sleeping"} and node["last_heartbeat"]
    assert_problem(demo.post("/v1/nodes/n1/heartbeat", json={"gpus": [{"id": "n2-g0"}]}), 422, "gpus[0].id", "n2-g0")
    assert_problem(
        demo.post("/v1/nodes/n1/heartbeat", json={"expert_hit_rates": {"nope": 0.5}}), 422, "expert_hit_rates"
    )
    assert_problem(
        demo.post("/v1/nodes/n1/heartbeat", json={"expert_hit_rates": {"reasoner": 1.5}}), 422, "expert_hit_rates"
    )
    assert_problem(demo.post("/v1/nodes/n9/register", json={}), 404, "n9", "n1")
    assert_problem(demo.lease("n9"), 404, "n9")


def test_heartbeat_instances_and_measured_memory_reconcile_the_node(demo):
    """n2's coder reported stopped twice: its weights and KV leave n2-g0 and n2-g1, and the node says so."""
    coder = {
        "id": "coder@bf16@n2-g0+n2-g1",
        "node": "n2",
        "kind": "vllm",
        "model": "coder",
        "precision": "bf16",
        "gpus": ["n2-g0", "n2-g1"],
        "kv_pool_bytes_per_gpu": 4 << 30,
    }
    beat = {
        "gpus": [
            {
                "id": "n2-g0",
                "used_bytes": 1 << 30,
                "total_bytes": 48 << 30,
                "processes": [{"pid": 4242, "used_bytes": 1 << 30}],  # another user's: no engine of the agent's
            }
        ],
        "instances": [{"instance": coder, "state": "stopped"}],
    }
    for _ in range(2):
        answer = demo.post("/v1/nodes/n2/heartbeat", json=beat)
        assert answer.status_code == 200, answer.text
    node = next(n for n in demo.get("/v1/cluster").json()["nodes"] if n["id"] == "n2")
    assert node["telemetry"]["instances"] == [
        {
            "instance": {
                **coder,
                "kv_pool_tokens": 0,
                "gpu_expert_fraction": 1.0,
                "max_context_tokens": None,
                "features": [],
                "management": "managed",
            },
            "state": "stopped",
        }
    ]
    assert node["telemetry"]["gpus"][0]["total_bytes"] == 48 << 30
    assert node["telemetry"]["gpus"][0]["processes"] == [{"pid": 4242, "used_bytes": 1 << 30, "engine": None}]
    assert {(c["object"]["kind"], c["location"]["gpu"]) for c in node["reconcile"]["corrected"]} == {
        ("weights", "n2-g0"),
        ("weights", "n2-g1"),
        ("kv", "n2-g0"),
        ("kv", "n2-g1"),
    }
    assert [g["used_bytes"] for g in node["gpus"][:2]] == [0, 0]
    assert node["reconcile"]["lost"] == []  # measured against the corrected placement: nothing missing
    metrics = demo.get("/metrics").text
    assert 'statebudget_reconciled_objects_total{node="n2"} 4.0' in metrics
    assert_problem(
        demo.post(
            "/v1/nodes/n2/heartbeat", json={"instances": [{"instance": {**coder, "node": "n1"}, "state": "stopped"}]}
        ),
        422,
        "instances.0.instance.node",
    )
    assert_problem(
        demo.post("/v1/nodes/n2/heartbeat", json={"instances": [{"instance": coder, "state": "dozing"}]}),
        422,
        "instances.0.state",
    )
    assert_problem(
        demo.post("/v1/nodes/n2/heartbeat", json={"gpus": [{"id": "n2-g0", "used_bytes": 2, "total_bytes": 1}]}),
        422,
        "total_bytes",
    )


def run_every_operation(harness) -> None:
    """Lease and report done every operation of the current plan, as the node agents would."""
    for _ in range(100):
        open_ops = [o for o in harness.get("/v1/operations").json() if o["state"] in ("queued", "leased")]
        if not open_ops:
            return
        for node in sorted({o["node"] for o in open_ops}):
            lease = harness.lease(node, n=100).json()
            for op in lease["operations"]:
                assert harness.report(op["id"], lease["lease_id"]).status_code == 200
    raise AssertionError(f"the plan's operations never finished: {open_ops}")


def test_a_model_in_use_is_not_deleted(demo):
    """409 while an active session is on the model or an open operation (queued or leased) moves its state."""
    demo.post("/v1/plan")
    ops = [o for o in demo.get("/v1/operations").json() if o["state"] == "queued"]
    model = ops[0]["object"]["model"]
    for i, session in enumerate(s for s in demo.get("/v1/sessions").json() if s["model"] == model and s["active"]):
        demo.events({"id": f"end-{i}", "type": "session_end", "session": session["id"]})
    demo.events(request("e1", "fresh", model))
    body = assert_problem(demo.client.delete(f"/v1/models/{model}"), 409, model, "active session(s) fresh")
    assert ops[0]["id"] in body["detail"]
    demo.events({"id": "e2", "type": "session_end", "session": "fresh"})
    mine = [o["id"] for o in ops if o["object"]["model"] == model]
    body = assert_problem(demo.client.delete(f"/v1/models/{model}"), 409, "open operation(s)", mine[0])
    assert "session" not in body["detail"]
    lease = demo.lease(ops[0]["node"], n=100).json()
    assert ops[0]["id"] in [o["id"] for o in lease["operations"]]  # leased: a node is copying it now
    assert_problem(demo.client.delete(f"/v1/models/{model}"), 409, ops[0]["id"])
    assert model in [m["id"] for m in demo.get("/v1/models").json()]
    for op in lease["operations"]:
        assert demo.report(op["id"], lease["lease_id"]).status_code == 200
    run_every_operation(demo)
    assert demo.client.delete(f"/v1/models/{model}").status_code == 204
    assert model not in [m["id"] for m in demo.get("/v1/models").json()]


CODER_ENGINES = {  # node -> the GPUs of its vLLM engine for the coder (min_gpus 4 on RTX 3090s)
    "n1": ["n1-g1"],
    "n2": ["n2-g2", "n2-g3"],
    "n3": ["n3-g0", "n3-g1", "n3-g2", "n3-g3"],
    "n4": ["n4-g0", "n4-g1", "n4-g2", "n4-g3"],
}


def test_engines_on_fixed_gpus_are_planned_only_there_and_kept_across_a_restart(make_app):
    clock = FakeClock()
    demo = make_app(clock=clock)
    for node, gpus in CODER_ENGINES.items():
        engine = {"name": "vllm-coder", "kind": "vllm", "models": ["coder"], "gpus": gpus}
        reg = demo.post(f"/v1/nodes/{node}/register", json={"engines": [engine]})
        assert reg.status_code == 200, reg.text
        assert reg.json()["engines"] == [{"model": "coder", "gpus": gpus}]
    demo.events(request("e1", "s1", "coder", input_tokens=2000))
    demo.post("/v1/plan")
    on_gpus: dict[str, set[str]] = {}
    for entry in demo.get("/v1/plan").json()["placement"]:
        obj, loc = entry["object"], entry["location"]
        if obj["model"] == "coder" and obj["kind"] == "weights" and loc["tier"] == "gpu":
            on_gpus.setdefault(loc["gpu"].split("-")[0], set()).add(loc["gpu"])
    assert on_gpus, "the coder is served somewhere"
    assert all(gpus == set(CODER_ENGINES[node]) for node, gpus in on_gpus.items())
    # a what-if without one of an engine's GPUs plans without that engine
    whatif = demo.post("/v1/whatif", json={"changes": [{"type": "remove_gpu", "gpu": "n2-g3"}]})
    assert whatif.status_code == 200, whatif.text
    demo.client.__exit__(None, None, None)

    again = make_app(clock=clock)
    nodes = {n["id"]: n for n in again.get("/v1/cluster").json()["nodes"]}
    assert all(nodes[node]["engines"] == [{"model": "coder", "gpus": gpus}] for node, gpus in CODER_ENGINES.items())
    assert_problem(again.client.delete("/v1/models/coder"), 409, "active session(s) s01, s1", "open operation(s)")
    for i, session in enumerate(("s01", "s1")):
        assert again.events({"id": f"end-{i}", "type": "session_end", "session": session}).json()["applied"] == 1
    run_every_operation(again)
    assert again.client.delete("/v1/models/coder").status_code == 204  # its engines go with it
    assert all(n["engines"] == [] for n in again.get("/v1/cluster").json()["nodes"])  # no engine left: no model


def test_registration_rejects_engines_on_gpus_it_cannot_have(demo):
    def register(*engines):
        return demo.post("/v1/nodes/n2/register", json={"engines": list(engines)})

    declared = demo.get("/v1/cluster").json()["nodes"][1]["engines"]

    assert_problem(register({"name": "e", "models": ["coder"], "gpus": ["n1-g0"]}), 422, "engines[0].gpus[0]", "n1-g0")
    assert_problem(
        register({"name": "e", "models": ["gpt-9"], "gpus": ["n2-g0"]}), 422, "engines[0].models[0]", "gpt-9"
    )
    assert_problem(register({"name": "e", "models": ["coder"], "gpus": ["n2-g0", "n2-g0"]}), 422, "engines[0].gpus")
    assert_problem(
        register(
            {"name": "a", "models": ["coder"], "gpus": ["n2-g0"]}, {"name": "b", "models": ["coder"], "gpus": ["n2-g1"]}
        ),
        422,
        "engines[1].models[0]",
        "one group per node",
    )
    assert demo.get("/v1/cluster").json()["nodes"][1]["engines"] == declared  # refused: the demo's stay


def test_a_registered_vllm_engine_keeps_its_kind_and_features_so_engine_steps_are_planned(demo) -> None:
    engines = [{"name": "vllm-coder", "kind": "vllm", "models": ["coder"], "features": ["sleep_mode", "dev_mode"]}]
    assert demo.post("/v1/nodes/n1/register", json={"engines": engines}).status_code == 200
    rows = [e for e in demo.get("/v1/engines").json() if e["node"] == "n1"]
    assert [(e["model"], e["kind"], e["features"]) for e in rows] == [("coder", "vllm", ["dev_mode", "sleep_mode"])]
    bad = [{"name": "vllm-coder", "kind": "vllm", "models": ["coder"], "features": ["cpu_backup"]}]
    refused = demo.post("/v1/nodes/n1/register", json={"engines": bad})
    assert refused.status_code == 422 and "engines[0].features" in refused.json()["detail"]
