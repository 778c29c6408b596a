"""Malformed input is a 4xx problem+json that names the field, never a 500."""

from __future__ import annotations

import pytest
from api_helpers import assert_problem

CASES = [
    ("post", "/v1/events", {"events": [{"id": "e", "type": "request", "session": "s"}]}, "model"),
    ("post", "/v1/events", {"events": [{"id": "e", "type": "teleport", "session": "s"}]}, "type"),
    ("post", "/v1/events", {"events": []}, "events"),
    ("post", "/v1/events", {"evnts": []}, "events"),
    ("post", "/v1/events", {"events": [{"id": "", "type": "turn_end", "session": "s"}]}, "id"),
    (
        "post",
        "/v1/events",
        {"events": [{"id": "e", "type": "request", "session": "s", "model": "coder", "slo": "urgent"}]},
        "slo",
    ),
    (
        "post",
        "/v1/events",
        {"events": [{"id": "e", "type": "request", "session": "s", "model": "coder", "extra": 1}]},
        "extra",
    ),
    ("post", "/v1/events", [1, 2], "body"),
    ("post", "/v1/nodes/n1/lease", {"max_operations": 0}, "max_operations"),
    ("post", "/v1/nodes/n1/lease", {"wait_seconds": "soon"}, "wait_seconds"),
    ("post", "/v1/operations/1.op-1/report", {"status": "done"}, "lease_id"),
    ("post", "/v1/operations/1.op-1/report", {"lease_id": "x", "status": "maybe"}, "status"),
    (
        "post",
        "/v1/operations/1.op-1/report",
        {"lease_id": "x", "status": "done", "measured_seconds": -1},
        "measured_seconds",
    ),
    ("post", "/v1/nodes/n1/heartbeat", {"gpus": [{"id": "n1-g0", "used_bytes": -5}]}, "used_bytes"),
    ("post", "/v1/nodes/n1/register", {"capabilities": ["teleport"]}, "capabilities"),
    ("post", "/v1/whatif", {"changes": [{"type": "add_sessions", "model": "coder", "count": 0}]}, "count"),
    ("put", "/v1/cluster", {"nodes": [{"id": "n1", "gpus": [{"id": "g"}]}]}, "hbm_bytes"),
    ("put", "/v1/models/m", {"model": "not an object"}, "model"),
    ("get", "/v1/operations?state=lost", None, "state"),
]


@pytest.mark.parametrize(("method", "path", "body", "field"), CASES)
def test_malformed_input_names_the_field(demo, method, path, body, field):
    response = demo.client.request(method.upper(), path, json=body)
    problem = assert_problem(response, 422, field)
    assert "Traceback" not in response.text and problem["detail"]


def test_broken_json_is_a_problem(demo):
    response = demo.client.post("/v1/events", content=b"{not json", headers={"content-type": "application/json"})
    assert_problem(response, 422, "JSON")


def test_unknown_route_and_method_are_problems(demo):
    assert_problem(demo.get("/v1/nothing"), 404)
    assert_problem(demo.client.delete("/v1/srv"), 405)
