"""Random JSON at every write endpoint: the answer is a 2xx or a 4xx problem, never a 5xx."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
known_keys = st.sampled_from(
    [
        "events",
        "id",
        "type",
        "session",
        "model",
        "lease_id",
        "status",
        "changes",
        "nodes",
        "gpus",
        "max_operations",
        "wait_seconds",
        "measured_seconds",
        "capabilities",
        "request",
        "turn_end",
        "add_gpu",
        "n1",
        "coder",
        "solver",
    ]
)
bodies = st.dictionaries(known_keys, json_values, max_size=5) | json_values

ENDPOINTS = [
    ("POST", "/v1/events"),
    ("POST", "/v1/nodes/n1/register"),
    ("POST", "/v1/nodes/n1/heartbeat"),
    ("POST", "/v1/nodes/n1/lease"),
    ("POST", "/v1/operations/1.op-1/report"),
    ("POST", "/v1/whatif"),
    ("PUT", "/v1/cluster"),
    ("PUT", "/v1/models/fuzz"),
]


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
def test_random_bodies_never_500(demo, method, path):
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(body=bodies)
    def check(body):
        if isinstance(body, dict) and "wait_seconds" in body:
            body["wait_seconds"] = 0
        response = demo.client.request(method, path, json=body)
        assert response.status_code < 500, response.text
        if response.status_code >= 400:
            assert response.headers["content-type"].startswith("application/problem+json")

    check()


names = st.sampled_from(["coder", "planner", "s01", "s03", "x", "", "n1", "ünï", "a" * 300])
events = st.lists(
    st.fixed_dictionaries(
        {
            "id": st.text(max_size=8),
            "type": st.sampled_from(
                ["request", "turn_end", "tool_call_start", "tool_call_end", "session_end", "other"]
            ),
            "session": names,
        },
        optional={
            "model": names,
            "input_tokens": st.integers(-5, 2**64),
            "output_tokens": st.integers(-5, 2**64),
            "slo": st.sampled_from(["blocking", "interactive", "background", "urgent"]),
            "at": st.floats(-1e12, 1e12),
            "user": names,
        },
    ),
    max_size=6,
)


def test_well_shaped_event_batches_never_500(demo):
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(batch=events)
    def check(batch):
        response = demo.client.post("/v1/events", json={"events": batch})
        assert response.status_code in (200, 422), response.text

    check()
    assert demo.post("/v1/plan").status_code == 200
    assert demo.get("/v1/sessions").status_code == 200
    assert demo.get("/v1/pareto").status_code == 200


def test_event_time_beyond_any_calendar_is_refused_by_field(demo):
    response = demo.client.post(
        "/v1/events", json={"events": [{"id": "e-far", "type": "turn_end", "session": "s01", "at": 1e12}]}
    )
    assert response.status_code == 422
    assert response.json()["field"] == "events.0.at"
