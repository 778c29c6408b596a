"""A restarted app (same database) restores everything and keeps its promises."""

from __future__ import annotations

from api_helpers import FakeClock, request


def test_restart_restores_state(make_app):
    clock = FakeClock()
    first = make_app(tiny=True, clock=clock)
    first.events(
        request("e1", "s1", "beta", slo="blocking", input_tokens=1000), request("e2", "s2", "alpha", input_tokens=500)
    )
    first.post("/v1/plan")
    lease = first.lease("n1").json()
    first.report(lease["operations"][0]["id"], lease["lease_id"], measured_seconds=0.5)
    pending = first.lease("n1").json()
    state = {p: first.get(p).json() for p in ("/v1/srv", "/v1/sessions", "/v1/plan", "/v1/operations")}
    first.client.__exit__(None, None, None)

    second = make_app(clock=clock)  # no seed: the database wins
    for path, before in state.items():
        assert second.get(path).json() == before, path
    assert second.events(request("e1", "s1", "beta")).json()["duplicates"] == 1
    assert second.report(pending["operations"][0]["id"], pending["lease_id"]).status_code == 200
