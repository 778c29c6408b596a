"""The status page at `/` and the offline API docs at `/docs` and `/redoc`, through the in-process app."""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
from api_helpers import NODE1, OPERATOR, assert_problem, request

from planner_service.api.status_page import build_page, seconds, size
from planner_service.wire.cluster import ClusterOut, ModelOut
from planner_service.wire.enums import Kind, Tier
from planner_service.wire.operations import OperationRecord
from planner_service.wire.plan import CurrentPlanOut
from planner_service.wire.sessions import SessionOut
from planner_service.wire.state import SrvOut, StateObject


def page(app, headers=None) -> str:
    response = app.get("/", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/html")
    return response.text


def node_card(html: str, node: str) -> str:
    start = html.index(f'<article class="node" id="node-{node}">')
    return html[start : html.index("</article>", start)]


def table_row(html: str, section: str, first_cell: str) -> str:
    body = html[html.index(f'id="{section}"') :]
    body = body[: body.index("</table>")]
    for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body, flags=re.DOTALL):
        if re.search(rf"<td[^>]*>(<b>)?{re.escape(first_cell)}(</b>)?</td>", row):
            return row
    raise AssertionError(f"no row {first_cell!r} in {section}")


def views(app):
    """The views the page is built from, as the API answers them."""
    service = app.client.app.state.service
    return {
        "cluster": ClusterOut.model_validate(service.cluster_view()),
        "srv": SrvOut.model_validate(service.srv_view()),
        "plan": CurrentPlanOut.model_validate(service.plan_view()),
        "open_ops": [OperationRecord.model_validate(r) for r in service.operations_view()],
        "finished_ops": [
            OperationRecord.model_validate(r)
            for state in ("done", "failed")
            for r in service.operations_view(state=state)
        ],
        "sessions": [SessionOut.model_validate(s) for s in service.sessions_view()],
        "models": [ModelOut.model_validate(m) for m in service.models_view()],
    }


def test_the_page_shows_the_demos_nodes_gpus_models_and_sessions(demo):
    html = page(demo)
    cluster = demo.get("/v1/cluster").json()
    assert [n["id"] for n in cluster["nodes"]] == ["n1", "n2", "n3", "n4"]
    for node in cluster["nodes"]:
        card = node_card(html, node["id"])
        for gpu in node["gpus"]:
            assert f'id="gpu-{gpu["id"]}"' in card and gpu["type"] in card
            assert f"{size(gpu['used_bytes'])} / {size(gpu['capacity_bytes'])}" in card
    models = [m["id"] for m in demo.get("/v1/models").json()]
    legend = html[html.index('<ul class="legend"') : html.index("</ul>")]
    for model in models:
        assert f"{model}" in legend
    for s in demo.get("/v1/sessions").json():
        row = table_row(html, "sessions-h", s["id"])
        assert s["user"] in row and s["model"] in row
    p95 = demo.get("/v1/plan").json()["predicted"]["switch_latency_p95_seconds"]
    assert seconds(p95) in html


def test_each_node_card_lists_its_engine_instances_with_their_state_and_what_the_plan_does(demo):
    html = page(demo)
    engines = demo.get("/v1/engines").json()
    assert engines  # the demo runs vLLM on every node
    for e in engines:
        card = node_card(html, e["node"])
        row = re.search(rf'<tr class="engine" id="engine-{e["node"]}-{re.escape(e["model"])}">(.*?)</tr>', card)
        assert row is not None, (e["node"], e["model"])
        assert f"<td>{e['state']}</td>" in row.group(1) and e["kind"] in row.group(1)
        calls = " then ".join(e["planned_steps"]) or e["planned_step"]
        if calls is not None:
            assert f"→ {e['planned_state']} ({calls})" in row.group(1)


