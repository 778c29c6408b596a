"""Every error leaves the API as `application/problem+json` (RFC 9457), mapped here once.

A problem names the field it is about (`field`, and `errors[]` for
validation failures) so a person can act on it; nothing leaks a traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from planner_service.service.errors import (
    Conflict,
    Forbidden,
    InvalidInput,
    NotFound,
    NotReady,
    ServiceError,
    SolverUnavailable,
)

log = logging.getLogger(__name__)

PROBLEM_JSON = "application/problem+json"

_STATUS: dict[type[ServiceError], tuple[int, str]] = {
    InvalidInput: (422, "Invalid input"),
    NotFound: (404, "Not found"),
    Conflict: (409, "Conflict"),
    Forbidden: (403, "Forbidden"),
    SolverUnavailable: (501, "Solver not available"),
    NotReady: (503, "Not ready"),
}


class Unauthorized(Exception):
    """No bearer token, or one the service does not know (401)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def problem(status: int, title: str, detail: str, **extra: Any) -> JSONResponse:
    body = {"type": "about:blank", "title": title, "status": status, "detail": detail}
    body.update({k: v for k, v in extra.items() if v is not None})
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def _field_path(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(body)"


async def _service_error(_: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, ServiceError)
    status, title = next((v for k, v in _STATUS.items() if isinstance(error, k)), (400, "Bad request"))
    return problem(status, title, error.message, field=error.field)


async def _validation_error(_: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    errors = [{"field": _field_path(tuple(e["loc"])), "message": e["msg"]} for e in error.errors()]
    detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors[:10])
    if len(errors) > 10:
        detail += f"; and {len(errors) - 10} more"
    return problem(422, "Invalid request", detail, errors=errors)


async def _http_error(_: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, StarletteHTTPException)
    return problem(error.status_code, str(error.detail), str(error.detail))


async def _unauthorized(_: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, Unauthorized)
    return problem(401, "Unauthorized", error.message)


async def _unexpected(request: Request, error: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=error)
    return problem(500, "Internal error", "the service hit an unexpected error; it is logged")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Unauthorized, _unauthorized)
    app.add_exception_handler(Exception, _unexpected)
