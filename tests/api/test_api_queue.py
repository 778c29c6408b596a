"""Plans, leases, reports: priorities, dependencies, expiry, epochs, idempotency, the SRV version."""

from __future__ import annotations

import json
import threading

import pytest
from api_helpers import assert_problem, request
from support import CallLog, after_last

from planner_service.service import loop as planning_loop


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
    # nothing moved: epoch 2 repeats every queued move of epoch 1, and adopts those records instead of copies
    assert [op["id"] for op in replanned["operations"]] == [op["id"] for op in plan["operations"]]
    records = {o["id"]: o for o in demo.get("/v1/operations").json()}
    assert all(records[op["id"]]["epoch"] == 2 for op in replanned["operations"])
    assert demo.get("/v1/operations", params={"state": "superseded"}).json() == []
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


def test_new_epoch_supersedes_the_unleased_operations_it_does_not_repeat(demo):
    lease = demo.lease("n1", 1).json()
    leased = lease["operations"][0]
    queued = [o for o in demo.get("/v1/operations", params={"state": "queued"}).json()]
    assert any(o["object"].get("session") == "s03" for o in queued)  # the demo plans s03's KV
    demo.events({"id": "end-s03", "type": "session_end", "session": "s03"})  # its KV moves are void now
    demo.post("/v1/plan")
    plan = demo.get("/v1/plan").json()
    records = {o["id"]: o for o in demo.get("/v1/operations", params={"state": "superseded"}).json()}
    records |= {o["id"]: o for o in demo.get("/v1/operations", params={"state": "queued"}).json()}
    kept = {op["id"] for op in plan["operations"]}
    # each operation queued in epoch 1 is now epoch 2's (the same move, adopted) or superseded by it
    for o in queued:
        if o["id"] in kept:
            assert (records[o["id"]]["state"], records[o["id"]]["epoch"]) == ("queued", 2)
        else:
            assert (records[o["id"]]["state"], records[o["id"]]["superseded_by"]) == ("superseded", 2)
    superseded = [o for o in queued if o["id"] not in kept]
    assert superseded and len(superseded) < len(queued)

    # a superseded move is installed again only when it waits on other operations than before
    def move(o):
        return o["action"], json.dumps(o["object"]), json.dumps(o["from"]), json.dumps(o["to"]), o["bytes"]

    waited = {move(o): set(o["depends_on"]) for o in superseded}
    before = {o["id"]: o for o in queued}
    assert not any(waited.get(move(o)) == set(o["depends_on"]) for o in plan["operations"] if o["id"] not in before)
    # a kept move keeps its record, at the plan's priority; none that served s03's request keeps a request's
    assert all(records[o["id"]]["priority"] == o["priority"] for o in plan["operations"] if o["id"] in before)
    urgent = ("blocking", "interactive")
    served = [o for o in queued if o["priority"] in urgent]
    assert served and all(o["id"] not in kept or records[o["id"]]["priority"] not in urgent for o in served)
    assert_problem(demo.report(superseded[0]["id"], lease["lease_id"]), 409, "superseded", "epoch 2")
    # the leased operation of epoch 1 is still in flight and can be reported
    assert demo.report(leased["id"], lease["lease_id"]).status_code == 200
    # the new epoch does not repeat the work in flight
    assert not any(o["object"] == leased["object"] and o["to"] == leased["to"] for o in plan["operations"])


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


def test_long_poll_waits_and_wakes_when_work_becomes_ready(make_app):
    app = make_app(tiny=True, max_wait_seconds=60.0)
    busy_tiny(app)
    lease = app.lease("n1").json()
    leases = CallLog(app.client.app.state.service, "lease")
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(body=app.lease("n1", wait=60).json()))
    thread.start()
    leases.wait_for(lambda calls: len(calls) == 1, what="the long-poll's first look at the queue")
    assert leases.calls[0][1]["operations"] == [] and thread.is_alive()  # nothing is ready: it waits
    app.report(lease["operations"][0]["id"], lease["lease_id"])
    thread.join(timeout=20)
    assert not thread.is_alive(), "the report did not wake the long-poll, which would have waited its 60 s"
    assert [o["action"] for o in result["body"]["operations"]] == ["promote", "promote"]
    assert len(leases.calls) == 2  # one look before waiting, one when the report woke it


