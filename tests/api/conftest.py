"""The real app on a temporary SQLite file, a fake clock and its own metrics registry."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from api_helpers import TINY, FakeClock, Harness
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from planner_service.api.app import create_app
from planner_service.settings import Settings


@pytest.fixture
def make_app(tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    """`make_app(tiny=True, auth=False, **settings)`; the same db path for every app of one test (restarts)."""
    opened: list[TestClient] = []

    def make(*, tiny: bool = False, auth: bool = False, clock: FakeClock | None = None, **overrides: Any) -> Harness:
        settings: dict[str, Any] = {
            "db_path": tmp_path / "statebudget.db",
            "background_planning": False,
            "plan_in_worker": False,  # the API is the subject here; tests/service/test_plan_worker.py plans in the worker
            "lease_seconds": 30.0,
            **overrides,
        }
        if tiny:
            settings["scenario_path"] = TINY
        if auth:
            settings["operator_tokens"] = ["op-token"]
            settings["node_tokens"] = {"n1": "n1-token", "n2": "n2-token"}
        clock = clock or FakeClock()
        registry = CollectorRegistry()
        client = TestClient(create_app(Settings(**settings), clock=clock, registry=registry))
        client.__enter__()
        opened.append(client)
        return Harness(client, clock, registry)

    yield make
    for client in opened:
        client.__exit__(None, None, None)


@pytest.fixture
def demo(make_app: Callable[..., Harness]) -> Harness:
    return make_app()


@pytest.fixture
def tiny(make_app: Callable[..., Harness]) -> Harness:
    """Two nodes, one 20 GiB GPU each, alpha (12 GiB) on both GPUs, beta (12 GiB) on NVMe only."""
    return make_app(tiny=True)
