"""The alert rules under Prometheus's own rule engine: `promtool check rules` and `promtool test rules` with
deploy/prometheus/alerts_test.yml, which holds for every alert a case where it fires and one where it
does not. promtool comes with Debian's `prometheus` package (`apt-get install -y prometheus`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

PROMETHEUS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
ALERT_RULES = PROMETHEUS / "alerts.yml"
ALERT_TESTS = PROMETHEUS / "alerts_test.yml"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not found (Debian: apt-get install -y prometheus): the alert rules are not evaluated")
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=120, check=False, cwd=PROMETHEUS)


def alert_names() -> list[str]:
    alerts = yaml.safe_load(ALERT_RULES.read_text(encoding="utf-8"))
    return [rule["alert"] for group in alerts["groups"] for rule in group["rules"] if "alert" in rule]


def rule_tests() -> list[dict[str, Any]]:
    tests: list[dict[str, Any]] = yaml.safe_load(ALERT_TESTS.read_text(encoding="utf-8"))["tests"]
    return [check for test in tests for check in test.get("alert_rule_test", [])]


def test_the_tests_load_the_alert_rules() -> None:
    config = yaml.safe_load(ALERT_TESTS.read_text(encoding="utf-8"))
    assert [(PROMETHEUS / path).resolve() for path in config["rule_files"]] == [ALERT_RULES.resolve()]


@pytest.mark.parametrize("alert", alert_names())
def test_every_alert_has_a_firing_and_a_quiet_case(alert: str) -> None:
    checks = [check for check in rule_tests() if check["alertname"] == alert]
    assert any(check["exp_alerts"] for check in checks), f"no case where {alert} fires"
    assert any(not check["exp_alerts"] for check in checks), f"no case where {alert} stays quiet"
    for check in checks:
        for expected in check["exp_alerts"]:
            assert expected.get("exp_annotations"), f"{alert}: a firing case checks the rendered annotations"


def test_the_alert_rules_are_valid_prometheus_rules() -> None:
    result = promtool("check", "rules", ALERT_RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_alert_rules_pass_their_unit_tests() -> None:
    result = promtool("test", "rules", ALERT_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
