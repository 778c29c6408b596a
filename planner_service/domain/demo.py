"""The embedded demo scenario: the cluster and agent catalog StateBudget is built for.

Four nodes, 16 PCIe GPUs (4x L40, 4x A100 40GB, 8x RTX 3090: about 530 GiB of
HBM) and seven models whose weights and routed experts need about 860 GiB, so
memory pressure is the normal case. Every node keeps every checkpoint on NVMe and
serves every model through vLLM with LMCache, sleep mode and dev mode (the way a
team runs it: an engine per model, started, put to sleep and woken by the planner);
the engines already placed keep their tensor-parallel groups.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from planner_service.domain.scenario import Scenario, parse_scenario


def demo_scenario_json() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        resources.files("planner_service.data").joinpath("demo_scenario.json").read_text()
    )
    return data


def demo_scenario() -> Scenario:
    return parse_scenario(demo_scenario_json())
