"""Plans, leases, reports: priorities, dependencies, expiry, epochs, idempotency, the SRV version."""

from __future__ import annotations

import json
import threading
import time

from api_helpers import assert_problem, request


def busy_tiny(app):
    """beta (blocking) must replace alpha on n1's GPU: drop alpha, then promote beta and prefill its KV."""
    app.events(
        request("e1", "s1", "beta", slo="blocking", input_tokens=1000), request("e2", "s2", "alpha", input_tokens=1000)
    )
    app.post("/v1/plan")


def test_plan_has_the_cli_format_and_an_epoch(demo):
    plan = demo.get("/v1/plan").json()
    for key in (
        "solver",
        "status",
        "objective",
        "objective_terms",
        "solve_seconds",
        "placement",
        "operations",
        "predicted",
        "unserved",
        "epoch",
    ):
        assert key in plan
    assert plan["epoch"] == 1 and all(op["id"].startswith("1.") for op in plan["operations"])
    replanned = demo.post("/v1/plan").json()
    assert replanned["epoch"] == 2 and replanned["changed"] is True
    assert all(op["id"].startswith("2.") for op in replanned["operations"])
    assert {k: v for k, v in replanned.items() if k != "changed"} == demo.get("/v1/plan").json()


def test_lease_gives_ready_operations_most_urgent_first(tiny):
    busy_tiny(tiny)
    lease = tiny.lease("n1").json()
    assert [op["action"] for op in lease["operations"]] == ["drop"]  # the promotes wait for the room
    assert lease["lease_id"] and lease["expires_at"]
    assert tiny.lease("n1").json()["operations"] == []
    tiny.report(lease["operations"][0]["id"], lease["lease_id"])
    second = tiny.lease("n1").json()["operations"]
    assert {op["action"] for op in second} == {"promote"} and len(second) == 2
    assert all(op["priority"] == "blocking" for op in second)


def test_srv_changes_only_when_an_operation_is_done(tiny):
    before = tiny.get("/v1/srv").json()
    busy_tiny(tiny)
    tiny.post("/v1/plan")
    lease = tiny.lease("n1").json()
    assert tiny.get("/v1/srv").json() == before
    op = lease["operations"][0]
    done = tiny.report(op["id"], lease["lease_id"]).json()
    assert done["srv_version"] == before["version"] + 1 and not done["duplicate"]
    after = tiny.get("/v1/srv").json()
    assert after["version"] == before["version"] + 1
    gpu_rows = [r for r in after["srv"] if r["model"] == "alpha" and r["tier"] == "gpu"]
    assert gpu_rows and gpu_rows[0]["fraction"] == 1.0  # n2 still holds alpha; n1's copy was dropped
    assert {
        "object": {"kind": "weights", "model": "alpha", "precision": "bf16"},
        "location": {"tier": "gpu", "gpu": "n1-g0"},
        "bytes": 12884901888,
    } not in after["placement"]


def test_report_is_idempotent(tiny):
    busy_tiny(tiny)
    lease = tiny.lease("n1").json()
    op = lease["operations"][0]
    first = tiny.report(op["id"], lease["lease_id"], measured_seconds=0.1)
    again = tiny.report(op["id"], lease["lease_id"], measured_seconds=0.1)
    assert again.status_code == 200 and again.json()["duplicate"]
    assert again.json()["srv_version"] == first.json()["srv_version"]
    assert_problem(tiny.report(op["id"], lease["lease_id"], status="failed"), 409, "already done")


def test_expired_lease_requeues_with_controllable_time(tiny):
    busy_tiny(tiny)
    lease = tiny.lease("n1").json()
    op = lease["operations"][0]
    tiny.clock.advance(31)
    ops = {o["id"]: o for o in tiny.get("/v1/operations", params={"node": "n1"}).json()}
    assert ops[op["id"]]["state"] == "queued" and ops[op["id"]]["lease_id"] is None
    assert tiny.metric("statebudget_lease_expiries_total", node="n1") == 1
    assert_problem(tiny.report(op["id"], lease["lease_id"]), 409, "re-queued")
    again = tiny.lease("n1").json()
    assert [o["id"] for o in again["operations"]] == [op["id"]] and again["lease_id"] != lease["lease_id"]
    assert tiny.report(op["id"], again["lease_id"]).status_code == 200


