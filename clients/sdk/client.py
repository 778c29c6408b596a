"""`StateBudgetClient` (sync) and `AsyncStateBudgetClient`: the same endpoints over two transports.

    with StateBudgetClient("http://127.0.0.1:8080", token="op-secret") as sb:
        sb.post_events(events.request("e1", session="s1", model="coder"))
        print(sb.get_srv().version)

    async with AsyncStateBudgetClient("http://127.0.0.1:8080") as sb:
        lease = await sb.lease("n1", wait_seconds=10)

Both accept an injected `httpx` client (`http_client=`), e.g. starlette's
`TestClient` for the sync one or an `httpx.AsyncClient(transport=ASGITransport(app))`
for the async one; an injected client is not closed by the SDK.
"""

from __future__ import annotations

from typing import Self, TypeVar

import httpx
import stamina

from clients.sdk import _calls
from clients.sdk._core import (
    NO_RETRY,
    POOL_LIMITS,
    AsyncSender,
    Call,
    ClientConfig,
    Endpoint,
    RetryPolicy,
    SyncSender,
    is_retryable,
    parse,
    transport_error,
)

__all__ = ["AsyncStateBudgetClient", "StateBudgetClient"]

T = TypeVar("T")


class Endpoints:
    """Every endpoint of the API (`clients/sdk/_calls.py` builds each call), on both clients."""

    livez = Endpoint(_calls.livez)
    readyz = Endpoint(_calls.readyz)
    metrics = Endpoint(_calls.metrics)
    get_cluster = Endpoint(_calls.get_cluster)
    put_cluster = Endpoint(_calls.put_cluster)
    list_models = Endpoint(_calls.list_models)
    put_model = Endpoint(_calls.put_model)
    delete_model = Endpoint(_calls.delete_model)
    post_events = Endpoint(_calls.post_events)
    list_sessions = Endpoint(_calls.list_sessions)
    get_session = Endpoint(_calls.get_session)
    get_srv = Endpoint(_calls.get_srv)
    get_engines = Endpoint(_calls.get_engines)
    get_plan = Endpoint(_calls.get_plan)
    get_routes = Endpoint(_calls.get_routes)
    replan = Endpoint(_calls.replan)
    whatif = Endpoint(_calls.whatif)
    pareto = Endpoint(_calls.pareto)
    explain = Endpoint(_calls.explain)
    get_calibration = Endpoint(_calls.get_calibration)
    reset_calibration = Endpoint(_calls.reset_calibration)
    register_node = Endpoint(_calls.register_node)
    heartbeat = Endpoint(_calls.heartbeat)
    lease = Endpoint(_calls.lease)
    renew_lease = Endpoint(_calls.renew_lease)
    report = Endpoint(_calls.report)
    list_operations = Endpoint(_calls.list_operations)


class StateBudgetClient(SyncSender, Endpoints):
    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8080",
        *,
        token: str | None = None,
        timeout_seconds: float = 30.0,
        retry: RetryPolicy | None = None,
        http_client: httpx.Client | None = None,
    ) -> None:
        self.config = ClientConfig(base_url, token, timeout_seconds, retry or RetryPolicy())
        self._owned = http_client is None
        self._http = (
            http_client
            if http_client is not None
            else httpx.Client(base_url=base_url, timeout=timeout_seconds, limits=POOL_LIMITS)
        )

    def _send(self, call: Call[T]) -> T:
        policy = self.config.retry if call.idempotent else NO_RETRY
        for attempt in stamina.retry_context(on=is_retryable, **policy.stamina_kwargs()):
            with attempt:
                try:
                    response = self._http.request(call.method, call.path, **self.config.request_kwargs(call))
                except httpx.TransportError as error:
                    raise transport_error(error, call) from error
                return parse(call, response)
        raise AssertionError("unreachable: stamina re-raises the last error")  # pragma: no cover

    def close(self) -> None:
        if self._owned:
            self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncStateBudgetClient(AsyncSender, Endpoints):
    """Every endpoint method returns an awaitable."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8080",
        *,
        token: str | None = None,
        timeout_seconds: float = 30.0,
        retry: RetryPolicy | None = None,
        http_client: httpx.AsyncClient | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.config = ClientConfig(base_url, token, timeout_seconds, retry or RetryPolicy())
        self._owned = http_client is None
        self._http = (
            http_client
            if http_client is not None
            else httpx.AsyncClient(base_url=base_url, transport=transport, timeout=timeout_seconds, limits=POOL_LIMITS)
        )

    async def _send(self, call: Call[T]) -> T:  # the async twin of StateBudgetClient._send
        policy = self.config.retry if call.idempotent else NO_RETRY
        async for attempt in stamina.retry_context(on=is_retryable, **policy.stamina_kwargs()):
            with attempt:
                try:
                    response = await self._http.request(call.method, call.path, **self.config.request_kwargs(call))
                except httpx.TransportError as error:
                    raise transport_error(error, call) from error
                return parse(call, response)
        raise AssertionError("unreachable: stamina re-raises the last error")  # pragma: no cover

    async def aclose(self) -> None:
        if self._owned:
            await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
