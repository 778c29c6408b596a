"""Numbers outside physical bounds, `Infinity` and `NaN` are a 422 naming the field, and change nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from api_helpers import assert_problem, request

JSON = {"content-type": "application/json"}


def post_raw(app, path: str, text: str, method: str = "POST"):
    """Send JSON text as is: Python's json module reads `Infinity`, `NaN` and 10**400, which json= cannot send."""
    return app.client.request(method, path, content=text.encode(), headers=JSON)


def fields(response) -> list[str]:
    return [e["field"] for e in response.json().get("errors", [])] or [response.json().get("field")]


def names(response, field: str) -> bool:
    return any(f == field or f.endswith(f".{field}") for f in fields(response))


def cluster_figures(app) -> dict[str, Any]:
    """Every bandwidth the cost model uses and whether calibration moved it."""
    view = app.get("/v1/cluster").json()
    return {
        n["id"]: {
            "nvme": (n["nvme_read_bytes_per_s"], n["nvme_write_bytes_per_s"]),
            "gpus": {g["id"]: (g["h2d_bytes_per_s"], g["d2h_bytes_per_s"], g["calibrated"]) for g in n["gpus"]},
        }
        for n in view["nodes"]
    }


HEARTBEATS = [
    ('{"nvme_read_bytes_per_s": Infinity}', "nvme_read_bytes_per_s"),
    ('{"nvme_write_bytes_per_s": NaN}', "nvme_write_bytes_per_s"),
    ('{"nvme_read_bytes_per_s": -Infinity}', "nvme_read_bytes_per_s"),
    ('{"nvme_read_bytes_per_s": 1e400}', "nvme_read_bytes_per_s"),  # json reads an overflowing float as inf
    ('{"gpus": [{"id": "n1-g0", "h2d_bytes_per_s": 1e308}]}', "h2d_bytes_per_s"),
    ('{"gpus": [{"id": "n1-g0", "d2h_bytes_per_s": 1e14}]}', "d2h_bytes_per_s"),  # 100 TB/s: past any HBM
    ('{"gpus": [{"id": "n1-g0", "h2d_bytes_per_s": 1}]}', "h2d_bytes_per_s"),  # 1 B/s: a stall, not a link
    ('{"gpus": [{"id": "n1-g0", "used_bytes": 1e400}]}', "used_bytes"),
    ('{"gpus": [{"id": "n1-g0", "free_bytes": 1' + "0" * 400 + "}]}", "free_bytes"),
    ('{"gpus": [{"id": "n1-g0", "used_bytes": 5000000000000}]}', "used_bytes"),  # 5 TB on one GPU
    ('{"expert_hit_rates": {"alpha": NaN}}', "expert_hit_rates"),
]


@pytest.mark.parametrize(("body", "field"), HEARTBEATS)
def test_heartbeat_out_of_bounds_is_refused_and_leaves_calibration_untouched(make_app, body, field):
    tiny = make_app(tiny=True)
    before = cluster_figures(tiny)
    response = post_raw(tiny, "/v1/nodes/n1/heartbeat", body)
    assert_problem(response, 422, field)
    assert names(response, field) or field in response.json()["detail"], response.text
    assert cluster_figures(tiny) == before
    restarted = make_app(tiny=True)  # nothing reached the database either
    assert cluster_figures(restarted) == before


def test_heartbeat_within_bounds_still_calibrates(tiny):
    before = cluster_figures(tiny)
    response = tiny.post("/v1/nodes/n1/heartbeat", json={"nvme_read_bytes_per_s": 3e9})
    assert response.status_code == 200, response.text
    assert cluster_figures(tiny)["n1"]["nvme"] != before["n1"]["nvme"]


def test_used_and_free_bytes_beyond_one_gpu_are_refused(tiny):
    half = 1_500_000_000_000  # 1.5 TB each: either alone is a GPU, both together is not
    response = tiny.post("/v1/nodes/n1/heartbeat", json={"gpus": [{"id": "n1-g0", "used_bytes": half}]})
    assert response.status_code == 200, response.text
    both = tiny.post("/v1/nodes/n1/heartbeat", json={"gpus": [{"id": "n1-g0", "used_bytes": half, "free_bytes": half}]})
    assert_problem(both, 422, "used_bytes + free_bytes")