def test_long_poll_times_out_empty(demo):
    while demo.lease("n3").json()["operations"]:
        pass  # take whatever n3 can run now; the rest waits for reports that never come
    leases = CallLog(demo.client.app.state.service, "lease")
    empty = {"lease_id": None, "expires_at": None, "expires_in_seconds": None, "operations": []}
    assert demo.lease("n3", wait=0.2).json() == empty
    assert len(leases.calls) == 2  # it looked, waited out its deadline, and looked once more
    assert demo.lease("n3", wait=0).json() == empty
    assert len(leases.calls) == 3  # without a wait it looks once


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


@pytest.fixture
def fast_ticks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planning loop goes round every 10 ms instead of every 0.5 s, so that waiting for a few of its turns
    is quick."""
    monkeypatch.setattr(planning_loop, "TICK_SECONDS", 0.01)


def _ticks_after_last_replan(calls) -> int:
    return sum(name == "tick" for name, _ in after_last(calls, "replan"))


def test_background_loop_replans_after_an_event_burst(make_app, fast_ticks):
    app = make_app(background_planning=True, replan_debounce_seconds=0.0, replan_interval_seconds=3600.0)
    service = app.client.app.state.service
    replans = CallLog(service, "replan")
    epoch = app.get("/v1/plan").json()["epoch"]
    app.events(request("e1", "fresh", "vision", slo="blocking", input_tokens=5000))  # vision serves nowhere
    replans.wait_for(lambda calls: any(r["changed"] for _, r in calls), what="a replan that installs a plan")
    plan = app.get("/v1/plan").json()
    assert plan["epoch"] == epoch + 1
    assert any(o["object"].get("session") == "fresh" for o in plan["operations"]), json.dumps(plan["operations"])[:500]


def test_an_event_burst_is_planned_at_its_first_event_and_once_more_for_the_rest(make_app, fast_ticks):
    app = make_app(background_planning=True, replan_debounce_seconds=0.5, replan_interval_seconds=3600.0)
    service = app.client.app.state.service
    log = CallLog(service, "replan", "tick")
    for i in range(5):  # vision serves nowhere: the requests call for a plan at once
        app.events(request(f"e{i}", f"burst-{i}", "vision", input_tokens=1000))
    calls = log.wait_for(
        lambda calls: any(n == "replan" for n, _ in calls) and _ticks_after_last_replan(calls) >= 3,
        what="a replan followed by three quiet turns of the planning loop",
    )
    replans = [r for n, r in calls if n == "replan"]
    # the first event is planned at once; the rest of the burst (within the window) at most once more
    assert replans[0] == {"epoch": 2, "changed": True} and len(replans) <= 2, replans
    plan = app.get("/v1/plan").json()
    assert plan["epoch"] == replans[-1]["epoch"]
    assert {f"burst-{i}" for i in range(5)} <= {o["object"].get("session") for o in plan["operations"]}


def test_a_request_for_a_warm_model_does_not_call_for_a_plan_at_once(make_app, fast_ticks):
    app = make_app(background_planning=True, replan_debounce_seconds=0.0, replan_interval_seconds=3600.0)
    service = app.client.app.state.service
    log = CallLog(service, "replan", "tick")
    epoch = app.get("/v1/plan").json()["epoch"]
    app.events(request("e1", "warm", "planner", input_tokens=1000))  # planner serves on n3 from the start
    assert not service.urgent.is_set()
    seen = len(log.calls)
    log.wait_for(lambda calls: sum(n == "tick" for n, _ in calls[seen:]) >= 3, what="three turns of the planning loop")
    assert "replan" not in log.names() and app.get("/v1/plan").json()["epoch"] == epoch  # its engine serves it
    app.events(request("e2", "cold", "vision", input_tokens=1000))  # the same loop plans at once for this one
    log.wait_for(lambda calls: any(n == "replan" for n, _ in calls), what="the replan a cold model calls for")


def test_the_periodic_replan_takes_in_requests_for_warm_models(make_app, fast_ticks):
    app = make_app(background_planning=True, replan_debounce_seconds=0.0, replan_interval_seconds=0.001)
    service = app.client.app.state.service
    epoch = app.get("/v1/plan").json()["epoch"]
    replans = CallLog(service, "replan")
    app.events(request("e1", "warm", "planner", input_tokens=1000))
    replans.wait_for(lambda calls: any(r["changed"] for _, r in calls), what="a periodic replan that installs a plan")
    plan = app.get("/v1/plan").json()
    assert plan["epoch"] > epoch
    assert any(o["object"].get("session") == "warm" for o in plan["operations"])
