from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from clients_helpers import FAST_RETRY, CheckedClient, FakeClock, make_app
from fastapi.testclient import TestClient

from clients.sdk import StateBudgetClient


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def sync_client(tmp_path: Path) -> Iterator[Callable[..., tuple[StateBudgetClient, TestClient, FakeClock]]]:
    """`sync_client(token=None, tiny=False, auth=False)`: the SDK over starlette's TestClient (an httpx.Client),
    checking each answer's type."""
    opened: list[TestClient] = []

    def make(*, token: str | None = None, **app_kwargs: Any) -> tuple[StateBudgetClient, TestClient, FakeClock]:
        clock = app_kwargs.pop("clock", None) or FakeClock()
        http = TestClient(make_app(tmp_path, clock=clock, **app_kwargs))
        http.__enter__()
        opened.append(http)
        return CheckedClient(token=token, http_client=http, retry=FAST_RETRY), http, clock

    yield make
    for http in opened:
        http.__exit__(None, None, None)
