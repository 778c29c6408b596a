"""GET /v1/routes: the gateway's route table, its long-poll, and the router token's reach."""

from __future__ import annotations

import threading

from api_helpers import NODE1, OPERATOR, assert_problem, request
from support import CallLog

ROUTER = {"Authorization": "Bearer router-token"}


def _register(app, node: str, engines: list[dict], headers=None):
    response = app.post(f"/v1/nodes/{node}/register", json={"engines": engines}, headers=headers or {})
    assert response.status_code == 200, response.text
    return response.json()


def _instance(model: str, node: str, gpu: str) -> dict:
    return {
        "id": f"{model}@bf16@{gpu}",
        "node": node,
        "kind": "vllm",
        "model": model,
        "precision": "bf16",
        "gpus": [gpu],
        "kv_pool_bytes_per_gpu": 1 << 30,
    }


def test_instances_carry_state_and_registered_url(make_app):
    app = make_app(tiny=True)
    out = _register(app, "n1", [{"name": "vllm-a", "kind": "vllm", "models": ["alpha"], "url": "http://n1:8000"}])
    assert out["engines"] == [{"model": "alpha", "gpus": [], "url": "http://n1:8000"}]
    _register(
        app, "n2", [{"name": "vllm-b", "kind": "vllm", "models": ["beta"], "url": "http://n2:8000", "gpus": ["n2-g0"]}]
    )
    table = app.get("/v1/routes").json()
    by_model = {m["model"]: m["instances"] for m in table["models"]}
    # the tiny scenario holds alpha's weights on n1-g0; beta's only on NVMe: running vs stopped
    assert by_model["alpha"] == [
        {"id": "n1/vllm-a", "node": "n1", "gpus": [], "state": "running", "url": "http://n1:8000"}
    ]
    assert by_model["beta"][0]["state"] == "stopped"
    assert table["directives"] == {"decided": False, "pins": [], "warmups": []}
    # a heartbeat's instance wins over the registration's stand-in, with the state it reports
    hb = {"instances": [{"instance": _instance("beta", "n2", "n2-g0"), "state": "asleep_host"}]}
    assert app.post("/v1/nodes/n2/heartbeat", json=hb).status_code == 200
    table2 = app.get("/v1/routes").json()
    beta = {m["model"]: m["instances"] for m in table2["models"]}["beta"]
    assert beta == [
        {"id": "beta@bf16@n2-g0", "node": "n2", "gpus": ["n2-g0"], "state": "asleep", "url": "http://n2:8000"}
    ]
    assert table2["revision"] != table["revision"]
    cluster = app.get("/v1/cluster").json()
    n2 = next(n for n in cluster["nodes"] if n["id"] == "n2")
    assert n2["engines"] == [{"model": "beta", "gpus": ["n2-g0"], "url": "http://n2:8000"}]


def test_sessions_name_their_model(make_app):
    app = make_app(tiny=True)
    _register(app, "n1", [{"name": "vllm-a", "models": ["alpha"], "url": "http://n1:8000"}])
    assert app.events(request("e1", "s1", "alpha")).status_code == 200
    sessions = app.get("/v1/routes").json()["sessions"]
    assert [(s["session"], s["model"]) for s in sessions] == [("s1", "alpha")]


def test_long_poll_answers_on_a_change_and_after_wait(make_app):
    app = make_app(tiny=True, max_wait_seconds=60.0)
    first = app.get("/v1/routes").json()
    looks = CallLog(app.client.app.state.service, "routes_view")
    same = app.get("/v1/routes", params={"after_revision": first["revision"], "wait": 0.2}).json()
    assert same["revision"] == first["revision"]
    assert len(looks.calls) >= 2  # it looked, waited for a change that never came, and looked again
    looks.calls.clear()
    result: dict = {}
    params = {"after_epoch": first["epoch"], "after_revision": first["revision"], "wait": 60}
    thread = threading.Thread(target=lambda: result.update(body=app.get("/v1/routes", params=params).json()))
    thread.start()
    looks.wait_for(lambda calls: len(calls) >= 1, what="the long-poll's first look at the table")
    assert thread.is_alive()  # nothing changed: it waits
    _register(app, "n1", [{"name": "vllm-a", "models": ["alpha"], "url": "http://n1:8000"}])
    thread.join(timeout=20)
    assert not thread.is_alive(), "the registration did not end the long-poll, which would have waited its 60 s"
    assert result["body"]["revision"] != first["revision"]


def test_router_token_reaches_events_routes_and_plan_only(make_app):
    app = make_app(tiny=True, auth=True, router_tokens=["router-token"])
    assert app.post("/v1/plan", headers=OPERATOR).status_code == 200
    for path in ("/v1/routes", "/v1/plan"):
        assert app.get(path, headers=ROUTER).status_code == 200, path
        assert_problem(app.get(path, headers=NODE1), 403, "operator token (or a router token)")
    assert app.events(request("e", "s", "alpha"), headers=ROUTER).status_code == 200
    assert_problem(app.get("/v1/routes"), 401, "router")
    for path in ("/v1/cluster", "/v1/models", "/v1/sessions", "/v1/srv", "/v1/operations", "/v1/pareto"):
        assert_problem(app.get(path, headers=ROUTER), 403, "router token reaches only")
    assert_problem(app.post("/v1/plan", headers=ROUTER), 403, "router token")
    assert_problem(app.post("/v1/whatif", json={"changes": []}, headers=ROUTER), 403, "router token")
    assert_problem(app.post("/v1/nodes/n1/register", json={}, headers=ROUTER), 403, "router token")
    assert_problem(app.post("/v1/nodes/n1/lease", json={}, headers=ROUTER), 403, "router token")
    report = {"lease_id": "x", "status": "done"}
    assert_problem(app.post("/v1/operations/op/report", json=report, headers=ROUTER), 403, "router token")


def test_router_token_must_differ_from_others():
    import pytest
    from pydantic import ValidationError

    from planner_service.settings import Settings

    with pytest.raises(ValidationError, match="router_tokens"):
        Settings(operator_tokens=["same"], router_tokens=["same"])
