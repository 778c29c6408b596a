"""Session events: idempotency, validation, the session record."""

from __future__ import annotations

from api_helpers import assert_problem, request


def test_repeated_event_is_acknowledged_and_ignored(demo):
    first = demo.events(request("e1", "new", "coder", input_tokens=100)).json()
    assert first == {"applied": 1, "duplicates": 0, "results": [{"id": "e1", "status": "applied"}]}
    again = demo.events(request("e1", "new", "coder", input_tokens=100), request("e2", "new", "coder")).json()
    assert again["applied"] == 1 and again["results"][0] == {"id": "e1", "status": "duplicate"}
    session = demo.get("/v1/sessions/new").json()
    assert session["requests"] == 2 and session["context_tokens"] == 100


def test_unknown_model_is_rejected_with_the_known_ones_and_nothing_applies(demo):
    response = demo.events(request("ok", "x", "coder"), request("bad", "x", "gpt-9"))
    body = assert_problem(response, 422, "events[1].model", "gpt-9", "coder", "reasoner")
    assert body["field"] == "events.1.model"
    assert demo.get("/v1/sessions/x").status_code == 404
    assert demo.events(request("ok", "x", "coder")).json()["applied"] == 1  # "ok" was not recorded either


def test_events_for_an_unknown_session_are_rejected(demo):
    assert_problem(demo.events({"id": "t", "type": "turn_end", "session": "ghost"}), 422, "events[0].session", "ghost")


def test_session_lifecycle(demo):
    demo.events(request("r1", "a", "planner", user="zoe", slo="blocking", input_tokens=1000, output_tokens=0))
    s = demo.get("/v1/sessions/a").json()
    assert (s["active"], s["model"], s["user"], s["slo"], s["context_tokens"]) == (
        True,
        "planner",
        "zoe",
        "blocking",
        1000,
    )
    demo.events({"id": "t1", "type": "tool_call_start", "session": "a", "tool": "grep"})
    assert demo.get("/v1/sessions/a").json()["in_tool_call"] is True
    demo.events(
        {"id": "t2", "type": "tool_call_end", "session": "a"},
        {"id": "t3", "type": "turn_end", "session": "a", "output_tokens": 200},
    )
    s = demo.get("/v1/sessions/a").json()
    assert (s["active"], s["in_tool_call"], s["context_tokens"], s["tool_calls"]) == (False, False, 1200, 1)
    demo.events(request("r2", "a", "coder", input_tokens=300))
    s = demo.get("/v1/sessions/a").json()
    assert s["model"] == "coder" and s["requests"] == 2 and s["active"]
    assert s["cached_tokens"] == {"planner": 1200, "coder": 1500}
    ids = [x["id"] for x in demo.get("/v1/sessions").json()]
    assert "a" in ids and "s01" in ids
    demo.events({"id": "end", "type": "session_end", "session": "a"})
    assert demo.get("/v1/sessions/a").status_code == 404  # it held no KV: forgotten at once
    assert_problem(demo.get("/v1/sessions/nope"), 404, "nope")


def test_session_with_kv_is_kept_until_its_kv_is_dropped(demo):
    demo.events({"id": "end", "type": "session_end", "session": "s03"})  # s03 holds KV in the demo
    s = demo.get("/v1/sessions/s03").json()
    assert s["ended"] and not s["active"] and s["kv_bytes"]


def test_events_are_never_refused_when_the_cluster_is_full(make_app):
    app = make_app(tiny=True)
    burst = [request(f"e{i}", f"s{i}", "beta", input_tokens=400_000, slo="interactive") for i in range(6)]
    assert app.events(*burst).json()["applied"] == 6
    plan = app.post("/v1/plan") and app.get("/v1/plan").json()
    assert plan["status"] == "partial"
    assert plan["unserved"] and all(u["constraint"] for u in plan["unserved"])
    assert app.metric("statebudget_unserved_sessions") == len(plan["unserved"])
