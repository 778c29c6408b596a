"""What the sync and async clients share: describing a call, retrying it, reading the answer.

A `Call[T]` is a plain description of one HTTP request and of the type `T` its
answer has; `clients/sdk/_calls.py` builds one per endpoint of the API. An
`Endpoint` puts a builder on both clients: on the sync client (a `SyncSender`)
the method returns `T`, on the async one (an `AsyncSender`) an awaitable of `T`,
and a type checker sees both. Neither client knows an endpoint; neither endpoint
knows the transport. Answers come back as the API's own types
(`planner_service.wire`), validated on arrival.

Retries (stamina, exponential backoff with jitter) apply only to calls that are
safe to repeat (`idempotent`), and only on transport errors and 5xx answers.
A lease is never retried: a lost answer would leave operations leased to nobody
until the lease expires.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from functools import cache, update_wrapper
from typing import Any, Generic, Literal, ParamSpec, Self, TypeVar, overload

import httpx
from pydantic import TypeAdapter
from stamina.instrumentation import RetryDetails, set_on_retry_hooks

from clients.sdk.errors import ConnectionError, ServerError, error_from_response

T = TypeVar("T")
P = ParamSpec("P")
Method = Literal["GET", "POST", "PUT", "DELETE"]
DEFAULT_TIMEOUT_SECONDS = 30.0
KEEPALIVE_EXPIRY_SECONDS = 5.0
"""How long an idle connection waits in the pool for the next request: well below the server's
`keep_alive_seconds` (30 s), so that a request never goes out on a connection the server is closing. That
race answers with a ReadError, which for a lease cannot be told from a lost answer (and so is not retried)."""
POOL_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_EXPIRY_SECONDS)
LONG_POLL_MARGIN_SECONDS = 10.0  # a lease long-poll may hold the request this much past its wait


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One request and the type of its answer: a wire model or a list of them (JSON), `str` (a text answer such
    as the metrics) or `NoneType` (no body)."""

    method: Method
    path: str
    answer: type[T]
    params: dict[str, Any] | None = None
    json: Any = None
    idempotent: bool = True
    timeout_seconds: float | None = None  # overrides the client's timeout (long polls)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently an idempotent call is retried (stamina's parameters)."""

    attempts: int = 4
    timeout_seconds: float = 60.0
    wait_initial_seconds: float = 0.2
    wait_max_seconds: float = 5.0
    wait_jitter_seconds: float = 0.5

    def stamina_kwargs(self) -> dict[str, Any]:
        return {
            "attempts": self.attempts,
            "timeout": self.timeout_seconds,
            "wait_initial": self.wait_initial_seconds,
            "wait_max": self.wait_max_seconds,
            "wait_jitter": self.wait_jitter_seconds,
        }


NO_RETRY = RetryPolicy(attempts=1)


def is_retryable(error: Exception) -> bool:
    """Transport failures and 5xx (including 503 while the service starts) may succeed on a later try."""
    return isinstance(error, ConnectionError | ServerError)


def compact(data: dict[str, Any]) -> dict[str, Any]:
    """Leave out unset fields: the service's defaults apply (and its models forbid unknown keys)."""
    return {k: v for k, v in data.items() if v is not None}


@dataclass(slots=True)
class ClientConfig:
    base_url: str
    token: str | None = None
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json, application/problem+json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def request_kwargs(self, call: Call[Any]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"headers": self.headers()}
        if call.params:
            kwargs["params"] = compact(call.params)
        if call.json is not None:
            kwargs["json"] = call.json
        if call.timeout_seconds is not None:  # long polls; other calls use the client's own timeout
            kwargs["timeout"] = call.timeout_seconds
        return kwargs


def transport_error(error: httpx.TransportError, call: Call[Any]) -> ConnectionError:
    return ConnectionError(
        f"{call.method} {call.path}: {type(error).__name__}: {error}", method=call.method, url=call.path
    )


@cache
def _adapter(answer: Any) -> TypeAdapter[Any]:
    return TypeAdapter(answer)


def parse(call: Call[T], response: httpx.Response) -> T:
    """The body of a successful answer validated as `call.answer`, or the typed error of a failed one."""
    if response.status_code >= 400:
        raise error_from_response(response)
    answer: Any = call.answer  # any type, as far as the cache's keys go
    adapter: TypeAdapter[T] = _adapter(answer)
    if call.answer is type(None):  # a 204: whatever the body, there is nothing to read
        return adapter.validate_python(None)
    if call.answer is str:
        return adapter.validate_python(response.text)
    return adapter.validate_json(response.content)


class SyncSender(ABC):
    """A transport whose endpoint methods return the answer."""

    @abstractmethod
    def _send(self, call: Call[T]) -> T: ...


class AsyncSender(ABC):
    """A transport whose endpoint methods return an awaitable of the answer."""

    @abstractmethod
    async def _send(self, call: Call[T]) -> T: ...


class Endpoint(Generic[P, T]):
    """A method of both clients, defined once by the function that builds its `Call[T]`.

    Read on a `SyncSender` it is the builder's signature returning `T`, on an `AsyncSender` the same signature
    returning a coroutine of `T`: one definition, and each client typed as what it returns.
    """

    def __init__(self, build: Callable[P, Call[T]]) -> None:
        self.build = build
        self.__doc__ = build.__doc__  # what the method does, for help() and the docs

    @overload
    def __get__(self, client: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, client: SyncSender, owner: type[Any]) -> Callable[P, T]: ...
    @overload
    def __get__(self, client: AsyncSender, owner: type[Any]) -> Callable[P, Coroutine[Any, Any, T]]: ...
    def __get__(
        self, client: SyncSender | AsyncSender | None, owner: type[Any]
    ) -> Self | Callable[P, T] | Callable[P, Coroutine[Any, Any, T]]:
        if client is None:
            return self
        build, send = self.build, client._send

        def method(*args: P.args, **kwargs: P.kwargs) -> Any:  # T or a coroutine of T: `send` decides
            return send(build(*args, **kwargs))

        return update_wrapper(method, build)


def log_retries(logger: logging.Logger) -> None:
    """Log each retry stamina schedules, process-wide, as one line on `logger` that says what failed (the
    error names the call: `POST /v1/nodes/n1/lease: ConnectError: ...`) and when it runs again; stamina's own
    hook logs a bare `stamina.retry_scheduled` with the details out of the message. For an application's
    entry point (the agent, the gateway), not a library."""

    def hook(details: RetryDetails) -> None:
        logger.warning(
            "retry %d in %.1f s (%.1f s waited so far): %s",
            details.retry_num,
            details.wait_for,
            details.waited_so_far,
            details.caused_by,
        )

    set_on_retry_hooks([hook])
