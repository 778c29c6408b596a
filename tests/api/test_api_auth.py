"""Bearer tokens: operators reach everything, a node only its own register/heartbeat/lease/report."""

from __future__ import annotations

from api_helpers import NODE1, NODE2, OPERATOR, assert_problem, request


def test_open_endpoints_need_no_token(make_app):
    app = make_app(auth=True)
    for path in ("/livez", "/readyz", "/metrics", "/openapi.json", "/docs"):
        assert app.get(path).status_code == 200, path


def test_scopes(make_app):
    app = make_app(auth=True)
    assert_problem(app.get("/v1/srv"), 401, "Bearer")
    assert_problem(app.get("/v1/srv", headers={"Authorization": "Bearer wrong"}), 401, "unknown")
    for path in ("/v1/cluster", "/v1/models", "/v1/sessions", "/v1/srv", "/v1/plan", "/v1/operations"):
        assert app.get(path, headers=OPERATOR).status_code == 200, path
        assert_problem(app.get(path, headers=NODE1), 403, "operator token")
    assert_problem(app.events(request("e", "s", "coder"), headers=NODE1), 403)
    assert app.events(request("e", "s", "coder"), headers=OPERATOR).status_code == 200
    assert_problem(app.post("/v1/whatif", json={"changes": []}, headers=NODE1), 403)
    assert_problem(app.post("/v1/plan", headers=NODE2), 403)
    assert app.post("/v1/nodes/n1/register", json={}, headers=NODE1).status_code == 200
    assert app.post("/v1/nodes/n1/heartbeat", json={}, headers=NODE1).status_code == 200
    assert_problem(app.post("/v1/nodes/n2/heartbeat", json={}, headers=NODE1), 403, "n1", "n2")
    assert_problem(app.lease("n2", headers=NODE1), 403)
    lease = app.lease("n1", 1, headers=NODE1).json()
    op = lease["operations"][0]
    assert_problem(app.report(op["id"], lease["lease_id"], headers=NODE2), 403, "belongs to node 'n1'")
    assert app.report(op["id"], lease["lease_id"], headers=NODE1).status_code == 200
    assert app.lease("n2", 1, headers=OPERATOR).status_code == 200
