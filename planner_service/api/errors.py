"""Every error leaves the API as `application/problem+json` (RFC 9457), mapped here once.

A problem names the field it is about (`field`, and `errors[]` for
validation failures) so a person can act on it; nothing leaks a traceback.
Field paths point into the request as the caller wrote it: FastAPI's
transport prefix (`body`, `query`, `path`) and the names pydantic gives the
members of a union (`events.0.request.model`) are left out, because the
caller never wrote them.

`ERROR_RESPONSES` and `OPEN_ERROR_RESPONSES` describe these answers in the
OpenAPI document; `app.py` applies them to every router at once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

from planner_service.service.errors import (
    Conflict,
    Forbidden,
    InvalidInput,
    NotFound,
    NotReady,
    ServiceError,
    SolverUnavailable,
)
from planner_service.wire.problem import PROBLEM_JSON, WHOLE_BODY, FieldError, Problem

log = logging.getLogger(__name__)

__all__ = [
    "ERROR_RESPONSES",
    "OPEN_ERROR_RESPONSES",
    "PROBLEM_JSON",
    "Unauthorized",
    "add_problem_schemas",
    "install_error_handlers",
    "problem",
]

# one title per status: what a caller can switch on besides the status itself
TITLES: dict[int, str] = {
    400: "Malformed request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not found",
    405: "Method not allowed",
    409: "Conflict",
    413: "Content too large",
    422: "Invalid input",
    500: "Internal error",
    501: "Solver not available",
    503: "Not ready",
}

_STATUS: dict[type[ServiceError], int] = {
    InvalidInput: 422,
    NotFound: 404,
    Conflict: 409,
    Forbidden: 403,
    SolverUnavailable: 501,
    NotReady: 503,
}

_TRANSPORT = frozenset({"body", "query", "path", "header", "cookie"})  # FastAPI's first `loc` element
_MAX_DETAILED = 10  # field errors spelled out in `detail`; `errors` lists them all


class Unauthorized(Exception):
    """No bearer token, or one the service does not know (401)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def title_of(status: int) -> str:
    return TITLES.get(status) or HTTPStatus(status).phrase


