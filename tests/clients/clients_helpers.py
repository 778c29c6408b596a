"""Helpers for the client tests: the real app on a temp SQLite file, served in-process; the fake NVML of a
node of fake engine processes."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar, get_args, get_origin

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from support import TINY_SCENARIO, FakeClock

from clients.sdk import AsyncStateBudgetClient, RetryPolicy, StateBudgetClient
from clients.sdk._core import Call
from planner_service.api.app import create_app
from planner_service.settings import Settings

TINY = TINY_SCENARIO
FAKES = Path(__file__).resolve().parents[1] / "fakes"
OPERATOR_TOKEN = "op-token"
NODE_TOKENS = {"n1": "n1-token", "n2": "n2-token"}
T = TypeVar("T")
FAST_RETRY = RetryPolicy(attempts=3, wait_initial_seconds=0.001, wait_max_seconds=0.002, wait_jitter_seconds=0.0)


def make_app(
    tmp_path: Path, *, tiny: bool = False, auth: bool = False, clock: FakeClock | None = None, **overrides: Any
) -> FastAPI:
    settings: dict[str, Any] = {
        "db_path": tmp_path / "statebudget.db",
        "background_planning": False,
        "plan_in_worker": False,  # the API is the subject here; tests/service/test_plan_worker.py plans in the worker
        "lease_seconds": 30.0,
        "max_wait_seconds": 5.0,
        **overrides,
    }
    if tiny:
        settings["scenario_path"] = TINY
    if auth:
        settings["operator_tokens"] = [OPERATOR_TOKEN]
        settings["node_tokens"] = NODE_TOKENS
    return create_app(Settings(**settings), clock=clock or FakeClock(), registry=CollectorRegistry())


@contextlib.asynccontextmanager
async def served(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app's lifespan in this event loop, and an httpx client that talks to it in-process."""
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://statebudget") as http,
    ):
        yield http


def assert_declared_type(call: Call[Any], answer: object) -> None:
    """The answer is an instance of the type the method declares (each item, for a list), not a dict."""
    if get_origin(call.answer) is list:
        (item,) = get_args(call.answer)
        assert isinstance(answer, list) and all(isinstance(a, item) for a in answer), (call.path, answer)
    else:
        assert isinstance(answer, call.answer), (call.path, type(answer))


class CheckedClient(StateBudgetClient):
    """The sync SDK, checking every answer against the type its method declares."""

    def _send(self, call: Call[T]) -> T:
        answer = super()._send(call)
        assert_declared_type(call, answer)
        return answer


class CheckedAsyncClient(AsyncStateBudgetClient):
    """The async SDK, checking every answer against the type its method declares."""

    async def _send(self, call: Call[T]) -> T:
        answer = await super()._send(call)
        assert_declared_type(call, answer)
        return answer


def async_client(http: httpx.AsyncClient, token: str | None = None) -> AsyncStateBudgetClient:
    return CheckedAsyncClient("http://statebudget", token=token, http_client=http, retry=FAST_RETRY)


def request_event(event_id: str, session: str, model: str, **extra: Any) -> dict[str, Any]:
    return {"id": event_id, "type": "request", "session": session, "model": model, **extra}


def driver_nvml(driver: Path, totals: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The stand-in `pynvml` the agent imports on a node of fake engines (tests/fakes/nvml_driver)."""
    monkeypatch.setenv("STATEBUDGET_FAKE_NVML_DIR", str(driver))
    monkeypatch.setenv("STATEBUDGET_FAKE_NVML_TOTALS", totals)
    spec = importlib.util.spec_from_file_location("fake_pynvml", FAKES / "nvml_driver" / "pynvml.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    module.nvmlInit()
    return module
