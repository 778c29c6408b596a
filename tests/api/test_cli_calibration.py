"""`statebudget calibration show|reset`: the operator's view of learned bandwidths, through the SDK."""

from __future__ import annotations

import json

import pytest
from api_helpers import OPERATOR, Harness
from rich.console import Console
from typer.testing import CliRunner

from clients.sdk import StateBudgetClient
from planner_service import cli


@pytest.fixture
def service(make_app, monkeypatch) -> Harness:
    """The app with tokens, and the CLI's SDK client bound to it (the URL and token still go through the CLI)."""
    harness = make_app(auth=True)

    def bound(url: str, token: str | None) -> StateBudgetClient:
        assert url == "http://planner:8080"
        return StateBudgetClient(url, token=token, http_client=harness.client)

    monkeypatch.setattr(cli, "operator_client", bound)
    return harness


def run(*args: str, token: str = "op-token"):
    return CliRunner().invoke(cli.app, ["calibration", *args, "--url", "http://planner:8080", "--token", token])


def learn(service: Harness) -> None:
    beat = service.post(
        "/v1/nodes/n1/heartbeat",
        json={"nvme_read_bytes_per_s": 5e9, "gpus": [{"id": "n1-g0", "h2d_bytes_per_s": 20e9}]},
        headers=OPERATOR,
    )
    assert beat.status_code == 200, beat.text


def test_show_lists_what_each_link_learned(service, monkeypatch):
    learn(service)
    shown = run("show", "--node", "n1", "--json")
    assert shown.exit_code == 0, shown.output
    (n1,) = json.loads(shown.output)["nodes"]
    assert n1["id"] == "n1" and n1["calibrates"] and n1["scale"] == 1.0
    assert n1["calibrated"]["nvme_read_bytes_per_s"]["last_measured"] == 5e9
    assert n1["gpus"][0]["calibrated"]["h2d_bytes_per_s"]["samples"] == 1
    monkeypatch.setattr(cli, "out", Console(width=200))  # the module's console took its width at import
    table = run("show")
    assert table.exit_code == 0 and "nvme_read_bytes_per_s" in table.output and "n1-g0" in table.output


def test_reset_forgets_per_node_gpu_field_or_all(service):
    learn(service)
    one = run("reset", "--gpu", "n1-g0", "--field", "h2d_bytes_per_s", "--json")
    assert one.exit_code == 0, one.output
    assert json.loads(one.output)["forgotten"] == 1
    node = run("reset", "--node", "n1", "--json")
    assert json.loads(node.output)["forgotten"] == 1
    shown = json.loads(run("show", "--json").output)
    assert all(not n["calibrated"] and not any(g["calibrated"] for g in n["gpus"]) for n in shown["nodes"])
    learn(service)
    assert json.loads(run("reset", "--all", "--json").output)["forgotten"] == 2


def test_mistakes_are_one_clear_line(service):
    bad_field = run("reset", "--node", "n1", "--field", "h2d_bytes_per_s")
    assert bad_field.exit_code == 1 and "nvme_read_bytes_per_s" in bad_field.output
    assert run("reset", "--node", "n9").exit_code == 1
    neither = run("reset")
    assert neither.exit_code == 2 and "--node, --gpu or --all" in neither.output
    refused = run("show", token="wrong")
    assert refused.exit_code == 1 and "401" in refused.output
