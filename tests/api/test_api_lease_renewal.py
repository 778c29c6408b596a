"""POST /v1/nodes/{node}/leases/{lease}/renew: a lease renewed in time outlives `lease_seconds` and its report is
accepted; one that ran out is a 409 saying how; a node's token renews only its own node's leases."""

from __future__ import annotations

import json

from api_helpers import NODE1, NODE2, OPERATOR, assert_problem, request

from planner_service.wire.operations import RenewOut

LEASE_SECONDS = 30.0


def busy(app, headers=None):
    """beta (blocking) must replace alpha on n1's GPU; the first lease of n1 holds the drop of alpha."""
    app.events(
        request("e1", "s1", "beta", slo="blocking", input_tokens=1000),
        request("e2", "s2", "alpha", input_tokens=1000),
        headers=headers,
    )
    app.post("/v1/plan", headers=headers)
    lease = app.lease("n1", headers=headers).json()
    assert [o["action"] for o in lease["operations"]] == ["drop"]
    return lease


def renew(app, node: str, lease_id: str, headers=None):
    return app.post(f"/v1/nodes/{node}/leases/{lease_id}/renew", headers=headers)


def operation(app, op_id: str, headers=None) -> dict:
    (op,) = [o for o in app.get("/v1/operations", headers=headers).json() if o["id"] == op_id]
    return op


def test_a_renewed_lease_outlives_lease_seconds_and_its_report_is_accepted(tiny):
    lease = busy(tiny)
    op = lease["operations"][0]["id"]
    for _ in range(4):  # 4 x 20 s: 80 s of a 30 s lease
        tiny.clock.advance(20.0)
        answer = renew(tiny, "n1", lease["lease_id"])
        assert answer.status_code == 200, answer.text
        body = RenewOut.model_validate(answer.json())
        assert body.operations == [op] and body.node == "n1" and body.lease_id == lease["lease_id"]
        assert body.expires_in_seconds == LEASE_SECONDS
        held = operation(tiny, op)
        assert held["state"] == "leased" and held["lease_expires_at"] == tiny.clock() + LEASE_SECONDS
    assert tiny.lease("n1").json()["operations"] == []  # not handed to another lease
    tiny.clock.advance(20.0)
    done = tiny.report(op, lease["lease_id"], measured_seconds=100.0)
    assert done.status_code == 200, done.text
    assert done.json()["operation"]["state"] == "done" and done.json()["operation"]["leases"] == 1


def test_the_answer_has_the_documented_keys_in_order(tiny):
    lease = busy(tiny)
    answer = renew(tiny, "n1", lease["lease_id"])
    assert list(answer.json()) == ["lease_id", "node", "expires_at", "expires_in_seconds", "operations"]
    assert json.dumps(answer.json()) == json.dumps(RenewOut.model_validate(answer.json()).model_dump(mode="json"))


def test_a_renewal_after_expiry_is_a_409_naming_why(tiny):
    lease = busy(tiny)
    op = lease["operations"][0]["id"]
    tiny.clock.advance(LEASE_SECONDS + 1)
    problem = assert_problem(renew(tiny, "n1", lease["lease_id"]), 409, "no longer holds any operation")
    assert f"it expired at 2027-01-15T08:00:30Z ({op} re-queued)" in problem["detail"]
    assert_problem(tiny.report(op, lease["lease_id"]), 409, "re-queued")
    again = tiny.lease("n1").json()
    assert [o["id"] for o in again["operations"]] == [op]
    assert renew(tiny, "n1", again["lease_id"]).status_code == 200


def test_a_renewal_of_a_superseded_lease_is_a_409(tiny):
    lease = busy(tiny)
    epoch = tiny.post("/v1/plan").json()["epoch"]  # the drop stays in flight under the epoch before
    assert lease["operations"][0]["epoch"] == epoch - 1
    tiny.clock.advance(LEASE_SECONDS + 1)
    assert_problem(renew(tiny, "n1", lease["lease_id"]), 409, f"superseded by plan epoch {epoch}")


def test_a_renewal_of_a_reported_or_unknown_lease_is_a_409(tiny):
    lease = busy(tiny)
    op = lease["operations"][0]["id"]
    assert tiny.report(op, lease["lease_id"]).status_code == 200
    assert_problem(renew(tiny, "n1", lease["lease_id"]), 409, f"every operation it held was reported ({op} reported)")
    assert_problem(renew(tiny, "n1", "0123abcd"), 409, "lease 0123abcd", "the service does not know it")


def test_a_node_token_renews_only_its_own_nodes_leases(make_app):
    app = make_app(tiny=True, auth=True)
    lease = busy(app, headers=OPERATOR)
    lease_id = lease["lease_id"]
    assert_problem(renew(app, "n1", lease_id), 401, "Bearer")
    assert_problem(renew(app, "n1", lease_id, headers=NODE2), 403, "the token of node 'n2' does not reach node 'n1'")
    assert_problem(renew(app, "n2", lease_id, headers=NODE2), 403, f"lease {lease_id} belongs to node 'n1'")
    assert_problem(renew(app, "n2", lease_id, headers=OPERATOR), 404, "it is a lease of node 'n1'")
    assert renew(app, "n1", lease_id, headers=NODE1).status_code == 200
    assert renew(app, "n1", lease_id, headers=OPERATOR).status_code == 200
    app.clock.advance(LEASE_SECONDS + 1)  # ended, the lease is still n1's: n2's token learns nothing of it
    assert_problem(renew(app, "n2", lease_id, headers=NODE2), 403, "belongs to node 'n1'")
    assert operation(app, lease["operations"][0]["id"], headers=OPERATOR)["state"] == "queued"  # the expiry it ran


def test_an_unknown_node_and_a_malformed_lease_id(tiny):
    assert_problem(renew(tiny, "nx", "abc"), 404, "unknown node 'nx'")
    problem = assert_problem(renew(tiny, "n1", "x" * 201), 422)
    assert problem["field"] == "lease_id"
    assert tiny.get("/v1/nodes/n1/leases/abc/renew").status_code == 405


def test_the_route_is_documented_with_its_answer_and_errors(tiny):
    spec = tiny.get("/openapi.json").json()
    route = spec["paths"]["/v1/nodes/{node_id}/leases/{lease_id}/renew"]["post"]
    assert route["operationId"] == "renew_lease"
    assert route["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/RenewOut"
    }
    for status in ("401", "403", "404", "409", "422"):
        assert "application/problem+json" in route["responses"][status]["content"], status
