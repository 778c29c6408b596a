"""GET /v1/routes: the gateway's route table, its long-poll, and the router token's reach."""

from __future__ import annotations

import threading

import pytest
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
        {"id": "n1/vllm-a", "node": "n1", "gpus": [], "state": "running", "url": "http://n1:8000", "engine": "vllm"}
    ]
    assert by_model["beta"][0]["state"] == "stopped"
    assert table["directives"] == {"decided": True, "pins": [], "warmups": []}
    # a heartbeat's instance wins over the registration's stand-in, with the state it reports
    hb = {"instances": [{"instance": _instance("beta", "n2", "n2-g0"), "state": "asleep_host"}]}
    assert app.post("/v1/nodes/n2/heartbeat", json=hb).status_code == 200
    table2 = app.get("/v1/routes").json()
    beta = {m["model"]: m["instances"] for m in table2["models"]}["beta"]
    assert beta == [
        {
            "id": "beta@bf16@n2-g0",
            "node": "n2",
            "gpus": ["n2-g0"],
            "state": "asleep",
            "url": "http://n2:8000",
            "engine": "vllm",  # the registered engine's kind: the gateway's pins read it (clients/gateway/pins.py)
        }
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


def _alpha_on_n1_beta_running_on_n2(app, **beta: object) -> None:
    """n1's vLLM serves alpha on n1-g0, n2's beta on n2-g0, and n2's heartbeat reports beta's instance running
    (`beta`: more of that instance's fields)."""
    _register(app, "n1", [{"name": "vllm-a", "models": ["alpha"], "url": "http://n1:8000", "gpus": ["n1-g0"]}])
    _register(app, "n2", [{"name": "vllm-b", "models": ["beta"], "url": "http://n2:8000", "gpus": ["n2-g0"]}])
    hb = {"instances": [{"instance": {**_instance("beta", "n2", "n2-g0"), **beta}, "state": "running"}]}
    assert app.post("/v1/nodes/n2/heartbeat", json=hb).status_code == 200


def _turn(app, session: str, model: str, n: int, *, tool: bool = False, input_tokens: int = 1000) -> None:
    events = [
        request(f"{session}-r{n}", session, model, input_tokens=input_tokens),
        {"id": f"{session}-t{n}", "type": "turn_end", "session": session, "output_tokens": 24},
    ]
    if tool:
        events.append({"id": f"{session}-c{n}", "type": "tool_call_start", "session": session, "tool": "grep"})
    assert app.events(*events).status_code == 200


def test_warmups_for_sessions_in_a_tool_call_go_to_an_idle_card_of_the_predicted_model(make_app):
    app = make_app(tiny=True)
    _alpha_on_n1_beta_running_on_n2(app)
    # six sessions handed off from alpha to beta: the predictor's P(beta | alpha) = (6 + 10 * 0.4 + 0.1) / (6 + 10 + 0.2)
    # = 0.62 (domain/predictions.py: the stay prior 0.6 leaves 0.4 to beta, weight 10, alpha 0.1); the threshold is 0.5
    for i in range(6):
        _turn(app, f"h{i}", "alpha", 1)
        _turn(app, f"h{i}", "beta", 2)
    _turn(app, "s1", "alpha", 1, tool=True)
    # the start's plan drops alpha's weights from n2-g0: while that operation is open the card is not idle
    assert app.get("/v1/routes").json()["directives"] == {"decided": True, "pins": [], "warmups": []}
    lease = app.lease("n2", n=100).json()
    for op in lease["operations"]:
        assert app.report(op["id"], lease["lease_id"]).status_code == 200
    directives = app.get("/v1/routes").json()["directives"]
    [warmup] = directives["warmups"]
    assert warmup["session"] == "s1" and warmup["model"] == "beta" and warmup["instance"] == "beta@bf16@n2-g0"
    assert warmup["tokens"] == 1024 and warmup["probability"] == 0.62  # 1,000 in + 24 out
    # priced (the default target): beta's 6,442,450,944 active parameters (12 GiB at 2 bytes) prefill at
    # 2 * 6.44e9 / (1e14 * 0.5) = 2.577e-4 s a token, 0.26388 s for 1,024 tokens; interactive (weight 2) at
    # p 10.1 / 16.2: 2 * 0.62346 * 0.26388 = 0.32904 s (no session ended and every turn gap, turn end to next request,
    # is under the 300 s horizon: the next request surely comes in it), less 1,024 * 128 KiB = 0.125 GiB at 0.02 s a
    # GiB for the part of the horizon it is held: the gaps, 0 s on the test's fake clock
    assert warmup["value_seconds"] == 0.329
    # a request on beta (no KV holder known: it may run on any beta card) makes the card busy: the warm-up goes
    assert app.events(request("x-r1", "x", "beta", input_tokens=10)).status_code == 200
    assert app.get("/v1/routes").json()["directives"]["warmups"] == []
    assert app.events({"id": "x-t1", "type": "turn_end", "session": "x", "output_tokens": 1}).status_code == 200
    assert [w["session"] for w in app.get("/v1/routes").json()["directives"]["warmups"]] == ["s1"]
    # the session's next request: no longer in a tool call, no warm-up
    assert app.events({"id": "s1-e", "type": "tool_call_end", "session": "s1", "tool": "grep"}).status_code == 200
    assert app.get("/v1/routes").json()["directives"]["warmups"] == []


def test_sessions_that_end_lower_a_warm_up_s_value_and_are_remembered_across_a_restart(make_app):
    """As above, and six sessions that ended after one request on alpha: P(more | alpha) = (6 + 0.1) /
    (6 + 0.1 + 6) = 6.1 / 12.1 (planner/predictor.py `next_turn`; the six hand-offs from alpha are the 6). Every gap
    is 0 s on the fake clock: the next request comes within the horizon with that chance, else the KV is held the
    whole horizon. 2 * 0.62346 * 0.50413 * 0.26388 = 0.16588 s, less 0.0025 s * (1 - 0.50413) = 0.00124 s: 0.165 s
    (0.329 s without the ends). A restarted service reads the ends back with the other observations."""
    app = make_app(tiny=True)
    _alpha_on_n1_beta_running_on_n2(app)
    for i in range(6):
        _turn(app, f"h{i}", "alpha", 1)
        _turn(app, f"h{i}", "beta", 2)
        _turn(app, f"e{i}", "alpha", 1)
        assert app.events({"id": f"e{i}-end", "type": "session_end", "session": f"e{i}"}).status_code == 200
    _turn(app, "s1", "alpha", 1, tool=True)
    lease = app.lease("n2", n=100).json()
    for op in lease["operations"]:
        assert app.report(op["id"], lease["lease_id"]).status_code == 200
    [warmup] = app.get("/v1/routes").json()["directives"]["warmups"]
    assert (warmup["session"], warmup["value_seconds"]) == ("s1", 0.165)
    more = 6.1 / 12.1
    turn = app.client.app.state.service.live.predictor.next_turn("alpha", 300.0)
    assert turn == (pytest.approx(more), pytest.approx((1 - more) * 300))
    restarted = make_app(tiny=True, clock=app.clock)  # the ends are stored observations, read back at the start
    assert restarted.client.app.state.service.live.predictor.next_turn("alpha", 300.0) == turn


@pytest.mark.parametrize(
    ("target", "pool", "expected"),
    [("top", 1 << 30, []), ("priced", 1 << 30, [("s1", "beta")]), ("priced", 100 << 20, [])],
)
def test_the_warm_up_target_is_a_setting_and_the_pool_bounds_the_room(make_app, target, pool, expected):
    """Under the former rule (`top`), s1's most likely next model is its own, alpha, whose card holds its KV:
    nothing to warm; the priced default warms beta, 0.4 likely by the predictor's prior, as that pays for its
    room: 1,024 tokens at 128 KiB, 128 MiB, which beta's reported KV pool of 1 GiB has and one of 100 MiB has
    not (though its card has GiBs free)."""
    app = make_app(tiny=True, warmup_target=target)
    _alpha_on_n1_beta_running_on_n2(app, kv_pool_bytes_per_gpu=pool)
    _turn(app, "s1", "alpha", 1, tool=True)
    _run_every_operation(app)
    directives = app.get("/v1/routes").json()["directives"]
    assert [(w["session"], w["model"]) for w in directives["warmups"]] == expected
    if expected:
        assert directives["warmups"][0]["probability"] == 0.4 and directives["warmups"][0]["value_seconds"] > 0


def _run_every_operation(app) -> None:
    for _ in range(20):
        open_ops = [o for o in app.get("/v1/operations").json() if o["state"] in ("queued", "leased")]
        if not open_ops:
            return
        for node in sorted({o["node"] for o in open_ops}):
            lease = app.lease(node, n=100).json()
            for op in lease["operations"]:
                assert app.report(op["id"], lease["lease_id"]).status_code == 200
    raise AssertionError("the plan's operations never finished")


def test_a_session_whose_kv_the_plan_keeps_on_its_holder_is_pinned_there(make_app):
    app = make_app(tiny=True)
    _register(app, "n1", [{"name": "vllm-a", "models": ["alpha"], "url": "http://n1:8000", "gpus": ["n1-g0"]}])
    assert app.events(request("s1-r1", "s1", "alpha", input_tokens=1000)).status_code == 200
    assert app.post("/v1/plan").status_code == 200
    _run_every_operation(app)
    # the plan put s1's KV (1,000 tokens) on n1-g0, the agent reported it done: n1/vllm-a holds it and keeps it
    table = app.get("/v1/routes").json()
    assert table["sessions"] == [{"session": "s1", "model": "alpha", "instance": "n1/vllm-a"}]
    assert table["directives"]["pins"] == [{"session": "s1", "instance": "n1/vllm-a", "tokens": 1000}]
    assert app.events({"id": "s1-end", "type": "session_end", "session": "s1"}).status_code == 200
    assert app.get("/v1/routes").json()["directives"]["pins"] == []
