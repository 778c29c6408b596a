"""The catalog-fits scenario: the demo's catalog on larger cards, every model warm at once with room for KV."""

from __future__ import annotations

from typer.testing import CliRunner

from planner_service.cli import app
from planner_service.domain.catalog_fits import catalog_fits_scenario
from planner_service.domain.demo import demo_scenario
from planner_service.domain.hardware import gpu_preset
from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.units import GIB


def _warm_bytes(problem) -> dict[str, int]:
    """Each model's weights at its preferred precision plus its routed experts."""
    return {m.id: m.weights_bytes[m.preferred] + m.experts_bytes for m in problem.models.values()}


def test_the_demos_catalog_and_nodes_on_larger_cards() -> None:
    fits, demo = problem_from_scenario(catalog_fits_scenario()), problem_from_scenario(demo_scenario())
    assert _warm_bytes(fits) == _warm_bytes(demo)
    assert sorted(fits.nodes) == sorted(demo.nodes)
    assert {g.type for g in fits.gpus.values()} == {"h200", "a100-80gb-pcie"}
    hbm = sum(gpu_preset(g.type).hbm_bytes for g in fits.gpus.values())
    assert hbm == int(140.4 * GIB) * 8 + 12 * 80 * GIB  # hardware.py's presets


def test_every_model_fits_warm_at_once_with_room_for_kv() -> None:
    problem = problem_from_scenario(catalog_fits_scenario())
    warm = _warm_bytes(problem)
    usable = {n: sum(g.capacity_bytes for g in problem.gpus.values() if g.node == n) for n in problem.nodes}
    assert sum(warm.values()) < 0.5 * sum(usable.values())  # the whole catalog in under half the HBM
    # the largest model (DeepSeek-V3 with its experts, 625 GiB) on one node with a quarter of it left for KV
    assert max(warm.values()) < 0.75 * max(usable.values())
    demo = problem_from_scenario(demo_scenario())
    assert sum(warm.values()) > sum(g.capacity_bytes for g in demo.gpus.values())  # the demo's cannot


def test_the_cli_knows_it_by_name() -> None:
    result = CliRunner().invoke(app, ["plan", "--scenario", "catalog-fits", "--json"])
    assert result.exit_code == 0, result.output
