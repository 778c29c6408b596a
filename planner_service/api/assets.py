"""The files the service serves itself under `/static`: the status page's stylesheet and icon, and the
Swagger UI and ReDoc bundles that the `fastapi-offline` distribution ships, so that `/`, `/docs` and
`/redoc` need nothing beyond this service (an air-gapped cluster reaches no CDN)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

STATIC_PATH = "/static"
# looked up in this order: a name of ours wins over a file of the docs bundle
STATIC_PACKAGES: list[str | tuple[str, str]] = [("planner_service.api", "static"), ("fastapi_offline", "static")]


def mount_static(app: FastAPI) -> None:
    app.mount(STATIC_PATH, StaticFiles(packages=STATIC_PACKAGES), name="static")


def static_url(root_path: str, name: str) -> str:
    """The URL of a packaged file, under the prefix a proxy serves the app at (ASGI `root_path`)."""
    return f"{root_path}{STATIC_PATH}/{name}"