def problem(
    status: int,
    title: str,
    detail: str,
    *,
    field: str | None = None,
    errors: Sequence[FieldError] = (),
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """The answer for one problem; `field` defaults to the first of `errors`."""
    if field is None and errors:
        field = errors[0].field
    body = Problem(title=title, status=status, detail=detail, field=field, errors=list(errors))
    all_headers = dict(headers or {})
    if status == 401:
        all_headers.setdefault("WWW-Authenticate", "Bearer")
    return JSONResponse(body.model_dump(mode="json"), status_code=status, media_type=PROBLEM_JSON, headers=all_headers)


def _child(node: Any, part: str | int) -> tuple[bool, Any]:
    """Whether the request value `node` holds `part` (a key of an object, an index of an array), and what."""
    if isinstance(node, dict) and isinstance(part, str) and part in node:
        return True, node[part]
    if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
        return True, node[part]
    return False, None


def field_path(loc: Sequence[str | int], body: Any = None, *, missing: bool = False) -> str:
    """The dotted path of a pydantic error location in the request the caller sent.

    FastAPI puts the transport first (`body`, `query`); pydantic puts the tag
    of a union member into the location (`events.0.request.model`, `x.int`).
    Walking the body alongside tells them apart: a part is kept when the
    request holds it, and a part the request lacks is kept only as the last
    one of a `missing` error (the field that should be there).
    """
    parts = list(loc)
    if parts and parts[0] in _TRANSPORT:
        source = str(parts.pop(0))
        if source != "body":
            return ".".join(str(p) for p in parts) or source  # a query, path or header parameter by name
    node, path = body, []
    for i, part in enumerate(parts):
        held, child = _child(node, part)
        if held:
            node = child
        elif not (missing and i == len(parts) - 1 and isinstance(node, dict)):
            continue  # a union member's name: not in the request, so not in its path
        path.append(str(part))
    return ".".join(path) or WHOLE_BODY


def _field_errors(error: RequestValidationError) -> list[FieldError]:
    found = []
    for e in error.errors():
        path = field_path(tuple(e["loc"]), error.body, missing=e["type"] == "missing")
        discriminator = str((e.get("ctx") or {}).get("discriminator", "")).strip("'")
        if e["type"] in ("union_tag_invalid", "union_tag_not_found") and discriminator.isidentifier():
            path = discriminator if path == WHOLE_BODY else f"{path}.{discriminator}"  # the tag field itself
        found.append(FieldError(field=path, message=e["msg"]))
    return list({(f.field, f.message): f for f in found}.values())  # union members can repeat an error


def _malformed_json(error: RequestValidationError) -> JSONResponse | None:
    """400 with where and what, when the body is not JSON at all (FastAPI reports it as a validation error)."""
    decode = next((e for e in error.errors() if e["type"] == "json_invalid"), None)
    if decode is None:
        return None
    position = decode["loc"][-1] if isinstance(decode["loc"][-1], int) else 0
    text = error.body if isinstance(error.body, str) else ""
    line = text.count("\n", 0, position) + 1
    column = position - (text.rfind("\n", 0, position) + 1) + 1
    reason = (decode.get("ctx") or {}).get("error") or decode["msg"]
    message = f"{reason} at line {line}, column {column} (character {position})"
    detail = f"the body is not valid JSON: {message}"
    return problem(400, title_of(400), detail, errors=[FieldError(field=WHOLE_BODY, message=message)])


async def _validation_error(_: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    malformed = _malformed_json(error)
    if malformed is not None:
        return malformed
    errors = _field_errors(error)
    detail = "; ".join(f"{e.field}: {e.message}" for e in errors[:_MAX_DETAILED])
    if len(errors) > _MAX_DETAILED:
        detail += f"; and {len(errors) - _MAX_DETAILED} more"
    return problem(422, title_of(422), detail or "the request is invalid", errors=errors)


async def _service_error(_: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, ServiceError)
    status = next((s for cls, s in _STATUS.items() if isinstance(error, cls)), 400)
    errors = [FieldError(field=error.field, message=error.message)] if error.field else []
    return problem(status, title_of(status), error.message, errors=errors)


def _allowed_methods(request: Request) -> str | None:
    """Every method the path answers to, over all its operations (starlette names only the first route's)."""
    app = request.app
    if not isinstance(app, FastAPI):
        return None
    path = request.url.path.removeprefix(request.scope.get("root_path", "")) or "/"
    methods: set[str] = set()
    for template, operations in app.openapi().get("paths", {}).items():
        if compile_path(template)[0].fullmatch(path):
            methods |= {m.upper() for m in operations}
    return ", ".join(sorted(methods)) or None


async def _http_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, StarletteHTTPException)
    status = error.status_code
    headers = dict(error.headers or {})
    if status == 405:
        headers["Allow"] = _allowed_methods(request) or headers.get("Allow", "")
    detail = str(error.detail)
    if status == 405:
        detail = f"{request.method} is not allowed on {request.url.path}; allowed: {headers.get('Allow', 'none')}"
    elif status == 404 and detail == HTTPStatus.NOT_FOUND.phrase:
        detail = f"no route {request.url.path}; GET /docs lists them"
    return problem(status, title_of(status), detail, headers=headers)


async def _unauthorized(_: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, Unauthorized)
    return problem(401, title_of(401), error.message)


async def _unexpected(request: Request, error: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=error)
    return problem(500, title_of(500), "the service hit an unexpected error; it is logged")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Unauthorized, _unauthorized)
    app.add_exception_handler(Exception, _unexpected)


# -- the OpenAPI side ---------------------------------------------------------------------------------------------

_PROBLEM_REF = {"$ref": "#/components/schemas/Problem"}


def _documented(status: int, when: str) -> dict[str, Any]:
    return {"description": f"{title_of(status)}: {when}", "content": {PROBLEM_JSON: {"schema": _PROBLEM_REF}}}


# what an operation of the API may answer besides its success (`responses=` of every /v1 router)
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _documented(400, "the body is not JSON, or cannot be read; `detail` says where."),
    401: _documented(401, "no bearer token, or one the service does not know (when tokens are configured)."),
    403: _documented(403, "the token does not reach this resource: a node's token reaches only its own node."),
    404: _documented(404, "the node, operation, session or model named in the request does not exist."),
    405: _documented(405, "the path does not answer to this method; the `Allow` header lists the ones it does."),
    409: _documented(409, "the request clashes with the resource's state (another lease, an operation already done)."),
    422: _documented(422, "the request is well-formed JSON but invalid; `field` and `errors[]` name each field."),
    500: _documented(500, "the service hit an unexpected error; it is logged."),
    501: _documented(501, "the requested solver is not installed in this build."),
    503: _documented(503, "the service is still starting, or its state no longer matches its database."),
}
# what the open endpoints (health, metrics) may answer besides their success
OPEN_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {s: ERROR_RESPONSES[s] for s in (405, 500, 503)}


def add_problem_schemas(openapi: dict[str, Any]) -> dict[str, Any]:
    """Add `Problem` to the document's components, and give it to any error answer a route described without one."""
    schemas = openapi.setdefault("components", {}).setdefault("schemas", {})
    problem_schema = Problem.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
    schemas.update(problem_schema.pop("$defs", {}))
    schemas["Problem"] = problem_schema
    for operations in openapi.get("paths", {}).values():
        for operation in operations.values():
            for status, response in operation.get("responses", {}).items():
                if status[:1] in ("4", "5") and not response.get("content"):
                    response["content"] = {PROBLEM_JSON: {"schema": _PROBLEM_REF}}
    return openapi
