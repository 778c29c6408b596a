"""One request through the gateway: route it, hold it while its model wakes, pass it to the engine and the
answer back as the engine wrote it, and tell the session events what happened."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator

import httpx
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from clients.gateway.errors import GatewayError, unavailable
from clients.gateway.events import SessionEvents
from clients.gateway.follower import RouteFollower
from clients.gateway.metrics import GatewayMetrics
from clients.gateway.parsing import Endpoint, RequestFacts, StreamScanner, parse_request, read_answer
from clients.gateway.settings import GatewaySettings
from clients.gateway.table import Choice
from planner_service.wire.routes import RouteInstance

log = logging.getLogger("statebudget.gateway")

PATHS: dict[Endpoint, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# hop-by-hop headers (RFC 9110 §7.6.1) and the ones httpx or the server set for the new connection
_DROP_REQUEST = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-connection"}
)
_DROP_RESPONSE = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"})
RETRY_AFTER_SECONDS = 5


class Proxy:
    def __init__(
        self,
        settings: GatewaySettings,
        upstream: httpx.AsyncClient,
        follower: RouteFollower,
        sessions: SessionEvents,
        metrics: GatewayMetrics,
    ) -> None:
        self.settings = settings
        self.upstream = upstream
        self.follower = follower
        self.sessions = sessions
        self.metrics = metrics
        self._held: dict[str, int] = defaultdict(int)

    async def handle(self, endpoint: Endpoint, body: bytes, headers: list[tuple[bytes, bytes]]) -> Response:
        arrived = time.perf_counter()
        session_header = next((v.decode("latin-1") for k, v in headers if k.lower() == b"x-session-id"), None)
        facts = parse_request(body, endpoint, session_header)
        self.sessions.on_request(facts)
        choice = await self._route(facts, arrived)
        forwarded = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in headers
            if k.decode("latin-1").lower() not in _DROP_REQUEST
        ]
        tried: set[str] = set()
        while True:
            try:
                upstream = await self._send(choice.instance, endpoint, body, forwarded)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout) as error:
                # nothing reached the engine: the request may go to another instance
                tried.add(choice.instance.id)
                log.warning("instance %s unreachable (%s); trying another", choice.instance.id, type(error).__name__)
                self.metrics.retries.labels(facts.model).inc()
                retry = self.follower.table.choose(facts.model, facts.session, exclude=frozenset(tried))
                if retry is None:
                    self.metrics.requests.labels(facts.model, "unavailable").inc()
                    raise unavailable(
                        f"no running instance of {facts.model!r} could be reached; the request was not sent",
                        RETRY_AFTER_SECONDS,
                    ) from error
                choice = retry
            except httpx.TransportError as error:
                # the request may have started on the engine: never sent twice
                self.metrics.requests.labels(facts.model, "engine_error").inc()
                raise GatewayError(
                    502,
                    f"instance {choice.instance.id} failed before answering ({type(error).__name__}); not resent",
                    type="upstream_error",
                ) from error
        self.metrics.routed.labels(facts.model, "kv_holder" if choice.kv_holder else "other").inc()
        self.metrics.ttft.labels(facts.model).observe(time.perf_counter() - arrived)
        response_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_RESPONSE}
        outcome = "ok" if upstream.status_code < 400 else "engine_error"
        if facts.stream and upstream.status_code == 200:
            return StreamingResponse(
                self._relay(upstream, facts),
                status_code=upstream.status_code,
                headers=response_headers,
                background=BackgroundTask(upstream.aclose),
            )
        try:
            content = await upstream.aread()
        except httpx.TransportError as error:
            self.metrics.requests.labels(facts.model, "engine_error").inc()
            raise GatewayError(
                502, f"instance {choice.instance.id} broke off its answer; not resent", type="upstream_error"
            ) from error
        finally:
            await upstream.aclose()
        self.metrics.requests.labels(facts.model, outcome).inc()
        if upstream.status_code == 200:
            self.sessions.on_answer(facts, read_answer(content))
        log.debug("routed model=%s instance=%s status=%d", facts.model, choice.instance.id, upstream.status_code)
        return Response(content, status_code=upstream.status_code, headers=response_headers)

    async def _route(self, facts: RequestFacts, arrived: float) -> Choice:
        """An instance running the model now, else hold the request until the table shows one."""
        table = self.follower.table
        choice = table.choose(facts.model, facts.session)
        if choice is not None:
            return choice
        if not table.known(facts.model):
            self.metrics.requests.labels("unknown", "bad_request").inc()
            raise GatewayError(
                404,
                f"The model `{facts.model}` does not exist: no registered engine serves it "
                f"(served: {', '.join(table.models) or 'none'})",
                type="NotFoundError",
                param="model",
            )
        if self._held[facts.model] >= self.settings.queue_limit_per_model:
            self.metrics.requests.labels(facts.model, "unavailable").inc()
            raise unavailable(
                f"{self._held[facts.model]} requests already wait for {facts.model!r} to wake", RETRY_AFTER_SECONDS
            )
        self._held[facts.model] += 1
        self.metrics.held.labels(facts.model).inc()
        deadline = arrived + self.settings.wake_timeout_seconds
        try:
            while True:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    self.metrics.requests.labels(facts.model, "unavailable").inc()
                    raise unavailable(
                        f"{facts.model!r} did not start running within {self.settings.wake_timeout_seconds:g} s; "
                        "the planner was asked for it",
                        RETRY_AFTER_SECONDS,
                    )
                await self.follower.wait_for_change(remaining)
                choice = self.follower.table.choose(facts.model, facts.session)
                if choice is not None:
                    return choice
        finally:
            self._held[facts.model] -= 1
            self.metrics.held.labels(facts.model).dec()
            self.metrics.wake_hold.labels(facts.model).observe(time.perf_counter() - arrived)

    async def _send(
        self, instance: RouteInstance, endpoint: Endpoint, body: bytes, headers: list[tuple[str, str]]
    ) -> httpx.Response:
        assert instance.url is not None  # choose() returns instances with a URL only
        request = self.upstream.build_request(
            "POST", instance.url.rstrip("/") + PATHS[endpoint], content=body, headers=headers
        )
        return await self.upstream.send(request, stream=True)

    async def _relay(self, upstream: httpx.Response, facts: RequestFacts) -> AsyncIterator[bytes]:
        """The engine's SSE bytes as they come; closing this (a client that went away) closes the upstream
        connection, which is how an OpenAI server learns to abort the request."""
        scanner = StreamScanner()
        finished = False
        try:
            async for chunk in upstream.aiter_raw():
                scanner.feed(chunk)
                yield chunk
            finished = True
        except httpx.TransportError as error:
            log.warning("stream of %s broke off: %s", facts.model, type(error).__name__)
        except (asyncio.CancelledError, GeneratorExit):
            self.metrics.requests.labels(facts.model, "cancelled").inc()
            raise
        finally:
            if finished:
                self.metrics.requests.labels(facts.model, "ok").inc()
                self.sessions.on_answer(facts, scanner.facts)
            await upstream.aclose()
