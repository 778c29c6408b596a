"""The gateway's ASGI app: the OpenAI surface agents call, health, and metrics.

`create_gateway_app(settings)` builds it; the lifespan owns the engine connection pool, the planner client,
the route-table long-poll, the event batcher, the idle-session sweep and the LMCache pins' workers. The two POST routes go straight to
the proxy's ASGI handler; Starlette serves the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from clients.gateway.errors import GatewayError
from clients.gateway.events import EventSink, SessionEvents
from clients.gateway.follower import RouteFollower
from clients.gateway.metrics import GatewayMetrics
from clients.gateway.pins import Pins
from clients.gateway.proxy import ROUTES, Proxy
from clients.gateway.settings import GatewaySettings
from clients.gateway.upstream import UpstreamPool
from clients.gateway.warmups import Warmups
from clients.sdk import AsyncStateBudgetClient, RetryPolicy

# a failed planner call is not retried in place: the follower and the event batcher try again themselves
_ONE_TRY = RetryPolicy(attempts=1)


class GatewayApp(Starlette):
    """Starlette for health, models and metrics; the completions bypass its middleware and routing."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = ROUTES.get(scope["path"])
            if endpoint is not None:
                proxy: Proxy = self.state.proxy
                await proxy.serve(endpoint, scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def create_gateway_app(
    settings: GatewaySettings,
    *,
    registry: CollectorRegistry | None = None,
    planner_transport: httpx.AsyncBaseTransport | None = None,
) -> GatewayApp:
    registry = registry or CollectorRegistry()
    metrics = GatewayMetrics(registry)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        upstream = UpstreamPool(
            connect_timeout_seconds=settings.upstream_connect_timeout_seconds,
            read_timeout_seconds=settings.upstream_read_timeout_seconds,
            max_idle=settings.max_connections,
        )
        planner = AsyncStateBudgetClient(
            settings.planner_url,
            token=settings.planner_token,
            timeout_seconds=settings.routes_wait_seconds + 10.0,
            retry=_ONE_TRY,
            transport=planner_transport,
        )
        follower = RouteFollower(
            planner, metrics, wait_seconds=settings.routes_wait_seconds, retry_seconds=settings.planner_retry_seconds
        )
        sink = EventSink(
            planner,
            metrics,
            flush_seconds=settings.event_flush_seconds,
            batch_max=settings.event_batch_max,
            buffer_max=settings.event_buffer_max,
            retry_seconds=settings.planner_retry_seconds,
        )
        sessions = SessionEvents(sink, idle_seconds=settings.session_idle_seconds)
        warmups = Warmups(upstream, metrics, enabled=settings.warmups, history_bytes=settings.warmup_history_bytes)
        pins = Pins(
            metrics,
            controller_url=settings.lmcache_controller_url,
            instance_ids=settings.lmcache_instance_ids,
            location=settings.lmcache_pin_location,
            refresh_seconds=settings.lmcache_pin_refresh_seconds,
            retry_seconds=settings.lmcache_pin_retry_seconds,
            concurrency=settings.lmcache_pin_concurrency,
            timeout_seconds=settings.lmcache_timeout_seconds,
            history_bytes=settings.pin_history_bytes,
        )
        follower.listeners.extend([warmups.on_table, pins.on_table])
        app.state.follower = follower
        app.state.sink = sink
        app.state.sessions = sessions
        app.state.warmups = warmups
        app.state.pins = pins
        app.state.proxy = Proxy(settings, upstream, follower, sessions, metrics, warmups, pins)
        with contextlib.suppress(Exception):  # a planner down at start is what run() waits out
            await follower.fetch_once(wait=False)
        loops = (follower.run(), sink.run(), sessions.run_idle_sweep(), pins.run())
        tasks = [asyncio.create_task(t) for t in loops]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            warmups.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sink.flush(), timeout=2.0)  # a last try; what fails is lost with us
            upstream.close()
            await planner.aclose()

    async def http_error(_: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)  # an unknown path or method: the OpenAI shape too
        return Response(
            GatewayError(error.status_code, str(error.detail), type="invalid_request_error").body(),
            status_code=error.status_code,
            media_type="application/json",
        )

    async def list_models(request: Request) -> Response:
        """The models of the route table, in the OpenAI list shape (vLLM's `ModelList` / `ModelCard`)."""
        follower: RouteFollower = request.app.state.follower
        created = int(time.time())
        data = [
            {"id": m, "object": "model", "created": created, "owned_by": "statebudget"} for m in follower.table.models
        ]
        return JSONResponse({"object": "list", "data": data})

    async def livez(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        """200 while there is a table to route by (`degraded`: the planner is unreachable, the last one is used);
        503 before any table arrived. `pins`: the LMCache pins' state, `off` where no controller is configured
        (a setting, not a fault: it changes neither the status nor the code)."""
        follower: RouteFollower = request.app.state.follower
        sink: EventSink = request.app.state.sink
        pins: Pins = request.app.state.pins
        has_table = follower.table.epoch >= 0
        body: dict[str, Any] = {
            "status": "ok" if follower.planner_reachable else ("degraded" if has_table else "unavailable"),
            "planner_reachable": follower.planner_reachable,
            "route_epoch": follower.table.epoch if has_table else None,
            "last_planner_error": follower.last_error,
            "events_pending": sink.pending,
            "pins": pins.state(),
        }
        return JSONResponse(body, status_code=200 if has_table else 503)

    async def prometheus_metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app = GatewayApp(
        routes=[
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/livez", livez, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", prometheus_metrics, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.registry = registry
    return app
