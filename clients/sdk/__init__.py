"""Python SDK of the StateBudget API: `StateBudgetClient`, `AsyncStateBudgetClient`, typed errors, event helpers."""

from clients.sdk import events
from clients.sdk._core import KEEPALIVE_EXPIRY_SECONDS, RetryPolicy, log_retries
from clients.sdk.client import AsyncStateBudgetClient, StateBudgetClient
from clients.sdk.errors import (
    APIError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    ConnectionError,
    NotFoundError,
    PermissionDeniedError,
    ServerError,
    StateBudgetError,
    UnexpectedStatusError,
)

__all__ = [
    "KEEPALIVE_EXPIRY_SECONDS",
    "APIError",
    "AsyncStateBudgetClient",
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "ConnectionError",
    "NotFoundError",
    "PermissionDeniedError",
    "RetryPolicy",
    "ServerError",
    "StateBudgetClient",
    "StateBudgetError",
    "UnexpectedStatusError",
    "events",
    "log_retries",
]
