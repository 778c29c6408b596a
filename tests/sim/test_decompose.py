"""The decomposition ladder: each rung over the same seeds, each step's effect paired by seed."""

from __future__ import annotations

import itertools

import pytest

from planner_service.domain.demo import demo_scenario
from planner_service.domain.problem import native_precision_scenario
from planner_service.sim import decompose
from planner_service.sim.evidence import render_section
from planner_service.sim.synth import SynthParams

PARAMS = SynthParams(sessions=3, hours=0.1, arrival_spread_seconds=60.0, departure_spread_seconds=60.0, gap_scale=8)


@pytest.fixture(scope="module")
def level() -> dict:
    return decompose.decompose(native_precision_scenario(demo_scenario()), PARAMS, [1, 2], [101], tune_budget=3)


def test_every_rung_runs_every_seed_and_each_step_is_the_paired_difference(level: dict) -> None:
    rungs = level["rungs"]
    assert [r["label"] for r in rungs] == [r.label for r in decompose.LADDER]
    assert [r["policy"] for r in rungs] == ["static-tuned", "statebudget-groups", "statebudget-groups", "statebudget"]
    assert rungs[0]["effect"] is None
    for below, rung in itertools.pairwise(rungs):
        for key, _, _ in decompose.EFFECT_METRICS:
            assert len(rung["runs"][key]) == 2
            paired = [a - b for a, b in zip(rung["runs"][key], below["runs"][key], strict=True)]
            assert rung["effect"][key]["mean"] == pytest.approx(sum(paired) / 2)
            assert rung["effect"][key]["mean"] == pytest.approx(
                rung["metrics"][key]["mean"] - below["metrics"][key]["mean"]
            )


def test_the_stored_decomposition_renders_a_row_per_rung(level: dict) -> None:
    data = {"kind": "decomposition", "scenario": "demo", "precision": "native", "levels": [level]}
    page = render_section("decomposition", data)
    for rung in decompose.LADDER:
        assert f"| {rung.label} |" in page
    assert "### decomposition: 3 sessions, gap ×8" in page


def test_training_seeds_must_not_be_reported() -> None:
    with pytest.raises(ValueError, match="train"):
        decompose.decompose(native_precision_scenario(demo_scenario()), PARAMS, [1, 2], [2], tune_budget=3)


def test_the_cli_stores_a_decomposition_evidence_renders_and_names_bad_options() -> None:
    import json

    from typer.testing import CliRunner

    from planner_service.cli import app

    args = ["study", "decompose", "--seeds", "1,2", "--train-seeds", "101", "--sessions", "2", "--hours", "0.1"]
    result = CliRunner().invoke(app, [*args, "--gap-scale", "8", "--tune-budget", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["kind"], data["scenario"], data["precision"]) == ("decomposition", "demo", "native")
    assert "| + switch prediction |" in render_section("decomposition", data)
    result = CliRunner().invoke(app, ["study", "decompose", "--seeds", "1,2", "--train-seeds", "2"])
    assert result.exit_code == 2 and "train_seeds" in result.output
    result = CliRunner().invoke(app, ["study", "decompose", "--precision", "best"])
    assert result.exit_code == 2 and "--precision" in result.output
