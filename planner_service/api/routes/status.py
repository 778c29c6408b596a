"""`/`: the status page, an HTML picture of the cluster for people (`status_page.py` computes it).

It is an operator read like `GET /v1/cluster`: with tokens configured it needs an operator token in
the `Authorization` header (an auth proxy in front of the service can add it), and it is open when no
tokens are configured. The token is never accepted from a cookie or the query string, so it cannot land
in an access log or a browser's history. The page holds no script: it reloads itself every
`REFRESH_SECONDS` with a `<meta http-equiv="refresh">`, and its Content-Security-Policy lets the browser
load nothing but the service's own stylesheet and icon.
"""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from planner_service.api.assets import STATIC_PATH
from planner_service.api.deps import OperatorDep, ServiceDep
from planner_service.api.status_page import build_page, seconds, size
from planner_service.service.errors import NotFound
from planner_service.wire.cluster import ClusterOut, ModelOut
from planner_service.wire.engines import EngineOut
from planner_service.wire.enums import OperationState
from planner_service.wire.operations import OperationRecord
from planner_service.wire.plan import CurrentPlanOut
from planner_service.wire.sessions import SessionOut
from planner_service.wire.state import SrvOut

REFRESH_SECONDS = 5
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; style-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

router = APIRouter(include_in_schema=False)


@functools.cache
def templates() -> Environment:
    """The page's templates, from the package's data (built once, on the first page served)."""
    env = Environment(
        loader=PackageLoader("planner_service.api", "templates"),
        autoescape=select_autoescape(default=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["size"] = size
    env.filters["seconds"] = seconds
    return env


@router.get("/", response_class=HTMLResponse)
def status_page(request: Request, service: ServiceDep, _: OperatorDep) -> HTMLResponse:
    """The cluster, the queues, the plan's prediction, recent operations and sessions, as one page."""
    try:
        plan = CurrentPlanOut.model_validate(service.plan_view())
    except NotFound:  # no plan yet: the page says so
        plan = None
    finished = [
        *service.operations_view(state=OperationState.DONE),
        *service.operations_view(state=OperationState.FAILED),
    ]
    page = build_page(
        cluster=ClusterOut.model_validate(service.cluster_view()),
        srv=SrvOut.model_validate(service.srv_view()),
        plan=plan,
        open_ops=[OperationRecord.model_validate(r) for r in service.operations_view()],
        finished_ops=[OperationRecord.model_validate(r) for r in finished],
        sessions=[SessionOut.model_validate(s) for s in service.sessions_view()],
        models=[ModelOut.model_validate(m) for m in service.models_view()],
        engines=[EngineOut.model_validate(e) for e in service.engines_view()],
    )
    html = (
        templates()
        .get_template("status.html")
        .render(
            page=page,
            refresh_seconds=REFRESH_SECONDS,
            static=f"{request.scope.get('root_path', '')}{STATIC_PATH}",
        )
    )
    headers = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "Cache-Control": "no-store"}
    return HTMLResponse(html, headers=headers)