def test_the_page_is_a_self_contained_self_refreshing_document(demo):
    response = demo.get("/")
    html = response.text
    assert '<meta http-equiv="refresh" content="5">' in html
    assert "<script" not in html
    # everything it loads is the service's own: nothing absolute, and the browser is told to load nothing else
    links = re.findall(r'(?:href|src)="([^"#]+)"', html)
    assert links and all(not re.match(r"[a-z]+:|//", link) for link in links), links
    csp = response.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "style-src 'self'" in csp
    assert response.headers["cache-control"] == "no-store"
    for link in re.findall(r'(?:href|src)="(/static/[^"]+)"', html):
        asset = demo.get(link)
        assert asset.status_code == 200 and asset.content, link


def test_each_gpu_bar_is_split_by_model_and_kind_and_adds_up_to_its_used_bytes(demo):
    v = views(demo)
    built = build_page(**v)
    held: dict[str, dict[tuple[str, Kind], int]] = defaultdict(lambda: defaultdict(int))
    for e in v["srv"].placement:
        if e.location.tier is Tier.GPU:
            held[e.location.id][(e.object.model, e.object.kind)] += e.bytes
    by_id = {g.id: g for n in v["cluster"].nodes for g in n.gpus}
    gpus = [g for n in built.nodes for g in n.gpus]
    assert {g.id for g in gpus} == set(by_id)
    kinds_seen = set()
    for g in gpus:
        assert g.now.used_bytes == by_id[g.id].used_bytes
        assert g.plan is not None and g.plan.used_bytes == by_id[g.id].planned_bytes
        assert {(s.model, s.state): s.bytes for s in g.now.segments} == dict(held[g.id])
        assert g.now.total_bytes == by_id[g.id].capacity_bytes + by_id[g.id].reserved_bytes
        if g.now.segments:
            assert g.now.segments[-1].x + g.now.segments[-1].width <= g.now.reserved_x + 1e-9
        kinds_seen |= {s.state for s in g.now.segments + g.plan.segments}
    assert kinds_seen == {Kind.WEIGHTS, Kind.KV, Kind.EXPERTS}  # the demo holds all three on GPUs
    # and the HTML draws them: one rect per segment, named in its tooltip
    html = page(demo)
    card = node_card(html, "n2")
    gpu = next(g for g in gpus if g.id == "n2-g0")
    for s in gpu.now.segments:
        assert f"<title>{s.model} {s.state.value}: {size(s.bytes)}</title>" in card


def test_queues_and_recent_operations_follow_leases_and_reports(demo):
    lease = demo.lease("n1", n=3).json()
    ops = lease["operations"]
    assert len(ops) >= 3  # and the rest of an engine step's moves, leased together
    done, failed, *still_leased = ops
    demo.report(done["id"], lease["lease_id"], measured_seconds=1.0, measured_bytes=done["bytes"])
    demo.report(failed["id"], lease["lease_id"], status="failed", error="engine vllm-0: CUDA out of memory")
    html = page(demo)
    open_n1 = demo.get("/v1/operations", params={"node": "n1"}).json()
    queued = sum(r["state"] == "queued" for r in open_n1)
    leased = sum(r["state"] == "leased" for r in open_n1)
    assert leased == len(still_leased)
    row = table_row(html, "queues-h", "n1")
    assert re.findall(r'<td class="n">([^<]*)</td>', row)[:3] == [str(queued), str(leased), "0"]
    assert f"{queued} queued" in node_card(html, "n1") and f"{leased} leased" in node_card(html, "n1")
    recent = table_row(html, "recent-h", failed["id"])
    assert "failed" in recent and "engine vllm-0: CUDA out of memory" in recent
    recent = table_row(html, "recent-h", done["id"])
    assert 'class="state done"' in recent and done["object"]["model"] in recent
    assert table_row(html, "recent-h", done["id"]) != table_row(html, "recent-h", failed["id"])


