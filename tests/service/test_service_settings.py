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


SECRET = "zq7-secret-f3a"  # a prefix found nowhere else: not even the start of a token may show


@pytest.mark.parametrize(
    "kwargs",
    [
        {"operator_tokens": [SECRET], "node_tokens": {"n1": SECRET}},  # a model-level check: its input is every field
        {"operator_tokens": [SECRET, 5]},
        {"node_tokens": {"n1": SECRET, "n2": SECRET}},
        {"operator_tokens": [SECRET], "port": -1},
    ],
)
def test_a_refused_setting_never_prints_the_tokens(kwargs):
    with pytest.raises(ValidationError) as caught:
        Settings(**kwargs)
    assert SECRET[:3] not in str(caught.value) and SECRET[:3] not in repr(caught.value)


def test_settings_repr_hides_the_tokens():
    s = Settings(operator_tokens=[SECRET], node_tokens={"n1": SECRET + "-n1"})
    assert SECRET not in repr(s) and SECRET not in str(s)


def test_clock_skew_setting(monkeypatch):
    assert Settings().max_clock_skew_seconds == 86_400.0
    monkeypatch.setenv("STATEBUDGET_MAX_CLOCK_SKEW_SECONDS", "120")
    assert Settings().max_clock_skew_seconds == 120.0
    with pytest.raises(ValidationError, match="max_clock_skew_seconds"):
        Settings(max_clock_skew_seconds=0)


@pytest.mark.parametrize(
    "env",
    [
        {"STATEBUDGET_OPERATOR_TOKENS": f'["{SECRET}"]', "STATEBUDGET_NODE_TOKENS": f'{{"n1": "{SECRET}"}}'},
        {"STATEBUDGET_OPERATOR_TOKENS": f'["{SECRET}", 5]'},
        {"STATEBUDGET_OPERATOR_TOKENS": f'["{SECRET}"'},  # not JSON: pydantic-settings' own error
    ],
)
def test_serve_with_bad_settings_exits_2_without_printing_the_tokens(tmp_path, monkeypatch, env):
    from typer.testing import CliRunner

    from planner_service.cli import app

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, ["serve", "--db", str(tmp_path / "x.db")])
    assert result.exit_code == 2, result.output
    assert "invalid settings" in result.output and SECRET[:3] not in result.output
    assert not (tmp_path / "x.db").exists()
