"""`create_app(settings)`: the FastAPI application around one `ClusterService`.

The lifespan owns the files and threads: it opens the store, restores or
seeds the state, plans, and starts the planning loop; nothing happens at
import time or in constructors.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures.process import BrokenProcessPool
from contextlib import asynccontextmanager, contextmanager
from types import FrameType
from typing import Any

import anyio.to_thread
from fastapi import FastAPI
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry
from starlette.concurrency import run_in_threadpool

from planner_service.api.assets import mount_static
from planner_service.api.deps import QueueSignal
from planner_service.api.errors import (
    ERROR_RESPONSES,
    OPEN_ERROR_RESPONSES,
    add_problem_schemas,
    install_error_handlers,
)
from planner_service.api.routes import (
    calibration,
    cluster,
    docs,
    engines,
    events,
    health,
    models,
    nodes,
    operations,
    plan,
    routes,
    sessions,
    srv,
    status,
    whatif,
)
from planner_service.domain.demo import demo_scenario
from planner_service.domain.scenario import Scenario, load_scenario
from planner_service.metrics import Metrics
from planner_service.service.engine import ClusterService
from planner_service.service.errors import ServiceError
from planner_service.service.loop import PlanningLoop
from planner_service.service.solving import PlanWorker
from planner_service.service.store import SqliteStore, Store
from planner_service.settings import Settings

log = logging.getLogger("planner_service")


def _operation_id(route: APIRoute) -> str:
    return route.name  # the handler's name: stable, unique, readable (e.g. "post_events")


class _App(FastAPI):
    """FastAPI, with the one error shape (`Problem`) in its OpenAPI document."""

    def openapi(self) -> dict[str, Any]:
        return add_problem_schemas(super().openapi())  # in place on FastAPI's cached document: idempotent


_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def drain_on_exit_signals(loop: asyncio.AbstractEventLoop, queues: QueueSignal) -> Iterator[None]:
    """At SIGTERM or SIGINT, answer the lease long-polls at once, then let the server's own handler stop it.

    uvicorn meets a signal by closing its socket and waiting for the requests in flight, and sends
    the lifespan's shutdown only after that wait; a long-poll would hold it for its whole
    `wait_seconds` (then be cancelled as a 500). So the drain is chained in front of whatever
    handler the server installed. Signals reach only the main thread: anywhere else (a test
    client's thread) nothing is installed.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in _EXIT_SIGNALS}

    def handler(sig: int, frame: FrameType | None) -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(queues.drain)
        chained = previous[signal.Signals(sig)]
        if callable(chained):
            chained(sig, frame)
        elif chained == signal.SIG_DFL:  # nobody else handles it: die as the signal would have made us
            signal.signal(sig, signal.SIG_DFL)
            signal.raise_signal(sig)

    for sig in _EXIT_SIGNALS:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            if signal.getsignal(sig) is handler and old is not None:
                signal.signal(sig, old)


def seed_for(settings: Settings) -> Callable[[], Scenario]:
    """What seeds an empty database: the scenario file, else the demo."""
    if settings.scenario_path is not None:
        path = settings.scenario_path
        return lambda: load_scenario(path)
    return demo_scenario


def create_app(
    settings: Settings,
    *,
    clock: Callable[[], float] | None = None,
    registry: CollectorRegistry | None = None,
    store: Store | None = None,
) -> FastAPI:
    registry = registry if registry is not None else CollectorRegistry()
    metrics = Metrics(registry)
    service = ClusterService(
        store if store is not None else SqliteStore(settings.db_path), metrics, settings, clock=clock or time.time
    )
    metrics.watch(service.metrics_snapshot)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not settings.auth_enabled:
            log.warning("no operator or node tokens configured: the API is open to anyone who can reach it")
        # every request that touches the state runs in a thread and may wait there for the state lock; the
        # default of 40 threads would let a burst of done reports hold them all while leases wait for one
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.worker_threads
        seeded = await run_in_threadpool(service.start, seed_for(settings))
        if seeded:
            source = settings.scenario_path or "the demo scenario"
            log.info("database %s was empty: seeded from %s", settings.db_path, source)
        elif settings.scenario_path is not None or settings.demo:
            log.info("database %s already holds a state: it wins, the seed scenario is ignored", settings.db_path)
        loop = asyncio.get_running_loop()
        queues = QueueSignal()
        app.state.signal = queues

        def wake(nodes: frozenset[str] | None) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(queues.bump, nodes)

        service.add_listener(wake)
        worker = PlanWorker() if settings.plan_in_worker else None
        if worker is not None:
            try:
                pid = await run_in_threadpool(worker.start)
            except (OSError, BrokenProcessPool) as error:  # a start never fails on the worker either
                log.error("no planning worker process (%s): replans are solved in the service", error)
                await run_in_threadpool(worker.close)
                worker = None
            else:
                service.planning.runner = worker
                log.info("replans are solved in the worker process %d", pid)
        try:
            await run_in_threadpool(service.replan)
        except ServiceError as error:  # a start never fails on a plan: the planning loop tries again
            log.warning("first plan skipped: %s", error.message)
        # What the start built (modules, the catalog, the compiled problem) lives as long as the process: out
        # of the collector's reach, a full collection scans only what changes and pauses every request for
        # milliseconds instead of ~60 ms (measured under `bench load`, docs/benchmarks/ingest.md)
        gc.collect()
        gc.freeze()
        planner = None
        if settings.background_planning:
            planner = PlanningLoop(
                service,
                debounce_seconds=settings.replan_debounce_seconds,
                interval_seconds=settings.replan_interval_seconds,
            )
            planner.start()
        try:
            with drain_on_exit_signals(loop, queues):
                yield
        finally:
            queues.drain()
            if planner is not None:
                await run_in_threadpool(planner.stop)
            if worker is not None:
                await run_in_threadpool(worker.close)
            service.close()
            gc.unfreeze()  # what the service held may be collected again (a test process starts many)

    app = _App(
        title="StateBudget",
        summary="Plans where LLM weights, KV cache and MoE experts live in a small GPU cluster.",
        version="0.1.0",
        lifespan=lifespan,
        generate_unique_id_function=_operation_id,
        docs_url=None,  # routes/docs.py serves /docs and /redoc on packaged assets, not a CDN's
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.service = service
    app.state.registry = registry
    app.state.signal = QueueSignal()
    install_error_handlers(app)
    app.include_router(health.router, responses=OPEN_ERROR_RESPONSES)
    routers = (cluster, models, events, sessions, srv, engines, plan, routes, nodes, operations, whatif, calibration)
    for module in routers:
        app.include_router(module.router, responses=ERROR_RESPONSES)
    app.include_router(status.router)  # the HTML pages, left out of the OpenAPI document
    app.include_router(docs.router)
    mount_static(app)
    return app
