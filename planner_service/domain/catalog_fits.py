"""The catalog-fits scenario: the demo's catalog on cards whose HBM holds every model warm with room for KV.

The demo (`demo.py`) keeps about 880 GiB of weights and routed experts at its models' preferred
precisions on about 500 GiB of HBM, so every policy must choose what to keep warm. This scenario keeps
the demo's seven models, hand-off prior, engines, residency and nodes (the same host DRAM and NVMe)
and gives the nodes larger cards, so that the question it asks is the opposite one: when nothing has
to leave the GPUs, does a policy still pay for moving things?

- n1: eight H200 SXM (141 GB) instead of four L40s: the reasoner (DeepSeek-V3 at fp8, 15.9 GiB of
  weights and 609 GiB of routed experts) fits on one node's group with about 480 GiB for KV;
- n2, n3, n4: four A100 80GB PCIe each instead of the A100 40GB and RTX 3090 cards.

Card figures are the GPU presets' (`hardware.py`, from ../shared/data/gpus.json): A100 80GB PCIe
80 GiB (ai-dynamo/aiconfigurator systems/a100_pcie.yaml), H200 SXM 140.4 GiB usable (a typical
nvidia-smi total; the nominal 141 GB and 4.8 TB/s are aiconfigurator's h200_sxm.yaml). HBM:
8 x 140.4 + 12 x 80 = 2,083 GiB, less 2 GiB reserved per card, against 878 GiB of weights and
experts; a test recomputes both and checks that each model also fits on the cards of one node with
room for KV, and all of them at once.
"""

from __future__ import annotations

from typing import Any

from planner_service.domain.demo import demo_scenario_json
from planner_service.domain.scenario import Scenario, parse_scenario

# node -> (card preset, cards): the demo's nodes with larger cards
CARDS: dict[str, tuple[str, int]] = {
    "n1": ("h200", 8),
    "n2": ("a100-80gb-pcie", 4),
    "n3": ("a100-80gb-pcie", 4),
    "n4": ("a100-80gb-pcie", 4),
}


def catalog_fits_scenario_json() -> dict[str, Any]:
    data = demo_scenario_json()
    for node in data["cluster"]["nodes"]:
        preset, count = CARDS[node["id"]]
        reserved = node["gpus"][0]["reserved_bytes"]
        node["gpus"] = [{"id": f"{node['id']}-g{i}", "type": preset, "reserved_bytes": reserved} for i in range(count)]
    return data


def catalog_fits_scenario() -> Scenario:
    return parse_scenario(catalog_fits_scenario_json())