def leased_promote(app) -> tuple[dict[str, Any], str]:
    """A promote leased on n1 of the tiny cluster: beta (blocking) replaces alpha on n1's GPU."""
    app.events(
        request("e1", "s1", "beta", slo="blocking", input_tokens=1000), request("e2", "s2", "alpha", input_tokens=1000)
    )
    app.post("/v1/plan")
    first = app.lease("n1").json()
    (drop,) = first["operations"]
    assert app.report(drop["id"], first["lease_id"]).status_code == 200
    second = app.lease("n1").json()
    promote = next(op for op in second["operations"] if op["action"] == "promote" and op["object"]["kind"] == "weights")
    return promote, second["lease_id"]


REPORTS = [
    ('"measured_bytes": 1' + "0" * 400, "measured_bytes"),  # 10**400: overflowed the calibration's float division
    ('"measured_bytes": 1e400', "measured_bytes"),
    ('"measured_bytes": 2000000000000000', "measured_bytes"),  # 2 PB in one copy
    ('"measured_seconds": Infinity', "measured_seconds"),
    ('"measured_seconds": NaN', "measured_seconds"),
    ('"measured_seconds": 100000', "measured_seconds"),  # more than a day
]


@pytest.mark.parametrize(("extra", "field"), REPORTS)
def test_report_out_of_bounds_is_refused_and_changes_nothing(tiny, extra, field):
    promote, lease_id = leased_promote(tiny)
    srv, figures = tiny.get("/v1/srv").json(), cluster_figures(tiny)
    body = f'{{"lease_id": {json.dumps(lease_id)}, "status": "done", "measured_seconds": 1.0, {extra}}}'
    if extra.startswith('"measured_seconds"'):
        body = f'{{"lease_id": {json.dumps(lease_id)}, "status": "done", "measured_bytes": 1000, {extra}}}'
    response = post_raw(tiny, f"/v1/operations/{promote['id']}/report", body)
    assert_problem(response, 422, field)
    assert names(response, field), response.text
    assert tiny.get("/v1/srv").json() == srv and cluster_figures(tiny) == figures
    (still,) = [op for op in tiny.get("/v1/operations").json() if op["id"] == promote["id"]]
    assert still["state"] == "leased"
    done = tiny.report(promote["id"], lease_id, measured_seconds=2.0, measured_bytes=promote["bytes"])
    assert done.status_code == 200, done.text  # the operation is still the agent's to report


CLUSTERS = [
    ({"hbm_bytes_per_s": 1e308}, "hbm_bytes_per_s"),
    ({"h2d_bytes_per_s": 0.5}, "h2d_bytes_per_s"),
    ({"bf16_flops": 1e30}, "bf16_flops"),
    ({"hbm_bytes": 10**400}, "hbm_bytes"),
    ({"reserved_bytes": 30 * 2**30}, "reserved_bytes"),  # more than the GPU's 20 GiB
]


@pytest.mark.parametrize(("gpu", "field"), CLUSTERS)
def test_cluster_out_of_bounds_is_refused(tiny, gpu, field):
    nodes = tiny.get("/v1/cluster").json()["nodes"]
    spec = {
        "id": "n1-g0",
        "hbm_bytes": 20 * 2**30,
        "hbm_bytes_per_s": 1e12,
        "bf16_flops": 1e14,
        "h2d_bytes_per_s": 2e10,
    }
    cluster = {
        "nodes": [
            {"id": "n1", "host_dram_bytes": 64 * 2**30, "nvme_bytes": 2**40, "gpus": [{**spec, **gpu}]},
            {"id": "n2", "host_dram_bytes": 64 * 2**30, "nvme_bytes": 2**40, "gpus": [{**spec, "id": "n2-g0"}]},
        ]
    }
    text = json.dumps(cluster)
    response = post_raw(tiny, "/v1/cluster", text, method="PUT")
    assert_problem(response, 422, field)
    assert tiny.get("/v1/cluster").json()["nodes"] == nodes


