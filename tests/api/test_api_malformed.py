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


PROBLEM_KEYS = {"type", "title", "status", "detail", "field", "errors"}


@pytest.mark.parametrize(("method", "path", "body", "field"), CASES)
def test_malformed_input_names_the_field(demo, method, path, body, field):
    response = demo.client.request(method.upper(), path, json=body)
    problem = assert_problem(response, 422, field)
    assert "Traceback" not in response.text and problem["detail"]
    assert problem.keys() == PROBLEM_KEYS and problem["title"] == "Invalid input"
    assert problem["errors"] and problem["field"] == problem["errors"][0]["field"]
    assert all(e.keys() == {"field", "message"} and e["message"] for e in problem["errors"])


# the path as the caller wrote it: no `body.`/`query.` and no union member names (`events.0.request.model`)
FIELD_PATHS = [
    ("post", "/v1/events", {"events": [{"id": "e", "type": "request", "session": "s"}]}, "events.0.model"),
    ("post", "/v1/events", {"events": [{"id": "e", "type": "teleport", "session": "s"}]}, "events.0.type"),
    ("post", "/v1/events", {"events": [{"id": "e", "session": "s"}]}, "events.0.type"),
    ("post", "/v1/events", {"evnts": []}, "events"),
    (
        "post",
        "/v1/events",
        {"events": [{"id": "e", "type": "turn_end", "session": "s", "at": 1e12}]},
        "events.0.at",
    ),
    (
        "post",
        "/v1/events",
        {"events": [{"id": "e", "type": "request", "session": "s", "model": "coder", "extra": 1}]},
        "events.0.extra",
    ),
    ("post", "/v1/events", [1, 2], "(body)"),
    ("post", "/v1/nodes/n1/lease", {"max_operations": 0}, "max_operations"),
    ("post", "/v1/nodes/n1/heartbeat", {"gpus": [{"id": "n1-g0", "used_bytes": -5}]}, "gpus.0.used_bytes"),
    ("post", "/v1/whatif", {"changes": [{"type": "add_sessions", "model": "coder", "count": 0}]}, "changes.0.count"),
    ("get", "/v1/operations?state=lost", None, "state"),
]


@pytest.mark.parametrize(("method", "path", "body", "field"), FIELD_PATHS)
def test_field_paths_are_the_callers_own(demo, method, path, body, field):
    problem = assert_problem(demo.client.request(method.upper(), path, json=body), 422)
    assert problem["field"] == field, problem
    assert not any(e["field"].startswith(("body", "query")) for e in problem["errors"]), problem
    assert problem["detail"].startswith(f"{field}: ")


def test_a_service_refusal_has_the_same_shape(demo):
    problem = assert_problem(demo.post("/v1/nodes/n1/heartbeat", json={"gpus": [{"id": "n2-g0"}]}), 422, "n2-g0")
    assert problem.keys() == PROBLEM_KEYS and problem["title"] == "Invalid input"
    assert problem["field"] == "gpus.0.id" and problem["errors"] == [
        {"field": "gpus.0.id", "message": problem["detail"]}
    ]


def test_a_problem_without_a_field_has_the_same_shape(demo):
    problem = assert_problem(demo.lease("nx"), 404, "nx")
    assert problem.keys() == PROBLEM_KEYS and problem["field"] is None and problem["errors"] == []


def test_broken_json_says_where_and_what(demo):
    body = b'{"events": [\n  {"id": "e1",}\n]}'
    response = demo.client.post("/v1/events", content=body, headers={"content-type": "application/json"})
    problem = assert_problem(response, 400, "line 2, column 15")
    assert problem["title"] == "Malformed request" and problem["field"] == "(body)"
    assert "not valid JSON" in problem["detail"] and "Expecting property name" in problem["detail"]
    assert "decode error" not in response.text and "body.1" not in response.text


def test_unknown_route_is_a_problem(demo):
    problem = assert_problem(demo.get("/v1/nothing"), 404, "/v1/nothing")
    assert problem.keys() == PROBLEM_KEYS


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("DELETE", "/v1/srv", "GET"),
        ("DELETE", "/v1/cluster", "GET, PUT"),  # two routes share the path: both methods are named
        ("GET", "/v1/models/coder", "DELETE, PUT"),
        ("PUT", "/livez", "GET"),
    ],
)
def test_a_wrong_method_is_a_problem_that_says_which_are_allowed(demo, method, path, allow):
    response = demo.client.request(method, path)
    problem = assert_problem(response, 405, method, allow)
    assert response.headers["allow"] == allow and problem["title"] == "Method not allowed"
