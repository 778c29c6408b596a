"""The OpenAPI document describes every error answer: its status and its one shape, `Problem`."""

from __future__ import annotations

import jsonschema
import pytest

from planner_service.wire.problem import PROBLEM_JSON

API_ERRORS = {"400", "401", "403", "404", "405", "409", "422", "500", "501", "503"}
OPEN_ERRORS = {"405", "500", "503"}
OPEN_PATHS = {"/livez", "/readyz", "/metrics"}


@pytest.fixture
def spec(demo):
    return demo.get("/openapi.json").json()


def _operations(spec):
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            yield path, method, operation


def test_every_operation_documents_its_error_statuses(spec):
    for path, method, operation in _operations(spec):
        statuses = {s for s in operation["responses"] if s[0] in "45"}
        expected = OPEN_ERRORS if path in OPEN_PATHS else API_ERRORS
        assert statuses == expected, f"{method.upper()} {path}: {sorted(statuses)}"


def test_every_error_answer_is_a_problem(spec):
    for path, method, operation in _operations(spec):
        for status, response in operation["responses"].items():
            if status[0] in "45":
                assert response["content"] == {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}}, (
                    f"{method.upper()} {path} {status}"
                )
    assert "HTTPValidationError" not in spec["components"]["schemas"]  # FastAPI's own 422 shape is gone


def test_the_problem_schema_matches_what_the_service_answers(demo, spec):
    schema = {"$ref": "#/components/schemas/Problem", "components": spec["components"]}
    answers = [
        demo.post("/v1/nodes/n1/lease", json={"max_operations": 0}),  # 422, from validation
        demo.post("/v1/nodes/n1/heartbeat", json={"gpus": [{"id": "n2-g0"}]}),  # 422, from the service
        demo.post("/v1/events", content=b"{", headers={"content-type": "application/json"}),  # 400
        demo.post("/v1/nodes/nx/lease", json={}),  # 404
        demo.client.delete("/v1/srv"),  # 405
    ]
    assert [a.status_code for a in answers] == [422, 422, 400, 404, 405]
    for answer in answers:
        jsonschema.validate(answer.json(), schema)
    required = spec["components"]["schemas"]["Problem"]["required"]
    assert set(required) == {"type", "title", "status", "detail", "field", "errors"}
