"""Settings check themselves; the environment feeds them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from planner_service.settings import Settings


def test_defaults():
    s = Settings()
    assert (s.port, s.lease_seconds, s.solver, s.auth_enabled) == (8080, 30.0, "greedy", False)


def test_environment_with_json_lists_and_maps(monkeypatch):
    monkeypatch.setenv("STATEBUDGET_OPERATOR_TOKENS", '["op"]')
    monkeypatch.setenv("STATEBUDGET_NODE_TOKENS", '{"n1": "t1"}')
    monkeypatch.setenv("STATEBUDGET_LEASE_SECONDS", "5")
    s = Settings()
    assert s.operator_tokens == ["op"] and s.node_tokens == {"n1": "t1"} and s.lease_seconds == 5 and s.auth_enabled


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"node_tokens": {"n1": "same", "n2": "same"}}, "share a token"),
        ({"operator_tokens": ["t"], "node_tokens": {"n1": "t"}}, "also an operator token"),
        ({"operator_tokens": [""]}, "empty"),
        ({"lease_seconds": 0}, "lease_seconds"),
        ({"solver": "magic"}, "solver"),
        ({"demand_seats": -1}, "demand_seats"),
        ({"demand_window_seconds": 0}, "demand_window_seconds"),
    ],
)
def test_bad_settings_are_refused(kwargs, needle):
    with pytest.raises(ValidationError, match=needle):
        Settings(**kwargs)