def test_sessions_say_what_they_wait_for(demo):
    demo.events(
        {"id": "t1", "type": "tool_call_start", "session": "s01", "tool": "pytest"},
        request("r1", "s06", "vision", input_tokens=500),
    )
    demo.post("/v1/plan")
    html = page(demo)
    assert "its tool call to return" in table_row(html, "sessions-h", "s01")
    assert "its next turn" in table_row(html, "sessions-h", "s02")  # idle in the demo
    vision_moves = [
        r
        for r in demo.get("/v1/operations").json()
        if r["action"] == "promote" and r["object"]["model"] == "vision" and r["object"].get("session") in (None, "s06")
    ]
    assert vision_moves  # the demo holds vision off GPU: its request waits for promotions
    first = min(vision_moves, key=lambda r: (r["epoch"], r["seq"]))
    row = table_row(html, "sessions-h", "s06")
    assert f"queued {StateObject.model_validate(first['object']).label()} → gpu:{first['to']['gpu']}" in row
    assert f"(+{len(vision_moves) - 1} more)" in row
    assert re.search(r'<tr class="waiting"><td><b>s06</b>', html)
    # once the node's agent has carried out every move, the request waits for nothing
    node = first["node"]
    for _ in range(20):
        lease = demo.lease(node, n=50).json()
        if not lease["operations"]:
            break
        for op in lease["operations"]:
            demo.report(
                op["id"], lease["lease_id"], measured_seconds=op["estimated_seconds"], measured_bytes=op["bytes"]
            )
    row = table_row(page(demo), "sessions-h", "s06")
    assert "nothing: vision is on" in row and first["to"]["gpu"] in row


def test_unserved_sessions_and_a_missing_plan_are_shown(demo):
    v = views(demo)
    unserved = CurrentPlanOut.model_validate(
        {
            **v["plan"].model_dump(mode="json"),
            "unserved": [{"session": "s03", "constraint": "no GPU group fits reasoner"}],
        }
    )
    built = build_page(**{**v, "plan": unserved})
    s03 = next(s for s in built.sessions if s.id == "s03")
    assert s03.waiting and s03.waits_for == "room: no GPU group fits reasoner"
    assert built.plan is not None and built.plan.unserved == ["s03: no GPU group fits reasoner"]
    without = build_page(**{**v, "plan": None})
    assert without.plan is None and all(g.plan is None for n in without.nodes for g in n.gpus)
    assert sum(g.now.used_bytes for n in without.nodes for g in n.gpus) == sum(
        g.used_bytes for n in v["cluster"].nodes for g in n.gpus
    )


def test_the_page_is_an_operator_read(make_app):
    app = make_app(auth=True)
    assert_problem(app.get("/"), 401, "Authorization")
    assert_problem(app.get("/", headers=NODE1), 403, "operator token")
    # the token is taken from the Authorization header only: never from the query string or a cookie
    assert_problem(app.get("/?token=op-token"), 401)
    app.client.cookies.set("token", "op-token")
    assert_problem(app.get("/"), 401)
    app.client.cookies.clear()
    assert "n1-g0" in page(app, headers=OPERATOR)
    # docs and their assets stay open, as /openapi.json is
    for path in ("/docs", "/redoc", "/static/status.css", "/static/swagger-ui-bundle.js"):
        assert app.get(path).status_code == 200, path


@pytest.mark.parametrize(
    ("path", "assets"),
    [
        ("/docs", ["/static/swagger-ui-bundle.js", "/static/swagger-ui.css", "/static/favicon.svg"]),
        ("/redoc", ["/static/redoc.standalone.js", "/static/favicon.svg"]),
    ],
)
def test_docs_load_their_assets_from_the_service(demo, path, assets):
    html = demo.get(path).text
    assert "/openapi.json" in html
    referenced = re.findall(r'(?:href|src)="([^"]+)"', html)
    assert sorted(referenced) == sorted(assets)  # nothing from a CDN, no web fonts
    for asset in assets:
        response = demo.get(asset)
        assert response.status_code == 200 and len(response.content) > 300, asset
    assert "fonts.googleapis.com" not in html and "cdn.jsdelivr.net" not in html


def test_the_html_pages_stay_out_of_the_openapi_document(demo):
    paths = demo.get("/openapi.json").json()["paths"]
    assert not {"/", "/docs", "/redoc"} & set(paths)
    assert not any(p.startswith("/static") for p in paths)
