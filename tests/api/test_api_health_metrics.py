"""Health, docs, OpenAPI and the Prometheus exposition."""

from __future__ import annotations

from api_helpers import request

METRICS = [
    "statebudget_resident_bytes",
    "statebudget_gpu_hbm_used_bytes",
    "statebudget_gpu_hbm_capacity_bytes",
    "statebudget_queue_operations",
    "statebudget_operation_duration_seconds",
    "statebudget_plan_duration_seconds",
    "statebudget_predicted_switch_latency_p95_seconds",
    "statebudget_switch_latency_seconds",
    "statebudget_events_total",
    "statebudget_lease_expiries_total",
    "statebudget_slo_violations_total",
    "statebudget_unserved_sessions",
    "statebudget_plan_epoch",
]


def test_livez_readyz_docs_openapi(demo):
    assert demo.get("/livez").json()["status"] == "ok"
    ready = demo.get("/readyz").json()
    assert ready == {"status": "ok", "epoch": 1, "srv_version": 1}
    assert demo.get("/docs").status_code == 200
    spec = demo.get("/openapi.json").json()
    ids = {op["operationId"] for path in spec["paths"].values() for op in path.values()}
    for expected in ("post_events", "lease", "report", "what_if", "get_srv", "get_plan", "replan", "explain"):
        assert expected in ids
    for path in (
        "/v1/cluster",
        "/v1/models/{model_id}",
        "/v1/nodes/{node_id}/lease",
        "/v1/operations/{op_id}/report",
        "/v1/whatif",
        "/v1/pareto",
        "/v1/explain",
        "/v1/sessions/{session_id}",
    ):
        assert path in spec["paths"]


def test_metrics_exposes_every_metric(demo):
    demo.events(request("e1", "s01", "coder"))
    lease = demo.lease("n1", 1).json()
    op = lease["operations"][0]
    demo.report(op["id"], lease["lease_id"], measured_seconds=2.0, measured_bytes=op["bytes"])
    demo.post("/v1/plan")
    demo.clock.advance(1000)
    demo.lease("n2", 1)
    demo.clock.advance(1000)
    demo.get("/v1/operations")  # expires the n2 lease
    text = demo.get("/metrics").text
    for name in METRICS:
        assert f"\n{name}" in text or text.startswith(name), name
    assert demo.metric("statebudget_events_total", type="request") == 1
    assert demo.metric("statebudget_plan_epoch") == 2
    assert demo.metric("statebudget_operation_duration_seconds_count", action=op["action"], outcome="done") == 1
    assert demo.metric("statebudget_lease_expiries_total", node="n2") == 1
    assert demo.metric("statebudget_plan_duration_seconds_count", solver="greedy") >= 2
    n1_g0 = demo.get("/v1/cluster").json()["nodes"][0]["gpus"][0]
    assert demo.metric("statebudget_gpu_hbm_capacity_bytes", node="n1", gpu="n1-g0") == n1_g0["capacity_bytes"]
    assert demo.metric("statebudget_switch_latency_seconds_count", slo="blocking") == 1  # coder is resident: 0 s
