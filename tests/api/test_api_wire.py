"""Every route's response model carries exactly what the service returns: no field dropped, none added,
no value changed (the service's views are dicts; the API validates them into `planner_service.wire`)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from api_helpers import request
from pydantic import TypeAdapter

from planner_service.service import questions
from planner_service.service.inputs import ReportIn, WhatIfIn
from planner_service.wire.cluster import ClusterOut, ModelOut
from planner_service.wire.operations import LeaseOut, OperationRecord, ReportOut
from planner_service.wire.plan import CurrentPlanOut, ExplainOut, ParetoOut, WhatIfOut
from planner_service.wire.sessions import EventsOut, SessionOut
from planner_service.wire.state import SrvOut


def round_trip(model: Any, raw: Any) -> Any:
    """`raw` validated into `model` and written back as the API writes it."""
    adapter = TypeAdapter(model)
    return adapter.dump_python(adapter.validate_python(raw), mode="json", by_alias=True, exclude_unset=True)


def same(written: Any, raw: Any) -> None:
    """`written` is `raw` as JSON: keys in the same order, values of the same JSON types (1 stays `1`, not `1.0`)."""
    assert json.dumps(written) == json.dumps(raw)


def busy(app) -> None:
    """A plan with operations, one of them leased and done, one failed and held back, and a heartbeat."""
    app.events(
        request("e1", "s1", "beta", slo="blocking", input_tokens=1000), request("e2", "s2", "alpha", input_tokens=1000)
    )
    app.post("/v1/plan")
    app.post("/v1/nodes/n1/register", json={"capabilities": ["kv_offload"]})
    app.post("/v1/nodes/n1/heartbeat", json={"gpus": [{"id": "n1-g0", "h2d_bytes_per_s": 2e10}]})


def test_every_view_survives_its_response_model(make_app) -> None:
    app = make_app(tiny=True)
    service = app.client.app.state.service
    busy(app)
    lease = service.lease("n1", 1)
    assert round_trip(LeaseOut, lease) == lease
    (first,) = lease["operations"]
    done = service.report(first["id"], ReportIn(lease_id=lease["lease_id"], status="done", measured_seconds=0.5))
    assert round_trip(ReportOut, done) == done
    lease = service.lease("n1", 1)
    (second,) = lease["operations"]
    service.report(second["id"], ReportIn(lease_id=lease["lease_id"], status="failed", error="engine refused"))
    service.replan()
    plan = service.plan_view()
    assert plan["held_back"], "the failed move is held back"
    views: list[tuple[Any, Any]] = [
        (ClusterOut, service.cluster_view()),
        (list[ModelOut], service.models_view()),
        (list[SessionOut], service.sessions_view()),
        (SrvOut, service.srv_view()),
        (CurrentPlanOut, plan),
        (list[OperationRecord], service.operations_view(state="done")),
        (list[OperationRecord], service.operations_view(state="failed")),
        (list[OperationRecord], service.operations_view(state="superseded")),
        (list[OperationRecord], service.operations_view()),
        (ExplainOut, questions.explain(service.live_view(), model="beta")),
        (ExplainOut, questions.explain(service.live_view(), session="s1")),
        (ParetoOut, questions.pareto(service.live_view(), service.solve)),
    ]
    for model, raw in views:
        assert raw, model
        same(round_trip(model, raw), raw)
    telemetry = service.cluster_view()["nodes"][0]["telemetry"]
    assert telemetry["gpus"][0]["h2d_bytes_per_s"] == 2e10


@pytest.mark.parametrize("solver", ["greedy", "search", "milp"])
def test_what_if_of_every_solver_survives_its_response_model(make_app, solver: str) -> None:
    app = make_app(tiny=True)
    service = app.client.app.state.service
    busy(app)
    changes = [{"type": "add_sessions", "model": "alpha", "count": 2}]
    raw = questions.what_if(
        service.live_view(), WhatIfIn.model_validate({"changes": changes, "solver": solver}), service.solve
    )
    same(round_trip(WhatIfOut, raw), raw)
    # the solver's own details stay: the search's counters, the MILP's bound and gap
    details = {"greedy": set(), "search": {"search"}, "milp": {"bound", "gap", "milp"}}
    assert {"search", "bound", "gap", "milp"} & set(raw["plan"]) == details[solver]


def test_http_bodies_are_the_service_views(make_app) -> None:
    app = make_app(tiny=True)
    service = app.client.app.state.service
    busy(app)
    for path, view in [
        ("/v1/cluster", service.cluster_view),
        ("/v1/models", service.models_view),
        ("/v1/sessions", service.sessions_view),
        ("/v1/srv", service.srv_view),
        ("/v1/plan", service.plan_view),
        ("/v1/operations", service.operations_view),
    ]:
        # the same keys in the same order, the same values of the same JSON types
        assert json.dumps(app.get(path).json()) == json.dumps(view()), path
    events = app.events(request("e1", "s1", "beta"), request("e9", "s1", "alpha")).json()
    assert events == round_trip(EventsOut, events) and [r["status"] for r in events["results"]] == [
        "duplicate",
        "applied",
    ]


def test_the_operations_state_filter_lists_its_choices(make_app) -> None:
    app = make_app(tiny=True)
    out = app.get("/v1/operations", params={"state": "running"})
    assert out.status_code == 422 and "held_back" in out.text and "superseded" in out.text
    assert app.get("/v1/operations", params={"state": "held_back"}).json() == []