def test_cluster_with_infinite_nvme_bandwidth_is_refused(tiny):
    text = '{"nodes": [{"id": "n1", "nvme_read_bytes_per_s": Infinity, "gpus": [{"id": "n1-g0", "type": "l40"}]}]}'
    assert_problem(post_raw(tiny, "/v1/cluster", text, method="PUT"), 422, "nvme_read_bytes_per_s")


def test_register_with_overflowing_memory_is_refused(tiny):
    response = post_raw(tiny, "/v1/nodes/n1/register", '{"host_dram_bytes": 1e400}')
    assert_problem(response, 422, "host_dram_bytes")
    response = post_raw(tiny, "/v1/nodes/n1/register", '{"gpus": [{"id": "n1-g0", "hbm_bytes": 10000000000000}]}')
    assert_problem(response, 422, "hbm_bytes")


def test_event_time_and_tokens_must_be_finite(tiny):
    text = '{"events": [{"id": "e1", "type": "request", "session": "s1", "model": "alpha", "at": NaN}]}'
    assert_problem(post_raw(tiny, "/v1/events", text), 422, "at")
    text = '{"events": [{"id": "e1", "type": "request", "session": "s1", "model": "alpha", "at": Infinity}]}'
    assert_problem(post_raw(tiny, "/v1/events", text), 422, "at")
    assert tiny.get("/v1/sessions/s1").status_code == 404


def test_whatif_and_model_numbers_must_be_finite(tiny):
    text = '{"changes": [], "time_limit_seconds": NaN}'
    assert_problem(post_raw(tiny, "/v1/whatif", text), 422, "time_limit_seconds")
    text = '{"changes": [{"type": "add_model", "model": {"id": "m", "kv_bytes_per_token": 1e400, "preset": "x"}}]}'
    assert_problem(post_raw(tiny, "/v1/whatif", text), 422, "kv_bytes_per_token")
    text = '{"model": {"preset": "qwen2.5-7b-instruct", "config": {"num_hidden_layers": Infinity}}}'
    response = post_raw(tiny, "/v1/models/m", text, method="PUT")
    assert_problem(response, 422, "num_hidden_layers")


def test_a_session_may_grow_past_the_bound_of_one_request_and_still_be_planned(tiny):
    """Bounds on one event must not become bounds on what the service adds up from many: the live state is
    re-validated as a scenario on every plan, and a refused one would stop planning."""
    big = 100_000_000  # the most tokens one event may carry
    for i in range(3):
        response = tiny.events(request(f"e{i}", "s1", "alpha", input_tokens=big, output_tokens=big))
        assert response.status_code == 200, response.text
    assert tiny.get("/v1/sessions/s1").json()["context_tokens"] == 6 * big
    plan = tiny.post("/v1/plan")
    assert plan.status_code == 200, plan.text
    assert tiny.get("/readyz").status_code == 200


def test_an_event_beyond_the_clock_skew_refuses_its_batch_and_one_within_it_applies(make_app) -> None:
    app = make_app(tiny=True, max_clock_skew_seconds=3600)
    now = app.clock()
    ahead = app.events(request("e1", "s1", "beta", at=now - 60), request("e2", "s2", "beta", at=now + 7200))
    assert ahead.status_code == 422
    assert ahead.json()["field"] == "events.1.at" and "ahead of the server clock" in ahead.json()["detail"]
    assert app.get("/v1/sessions").json() == []  # the whole batch was refused
    year_9999 = app.events(request("e3", "s3", "beta", at=253402300799.0))
    assert year_9999.status_code == 422
    assert app.events(request("e1", "s1", "beta", at=now - 60)).json()["applied"] == 1


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_operations": True}, "max_operations"),
        ({"max_operations": "5"}, "max_operations"),
        ({"max_operations": 2.5}, "max_operations"),
        ({"wait_seconds": True}, "wait_seconds"),
        ({"wait_seconds": "1"}, "wait_seconds"),
    ],
)
def test_a_lease_of_the_wrong_type_is_refused_not_read_as_a_number(tiny, body, field):
    """Found by the reliability report's fuzzing: `true` was leased as one operation."""
    assert_problem(tiny.post("/v1/nodes/n1/lease", json=body), 422, field)
    assert tiny.post("/v1/nodes/n1/lease", json={"max_operations": 2, "wait_seconds": 0}).status_code == 200
