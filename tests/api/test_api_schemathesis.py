"""schemathesis against `create_app(test settings)` in-process, open and with tokens: zero failures of any check.

The configuration and the checks are the reliability report's (`planner_service/soak/fuzz.py`, which runs
them against a real server with many more examples), bounded here by a fixed seed and a few examples per
operation so that it stays a test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from api_helpers import TINY
from prometheus_client import CollectorRegistry
from schemathesis.python.asgi import shutdown_lifespans

from planner_service.api.app import create_app
from planner_service.settings import Settings
from planner_service.soak.fuzz import OPERATOR_TOKEN, PHASES, config, findings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

NODE_TOKENS = {"n1": "n1-token", "n2": "n2-token"}  # the tiny scenario's nodes


@pytest.fixture
def app_for(tmp_path: Path) -> Iterator[Any]:
    def make(*, auth: bool) -> Any:
        tokens: dict[str, Any] = {"operator_tokens": [OPERATOR_TOKEN], "node_tokens": NODE_TOKENS} if auth else {}
        settings = Settings(
            db_path=tmp_path / "statebudget.db",
            scenario_path=TINY,
            background_planning=False,
            plan_in_worker=False,
            max_wait_seconds=0,  # lease long-polls answer at once
            **tokens,
        )
        return create_app(settings, registry=CollectorRegistry())

    yield make
    shutdown_lifespans()  # schemathesis starts the app's lifespan on its first request and keeps it running


@pytest.mark.parametrize("auth", [False, True], ids=["open", "tokens"])
def test_schemathesis_finds_nothing(app_for, auth):
    bounded = config(auth=auth, examples=4, stateful_examples=30, stateful_steps=8, seed=22)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app_for(auth=auth), config=bounded)
    failures, phases, _ = findings(schema)
    assert not failures, "\n".join(failures)
    for phase in PHASES:  # each ran (a failure status there is one of the exempted findings)
        assert phases.get(phase) in ("success", "failure"), phases
