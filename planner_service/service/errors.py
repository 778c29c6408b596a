"""Errors the service raises; the API maps each class to one HTTP status, once."""

from __future__ import annotations


class ServiceError(Exception):
    """Base: `message` says what is wrong and, where it helps, what to do."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidInput(ServiceError):
    """The request is well-formed but refers to something that does not exist or cannot hold (422)."""


class NotFound(ServiceError):
    """The resource in the path does not exist (404)."""


class Conflict(ServiceError):
    """The request clashes with the resource's state, e.g. a report for a superseded lease (409)."""


class Forbidden(ServiceError):
    """The caller's token does not reach this resource (403)."""


class SolverUnavailable(ServiceError):
    """The requested solver is not installed in this build (501)."""


class NotReady(ServiceError):
    """The service has not finished starting (503)."""
