"""`/docs` (Swagger UI) and `/redoc` (ReDoc) on the bundles the service serves itself (`assets.py`).

FastAPI's own pages load both from a CDN, which a cluster without internet access never reaches (a
blank page); these are the same pages pointed at `/static`. They stay open, as `/openapi.json` is:
the operations they try out still need a token, which Swagger UI's "Authorize" sends as a bearer.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse

from planner_service.api.assets import static_url

router = APIRouter(include_in_schema=False)


def _openapi_url(request: Request) -> str:
    path: str | None = request.app.openapi_url
    assert path is not None  # create_app keeps the OpenAPI document on
    return f"{request.scope.get('root_path', '')}{path}"


@router.get("/docs", response_class=HTMLResponse)
async def swagger_ui(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return get_swagger_ui_html(
        openapi_url=_openapi_url(request),
        title=f"{request.app.title} · Swagger UI",
        swagger_js_url=static_url(root, "swagger-ui-bundle.js"),
        swagger_css_url=static_url(root, "swagger-ui.css"),
        swagger_favicon_url=static_url(root, "favicon.svg"),
        # no badge from the public validator (it would send the document out), keep a token across reloads
        swagger_ui_parameters={"validatorUrl": None, "persistAuthorization": True},
    )


@router.get("/redoc", response_class=HTMLResponse)
async def redoc(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return get_redoc_html(
        openapi_url=_openapi_url(request),
        title=f"{request.app.title} · ReDoc",
        redoc_js_url=static_url(root, "redoc.standalone.js"),
        redoc_favicon_url=static_url(root, "favicon.svg"),
        with_google_fonts=False,
    )
