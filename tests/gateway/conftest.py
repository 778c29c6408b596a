"""The `make_stack` fixture: a real planner, fake vLLM OpenAI servers and the gateway on loopback."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fakes.vllm_serving import ServingState, serving_app
from gateway_helpers import ROUTER_TOKEN, RecordEvents, Served, Stack
from prometheus_client import CollectorRegistry
from support import TINY_SCENARIO

from clients.gateway.app import create_gateway_app
from clients.gateway.settings import GatewaySettings
from planner_service.api.app import create_app
from planner_service.settings import Settings


@pytest.fixture
def make_stack(tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    started: list[Served] = []

    def make(*, engines: dict[str, list[str]], token_latency_seconds: float = 0.0, **gateway: Any) -> Stack:
        settings = Settings(
            db_path=tmp_path / "planner.db",
            scenario_path=TINY_SCENARIO,
            background_planning=False,
            plan_in_worker=False,
            operator_tokens=["op-token"],
            router_tokens=[ROUTER_TOKEN],
            max_wait_seconds=5.0,
        )
        planner_app = create_app(settings, registry=CollectorRegistry())
        recorder = RecordEvents(planner_app)
        planner = Served(recorder)
        started.append(planner)
        stack_engines = {}
        for name, models in engines.items():
            state = ServingState(models=models, token_latency_seconds=token_latency_seconds)
            served = Served(serving_app(state))
            started.append(served)
            stack_engines[name] = (served, state)
        options = {
            "planner_url": planner.url,
            "planner_token": ROUTER_TOKEN,
            "routes_wait_seconds": 2.0,
            "planner_retry_seconds": 0.1,
            "event_flush_seconds": 0.01,
            **gateway,
        }
        app = create_gateway_app(GatewaySettings(**options), registry=CollectorRegistry())
        gw = Served(app)
        started.append(gw)
        return Stack(planner=planner, gateway=gw, planner_events=recorder, engines=stack_engines)

    yield make
    for served in reversed(started):
        with contextlib.suppress(Exception):
            served.stop()