def test_new_epoch_supersedes_unleased_operations(demo):
    lease = demo.lease("n1", 1).json()
    leased = lease["operations"][0]
    queued = [o for o in demo.get("/v1/operations", params={"state": "queued"}).json()]
    demo.post("/v1/plan")
    states = {o["id"]: o["state"] for o in demo.get("/v1/operations", params={"state": "superseded"}).json()}
    assert all(states.get(o["id"]) == "superseded" for o in queued)
    assert_problem(demo.report(queued[0]["id"], lease["lease_id"]), 409, "superseded", "epoch 2")
    # the leased operation of epoch 1 is still in flight and can be reported
    assert demo.report(leased["id"], lease["lease_id"]).status_code == 200
    # the new epoch does not repeat the work in flight
    assert not any(
        o["object"] == leased["object"] and o["to"] == leased["to"] for o in demo.get("/v1/plan").json()["operations"]
    )


def test_expired_lease_of_an_old_epoch_is_superseded(demo):
    lease = demo.lease("n1", 1).json()
    demo.post("/v1/plan")
    demo.clock.advance(60)
    op = lease["operations"][0]
    assert_problem(demo.report(op["id"], lease["lease_id"]), 409, "superseded")


def test_foreign_lease_is_refused(demo):
    mine = demo.lease("n1", 1).json()
    op = mine["operations"][0]
    assert_problem(demo.report(op["id"], "someone-elses-lease"), 409, "another lease")
    other = demo.lease("n2", 1).json()
    assert_problem(demo.report(op["id"], other["lease_id"]), 409)
    assert_problem(demo.report("99.op-1", mine["lease_id"]), 404, "99.op-1")


def test_failed_report_is_recorded_and_replanned(tiny):
    busy_tiny(tiny)
    lease = tiny.lease("n1").json()
    op = lease["operations"][0]
    out = tiny.report(op["id"], lease["lease_id"], status="failed", error="engine refused").json()
    assert out["operation"]["state"] == "failed" and out["operation"]["error"] == "engine refused"
    assert tiny.metric("statebudget_operation_duration_seconds_count", action="drop", outcome="failed") is None
    epoch = tiny.get("/v1/plan").json()["epoch"]
    tiny.client.app.state.service.replan()  # what the loop does next: a failure forces a new epoch
    assert tiny.get("/v1/plan").json()["epoch"] == epoch + 1


def _move(op):
    return op["action"], json.dumps(op["object"], sort_keys=True), json.dumps(op["from"]), json.dumps(op["to"])


def test_a_failed_move_is_held_back_with_its_dependents_and_queued_again_after_a_doubling_wait(make_app):
    app = make_app(tiny=True)
    service = app.client.app.state.service
    busy_tiny(app)
    lease = app.lease("n1").json()
    drop = lease["operations"][0]
    app.report(drop["id"], lease["lease_id"], status="failed", error="engine refused")
    service.replan()  # what the loop does next: a failure forces a new epoch
    plan = app.get("/v1/plan").json()
    held = {_move(h["operation"]): h for h in plan["held_back"]}
    assert _move(drop) in held and held[_move(drop)]["failures"] == 1 and held[_move(drop)]["error"] == "engine refused"
    assert not any(_move(op) in held for op in plan["operations"])
    # everything on n1 waited for that drop: nothing there to lease while it is held back
    assert len(held) > 1 and all(h["operation"]["node"] == "n1" for h in held.values())
    assert app.lease("n1").json()["operations"] == []
    held_gauge = sum(
        app.metric("statebudget_queue_operations", node="n1", priority=p, state="held_back") or 0
        for p in ("blocking", "interactive", "background", "prefetch")
    )
    assert held_gauge == len(held)
    # no new epoch for the same plan while the move waits (no churn), one once the wait is over
    app.clock.advance(29)
    assert service.replan()["changed"] is False
    app.clock.advance(2)
    assert service.replan()["changed"] is True
    plan = app.get("/v1/plan").json()
    assert plan["held_back"] == [] and _move(drop) in {_move(op) for op in plan["operations"]}
    # a second failure waits twice as long
    lease = app.lease("n1").json()
    again = next(op for op in lease["operations"] if _move(op) == _move(drop))
    app.report(again["id"], lease["lease_id"], status="failed", error="engine refused")
    service.replan()
    (held,) = [h for h in app.get("/v1/plan").json()["held_back"] if _move(h["operation"]) == _move(drop)]
    assert held["failures"] == 2
    app.clock.advance(59)
    assert service.replan()["changed"] is False
    app.client.__exit__(None, None, None)

    restarted = make_app(clock=app.clock)  # the failures are not kept: its first plan queues the move once more
    plan = restarted.get("/v1/plan").json()
    assert plan["held_back"] == [] and _move(drop) in {_move(op) for op in plan["operations"]}


