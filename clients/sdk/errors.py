"""Every failure of a StateBudget call, mapped once from the HTTP answer (as openai-python's `_exceptions.py`).

The service answers every error as `application/problem+json` (RFC 9457), one
shape (`planner_service.wire.problem.Problem`): `title`, `detail`, and for
input problems the first offending `field` and `errors[]`, one per field, with
paths into the request as the caller wrote it (`events.0.model`).
`error_from_response` turns such an answer into one typed exception (an answer
that is not a problem, from a proxy say, still maps by its status); transport
failures become `ConnectionError`. Nothing else in the SDK looks at status codes.
"""

from __future__ import annotations

import builtins
from typing import Any

import httpx
from pydantic import ValidationError

from planner_service.wire.problem import FieldError, Problem

__all__ = [
    "APIError",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "ConnectionError",
    "FieldError",
    "NotFoundError",
    "PermissionDeniedError",
    "Problem",
    "ServerError",
    "StateBudgetError",
    "UnexpectedStatusError",
    "error_from_response",
]


class StateBudgetError(Exception):
    """Base of every error the SDK raises."""


class ConnectionError(StateBudgetError, builtins.ConnectionError):
    """The request never got an HTTP answer (refused, reset, timed out, DNS)."""

    def __init__(self, message: str, *, method: str = "", url: str = "") -> None:
        super().__init__(message)
        self.message, self.method, self.url = message, method, url


class APIError(StateBudgetError):
    """The service answered with an error status; `title`/`detail`/`field`/`errors` come from its problem body.

    `problem` is that body, typed, when the answer was one (None for a proxy's HTML page, say).
    """

    def __init__(
        self,
        status: int,
        title: str,
        detail: str,
        *,
        field: str | None = None,
        errors: list[FieldError] | None = None,
        problem: Problem | None = None,
        body: Any = None,
        method: str = "",
        url: str = "",
    ) -> None:
        where = f" ({field})" if field else ""
        super().__init__(f"{status} {title}: {detail}{where}")
        self.status, self.title, self.detail, self.field = status, title, detail, field
        self.errors = errors or []
        self.problem = problem
        self.body, self.method, self.url = body, method, url


class BadRequestError(APIError):
    """400 or 422: the request is malformed or refers to something that cannot hold; `field` names it."""


class AuthenticationError(APIError):
    """401: no bearer token, or one the service does not know."""


class PermissionDeniedError(APIError):
    """403: the token does not reach this resource (e.g. a node token on another node's queue)."""


class NotFoundError(APIError):
    """404: the resource in the path does not exist."""


class ConflictError(APIError):
    """409: the request clashes with the resource's state (a foreign or expired lease, a superseded operation)."""


class ServerError(APIError):
    """5xx: the service failed or is not ready (503); retried for idempotent calls."""


class UnexpectedStatusError(APIError):
    """Any other error status (405, 413, ...)."""


_BY_STATUS: dict[int, type[APIError]] = {
    400: BadRequestError,
    422: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
}


def _problem(body: Any) -> Problem | None:
    """The body as a `Problem`, ignoring members this SDK does not know (RFC 9457 §3.2); None if it is not one."""
    if not isinstance(body, dict):
        return None
    try:
        return Problem.model_validate({k: v for k, v in body.items() if k in Problem.model_fields})
    except ValidationError:
        return None


def error_from_response(response: httpx.Response) -> APIError:
    """The typed exception for an error answer (a problem, other JSON or text alike)."""
    status = response.status_code
    cls = _BY_STATUS.get(status) or (ServerError if status >= 500 else UnexpectedStatusError)
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    problem = _problem(body)
    if problem is not None:
        title, detail, field, errors = problem.title, problem.detail, problem.field, problem.errors
    else:
        title = response.reason_phrase or "Error"
        detail = body if isinstance(body, str) and body else title
        field, errors = None, []
    request = response.request
    return cls(
        status,
        title,
        detail,
        field=field or (errors[0].field if errors else None),
        errors=errors,
        problem=problem,
        body=body,
        method=request.method,
        url=str(request.url),
    )
