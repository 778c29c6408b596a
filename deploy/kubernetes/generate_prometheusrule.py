"""Write the PrometheusRule of the prometheus-operator component from deploy/prometheus/alerts.yml.

    python deploy/kubernetes/generate_prometheusrule.py

The alert rules have one source, the file the compose stack's Prometheus loads; the PrometheusRule carries
the same groups, unchanged. tests/deploy/test_kubernetes.py fails when the two differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[1]
ALERT_RULES = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS_RULE = DEPLOY / "kubernetes" / "components" / "prometheus-operator" / "prometheusrule.yaml"
HEADER = """\
# Generated from deploy/prometheus/alerts.yml by deploy/kubernetes/generate_prometheusrule.py: edit the
# alerts there and run the script again. deploy/README.md explains each alert.
"""


class _Dumper(yaml.SafeDumper):
    """Block style throughout, and multi-line strings as literal blocks, so the file reads like its source."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def prometheus_rule(alerts: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "statebudget",
            "labels": {"app.kubernetes.io/name": "statebudget", "app.kubernetes.io/component": "planner"},
        },
        "spec": {"groups": alerts["groups"]},
    }


def render(alert_rules: Path = ALERT_RULES) -> str:
    alerts = yaml.safe_load(alert_rules.read_text(encoding="utf-8"))
    body = yaml.dump(prometheus_rule(alerts), Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)
    return HEADER + body


if __name__ == "__main__":
    PROMETHEUS_RULE.write_text(render(), encoding="utf-8")