def test_long_poll_waits_and_wakes_when_work_becomes_ready(tiny):
    busy_tiny(tiny)
    lease = tiny.lease("n1").json()
    result: dict = {}

    def poll() -> None:
        started = time.monotonic()
        result["body"] = tiny.lease("n1", wait=10).json()
        result["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=poll)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive()  # nothing is ready: it waits
    tiny.report(lease["operations"][0]["id"], lease["lease_id"])
    thread.join(timeout=5)
    assert len(result["body"]["operations"]) == 2 and result["seconds"] < 5


def test_long_poll_times_out_empty(demo):
    started = time.monotonic()
    body = demo.lease("n3", wait=0.3).json()
    body = demo.lease("n3", wait=0.3).json() if body["operations"] else body
    while body["operations"]:
        body = demo.lease("n3", wait=0.3).json()
    assert body == {"lease_id": None, "expires_at": None, "expires_in_seconds": None, "operations": []}
    assert time.monotonic() - started >= 0.3


def test_calibration_from_measured_durations(tiny):
    busy_tiny(tiny)
    lease = tiny.lease("n1").json()
    tiny.report(lease["operations"][0]["id"], lease["lease_id"])
    lease = tiny.lease("n1").json()
    promote = next(o for o in lease["operations"] if o["object"]["kind"] == "weights")
    before = tiny.get("/v1/cluster").json()["nodes"][0]["nvme_read_bytes_per_s"]
    tiny.report(promote["id"], lease["lease_id"], measured_seconds=10.0, measured_bytes=promote["bytes"])
    node = tiny.get("/v1/cluster").json()["nodes"][0]
    measured = promote["bytes"] / 10.0
    assert node["calibrated"]["nvme_read_bytes_per_s"]["last_measured"] == measured
    assert node["nvme_read_bytes_per_s"] == 0.7 * before + 0.3 * measured


def test_background_loop_replans_after_an_event_burst(make_app):
    app = make_app(background_planning=True, replan_debounce_seconds=0.05)
    app.events(request("e1", "fresh", "vision", slo="blocking", input_tokens=5000))
    deadline = time.monotonic() + 10
    while app.get("/v1/plan").json()["epoch"] == 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    plan = app.get("/v1/plan").json()
    assert plan["epoch"] >= 2
    assert any(o["object"].get("session") == "fresh" for o in plan["operations"]), json.dumps(plan["operations"])[:500]


def test_an_event_burst_is_planned_once(make_app):
    app = make_app(background_planning=True, replan_debounce_seconds=0.5)
    for i in range(5):  # vision serves nowhere: the requests call for a plan at once
        app.events(request(f"e{i}", f"burst-{i}", "vision", input_tokens=1000))
    deadline = time.monotonic() + 10
    while app.get("/v1/plan").json()["epoch"] == 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.7)  # a second replan would have happened by now
    plan = app.get("/v1/plan").json()
    assert plan["epoch"] == 2
    assert {f"burst-{i}" for i in range(5)} <= {o["object"].get("session") for o in plan["operations"]}


def test_requests_for_a_warm_model_wait_for_the_periodic_replan(make_app):
    app = make_app(background_planning=True, replan_debounce_seconds=0.05, replan_interval_seconds=5.0)
    time.sleep(0.5)
    epoch = app.get("/v1/plan").json()["epoch"]
    app.events(request("e1", "warm", "planner", input_tokens=1000))  # planner serves on n3 from the start
    time.sleep(1.0)
    assert app.get("/v1/plan").json()["epoch"] == epoch  # its engine serves it: no plan at once
    deadline = time.monotonic() + 15
    while app.get("/v1/plan").json()["epoch"] == epoch and time.monotonic() < deadline:
        time.sleep(0.05)
    plan = app.get("/v1/plan").json()
    assert plan["epoch"] > epoch  # the periodic replan takes it in
    assert any(o["object"].get("session") == "warm" for o in plan["operations"])
