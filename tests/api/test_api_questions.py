"""What-if, Pareto and explain: answers about the live state that never change it."""

from __future__ import annotations

import hashlib
import itertools

from api_helpers import assert_problem, request


def fingerprint(app) -> str:
    parts = [
        app.get(p).text for p in ("/v1/srv", "/v1/sessions", "/v1/plan", "/v1/operations", "/v1/cluster", "/v1/models")
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


CHANGES = [
    {"type": "add_gpu", "node": "n1", "gpu": {"id": "n1-extra", "type": "l40"}},
    {"type": "remove_gpu", "gpu": "n2-g0"},
    {"type": "add_node", "node": {"id": "n5", "gpus": [{"id": "n5-g0", "type": "a100-40gb-pcie"}]}},
    {"type": "remove_node", "node": "n3"},
    {"type": "add_model", "model": {"id": "extra", "preset": "qwen2.5-7b-instruct"}},
    {"type": "remove_model", "model": "vision"},
    {"type": "add_sessions", "model": "reasoner", "count": 5, "slo": "blocking", "context_tokens": 30000},
    {"type": "set_slo", "session": "s02", "slo": "blocking"},
]


def places(plan) -> set[str]:
    """The GPUs and nodes a plan's placement uses."""
    return {e["location"].get("gpu") or e["location"]["node"] for e in plan["placement"]}


def models(plan) -> set[str]:
    return {e["object"]["model"] for e in plan["placement"]}


def kv_sessions(plan, model: str) -> set[str]:
    return {
        e["object"]["session"]
        for e in plan["placement"]
        if e["object"]["kind"] == "kv" and e["object"]["model"] == model
    }


N3 = {"n3", "n3-g0", "n3-g1", "n3-g2", "n3-g3"}
ADDED = {f"whatif-{i}" for i in range(5)}  # the ids add_sessions gives its sessions
# what each change must do to the plan (set_slo changes weights, not where things go; a fifth L40 on n1 may go
# unused, as vLLM runs none of the demo's models on 5 or 3 cards: test_whatif_a_gpu_added_serves_... below)
EFFECTS = {
    "add_gpu": lambda plan: True,
    "remove_gpu": lambda plan: "n2-g0" not in places(plan),
    "add_node": lambda plan: "n5" in places(plan),
    "remove_node": lambda plan: not places(plan) & N3,
    "add_model": lambda plan: "extra" in models(plan),
    "remove_model": lambda plan: "vision" not in models(plan),
    "add_sessions": lambda plan: ADDED <= kv_sessions(plan, "reasoner"),
    "set_slo": lambda plan: True,
}


def test_whatif_answers_without_touching_live_state(demo):
    demo.events(request("e1", "a", "coder", input_tokens=2000))
    live = demo.get("/v1/plan").json()
    before = fingerprint(demo)
    for change in CHANGES:
        if change["type"] not in ("set_slo", "add_gpu"):  # the live plan does not already show the change
            assert not EFFECTS[change["type"]](live), change
        out = demo.post("/v1/whatif", json={"changes": [change]})
        assert out.status_code == 200, (change, out.text)
        body = out.json()
        assert (body["changes"], body["based_on_epoch"]) == (1, live["epoch"])
        assert body["baseline_predicted"] == live["predicted"]  # compared with the plan in force
        assert body["predicted"] == body["plan"]["predicted"] and body["plan"]["unserved"] == []
        assert EFFECTS[change["type"]](body["plan"]), change
    combined = demo.post("/v1/whatif", json={"changes": CHANGES}).json()
    assert combined["changes"] == len(CHANGES)
    for kind in ("remove_gpu", "remove_node", "remove_model", "add_model", "add_sessions"):
        assert EFFECTS[kind](combined["plan"]), kind
    assert fingerprint(demo) == before


def test_whatif_more_sessions_than_fit_is_partial(make_app):
    app = make_app(tiny=True)
    out = app.post(
        "/v1/whatif",
        json={"changes": [{"type": "add_sessions", "model": "beta", "count": 8, "context_tokens": 300_000}]},
    ).json()
    assert out["plan"]["status"] == "partial" and out["plan"]["unserved"]


def test_whatif_rejects_bad_changes_naming_the_field(demo):
    assert_problem(
        demo.post(
            "/v1/whatif", json={"changes": [{"type": "add_gpu", "node": "n9", "gpu": {"id": "x", "type": "l40"}}]}
        ),
        422,
        "changes[0].node",
        "n9",
    )
    assert_problem(
        demo.post("/v1/whatif", json={"changes": [{"type": "set_slo", "session": "zz", "slo": "blocking"}]}),
        422,
        "changes[0].session",
    )
    assert_problem(demo.post("/v1/whatif", json={"changes": [{"type": "explode"}]}), 422, "changes.0")
    assert_problem(demo.post("/v1/whatif", json={"changes": [], "solver": "magic"}), 422, "solver")


def test_whatif_adding_what_exists_is_a_422_naming_the_field(demo):
    """A GPU id is unique across the cluster (on another node too), as are node and model ids."""
    cases = [
        ({"type": "add_gpu", "node": "n1", "gpu": {"id": "n1-g0", "type": "l40"}}, "changes.1.gpu.id", "on node 'n1'"),
        ({"type": "add_gpu", "node": "n1", "gpu": {"id": "n2-g0", "type": "l40"}}, "changes.1.gpu.id", "on node 'n2'"),
        (
            {
                "type": "add_node",
                "node": {"id": "n9", "gpus": [{"id": "n9-g0", "type": "l40"}, {"id": "n3-g1", "type": "l40"}]},
            },
            "changes.1.node.gpus.1.id",
            "'n3-g1' exists already",
        ),
        ({"type": "add_node", "node": {"id": "n2", "gpus": []}}, "changes.1.node.id", "'n2' exists already"),
        (
            {"type": "add_model", "model": {"id": "planner", "preset": "qwen2.5-7b-instruct"}},
            "changes.1.model.id",
            "'planner' exists already",
        ),
    ]
    first = {"type": "set_slo", "session": "s02", "slo": "blocking"}
    for change, field, needle in cases:
        body = assert_problem(demo.post("/v1/whatif", json={"changes": [first, change]}), 422, needle)
        assert body["field"] == field and body["errors"][0]["field"] == field, body


def test_whatif_milp_answers_or_says_it_is_missing(make_app):
    app = make_app(tiny=True)
    out = app.post("/v1/whatif", json={"changes": [], "solver": "milp", "time_limit_seconds": 5})
    if out.status_code == 501:
        assert_problem(out, 501, "milp")
    else:
        assert out.status_code == 200, out.text
        assert out.json()["solver"] == "milp"


def test_pareto_curve(demo):
    body = demo.get("/v1/pareto").json()
    points, frontier = body["points"], body["frontier"]
    assert len(points) >= 5 and frontier
    assert all(p["gpu_bytes"] >= 0 and p["switch_latency_p95_seconds"] >= 0 for p in points)
    for a, b in itertools.pairwise(frontier):  # more warm bytes buy a lower P95
        assert b["gpu_bytes"] > a["gpu_bytes"] and b["switch_latency_p95_seconds"] < a["switch_latency_p95_seconds"]


def test_explain_model_and_session(demo):
    body = demo.get("/v1/explain", params={"model": "coder"}).json()
    kinds = {(o["object"]["kind"], o["object"].get("precision")) for o in body["objects"]}
    assert ("weights", "bf16") in kinds and ("weights", "int4") in kinds and ("kv", None) in kinds
    assert all(o["why"] for o in body["objects"])
    assert body["active_sessions"] == {"coder": ["s01"]} and body["predicted_requests"]["coder"] > 0
    off = demo.get("/v1/explain", params={"model": "longctx"}).json()
    assert off["objects"]
    for o in off["objects"]:  # each says how much of it the plan keeps on GPU, or that it keeps it off
        on_gpu = sum(p["bytes"] for p in o["planned"] if p["location"]["tier"] == "gpu")
        if on_gpu:
            assert o["why"].startswith(f"{on_gpu / 2**30:.2f} of {o['size_bytes'] / 2**30:.2f} GiB on GPU in the plan")
        else:
            assert o["why"].startswith("kept off GPU"), o["why"]
        assert f"{off['predicted_requests']['longctx']:.2f} predicted requests" in o["why"]
    moe = demo.get("/v1/explain", params={"model": "reasoner"}).json()
    assert any(o["object"]["kind"] == "experts" and o["operations"] for o in moe["objects"])
    session = demo.get("/v1/explain", params={"session": "s03"}).json()
    assert session["session_model"] == "reasoner" and any(o["object"]["kind"] == "kv" for o in session["objects"])
    assert_problem(demo.get("/v1/explain", params={"model": "gpt-9"}), 404, "coder")
    assert_problem(demo.get("/v1/explain"), 422, "model", "session")
    assert_problem(demo.get("/v1/explain", params={"session": "nope"}), 404, "nope")


def test_whatif_with_the_search_solver_is_never_worse_than_the_greedy(demo):
    changes = [{"type": "add_sessions", "model": "reasoner", "count": 5, "slo": "interactive", "context_tokens": 30000}]
    greedy = demo.post("/v1/whatif", json={"changes": changes, "solver": "greedy"}).json()
    searched = demo.post("/v1/whatif", json={"changes": changes, "solver": "search"}).json()
    assert searched["solver"] == "search"
    assert searched["plan"]["objective"] <= greedy["plan"]["objective"] + 1e-6


def test_whatif_a_gpu_added_serves_the_model_that_did_not_fit(make_app):
    """Two one-card nodes, three models each wanting a card of its own: with a third card, all three are served."""
    app = make_app(tiny=True)
    gamma = {"id": "gamma", "weights_bytes": {"bf16": 12 * 2**30}, "kv_bytes_per_token": 131072}
    wanted = [{"type": "add_model", "model": gamma}] + [
        {"type": "add_sessions", "model": m, "count": 1, "slo": "blocking", "context_tokens": 1000}
        for m in ("alpha", "beta", "gamma")
    ]
    without = app.post("/v1/whatif", json={"changes": wanted}).json()["plan"]
    add = {"type": "add_gpu", "node": "n1", "gpu": {"id": "n1-g1", "type": "rtx-4090"}}
    with_gpu = app.post("/v1/whatif", json={"changes": [add, *wanted]}).json()["plan"]
    assert without["unserved"] and "n1-g1" not in places(without)
    assert with_gpu["unserved"] == [] and "n1-g1" in places(with_gpu)
