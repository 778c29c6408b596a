"""docs/evidence.md is rendered from stored results: a table per result, no ratio from saturated runs."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from planner_service.cli import app
from planner_service.sim.seeds import METRICS
from planner_service.sim.state import SWITCH_PARTS


def stored(policies: dict[str, float], saturated: dict[str, int]) -> dict:
    """A stored study: each policy's hand-off P95 mean as given, 100 GiB, done P95 10 s, 2 seeds."""

    def interval(mean: float) -> dict:
        return {"mean": mean, "low": mean - 1, "high": mean + 1, "half_width": 1.0, "n": 2}

    metrics = {}
    for name, handoff in policies.items():
        metrics[name] = {key: interval(0.0) for key, _, _ in METRICS}
        metrics[name]["handoff_p95_seconds"] = interval(handoff)
        metrics[name]["gpu_gib_mean"] = interval(100.0)
        metrics[name]["completion_p95_seconds"] = interval(10.0)
    return {
        "policies": list(policies),
        "seeds": [1, 2],
        "train_seeds": [101],
        "trace": {"sessions": 5, "hours": 0.25, "users": 10},
        "interval": "95 % Student t over seeds",
        "metrics": metrics,
        "saturated_runs": saturated,
        "runs": {},
        "static_tuned_search": None,
    }


def render(tmp_path: Path, data: dict) -> str:
    (tmp_path / "case.json").write_text(json.dumps(data))
    out = tmp_path / "evidence.md"
    result = CliRunner().invoke(app, ["study", "evidence", str(tmp_path / "case.json"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out.read_text()


def test_the_ratio_against_the_best_baseline(tmp_path: Path) -> None:
    page = render(tmp_path, stored({"statebudget": 5.0, "sleep-router": 10.0, "swap-ttl": 30.0}, {
        "statebudget": 0, "sleep-router": 0, "swap-ttl": 0}))  # fmt: skip
    assert "## case" in page and "| statebudget | 5.00 ± 1.00 |" in page
    assert "statebudget / sleep-router: hand-off P95 0.50, GPU memory-time 1.00: goal reached" in page


def test_no_ratio_from_a_saturated_run(tmp_path: Path) -> None:
    page = render(tmp_path, stored({"statebudget": 5.0, "sleep-router": 10.0}, {"statebudget": 1, "sleep-router": 0}))
    assert "No ratio is quoted" in page and "goal reached" not in page


def test_missing_results_are_a_clear_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["study", "evidence", str(tmp_path / "nope.json"), "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "results:" in result.output


def test_the_stored_quick_result_renders(tmp_path: Path) -> None:
    data = json.loads((Path(__file__).parents[2] / "docs" / "evidence" / "demo-quick.json").read_text())
    page = render(tmp_path, data)
    levels = data.get("levels", [data])  # `make evidence-quick` stores its load levels
    assert levels and all(f"| {policy} | " in page for level in levels for policy in level["policies"])
    assert "static-tuned: trained on seeds 101" in page


def test_a_load_study_renders_a_load_table_and_each_level(tmp_path: Path) -> None:
    light = stored({"statebudget": 5.0, "sleep-router": 10.0}, {"statebudget": 0, "sleep-router": 0})
    heavy = stored({"statebudget": 50.0, "sleep-router": 20.0}, {"statebudget": 2, "sleep-router": 1})
    light["trace"]["gap_scale"], heavy["trace"]["gap_scale"] = 8.0, 2.0
    page = render(tmp_path, {"scenario": "exceeds-hbm", "precision": "native", "levels": [light, heavy]})
    assert "Scenario `exceeds-hbm`. Precision held equal" in page
    assert "| 5 sessions, gap ×8 | 5.00 ± 1.00 | 10.00 ± 1.00 |" in page
    assert "| 5 sessions, gap ×2 | 50.00 ± 1.00 (sat 2/2) | 20.00 ± 1.00 (sat 1/2) |" in page
    assert "### case: 5 sessions, gap ×8" in page and "### case: 5 sessions, gap ×2" in page
    assert page.count("goal reached") == 1 and page.count("No ratio is quoted") == 1


def test_failed_requests_and_where_the_hand_off_latency_goes_are_rendered(tmp_path: Path) -> None:
    data = stored({"statebudget": 5.0, "sleep-router": 10.0}, {"statebudget": 0, "sleep-router": 0})
    data["metrics"]["sleep-router"]["failed_requests"]["mean"] = 3.0
    parts = {p: 0.0 for p in SWITCH_PARTS}
    data["handoff_switch_parts"] = {
        "statebudget": {"tail": {**parts, "cold_start": 30.0, "reprefill": 2.5}, "mean": {**parts, "reprefill": 1.0}},
        "sleep-router": {"tail": {**parts, "wake": 0.5, "reprefill": 9.5}, "mean": {**parts, "reprefill": 2.0}},
    }
    page = render(tmp_path, data)
    assert "failed requests |" in page and "| 3.00 ± 1.00 | 0 / 2 |" in page
    assert "| statebudget | ≥ P95 | 0.00 | 30.00 | 0.00 | 0.00 | 0.00 | 0.00 | 2.50 | 32.50 |" in page
    assert "| sleep-router | all | 0.00 | 0.00 | 0.00 | 0.00 | 0.00 | 0.00 | 2.00 | 2.00 |" in page


def test_a_stored_result_without_the_newer_columns_renders_a_dash(tmp_path: Path) -> None:
    data = stored({"statebudget": 5.0, "sleep-router": 10.0}, {"statebudget": 0, "sleep-router": 0})
    for metrics in data["metrics"].values():
        del metrics["failed_requests"]
    page = render(tmp_path, data)
    assert "| — | 0 / 2 |" in page and "Where the hand-off latency goes" not in page


def test_findings_are_appended_and_a_missing_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "case.json").write_text(json.dumps(stored({"statebudget": 5.0}, {"statebudget": 0})))
    (tmp_path / "findings.md").write_text("## Findings\n\nThe tail is cold starts.\n")
    out = tmp_path / "evidence.md"
    args = ["study", "evidence", str(tmp_path / "case.json"), "--out", str(out), "--findings"]
    result = CliRunner().invoke(app, [*args, str(tmp_path / "findings.md")])
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert page.index("## case") < page.index("## Findings") and page.endswith("The tail is cold starts.\n")
    missing = CliRunner().invoke(app, [*args, str(tmp_path / "nope.md")])
    assert missing.exit_code == 2 and "--findings" in missing.output


def test_the_readme_headline_is_generated_between_its_markers(tmp_path: Path) -> None:
    from planner_service.sim.evidence import README_BEGIN, README_END

    data = stored(
        {"statebudget": 5.0, "sleep-router": 10.0, "swap-ttl": 30.0},
        {"statebudget": 0, "sleep-router": 1, "swap-ttl": 0},
    )
    (tmp_path / "exceeds-hbm.json").write_text(json.dumps({"scenario": "exceeds-hbm", "precision": "native",
                                                          "levels": [data]}))  # fmt: skip
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\n{README_BEGIN}\nstale\n{README_END}\n\nAfter.\n")
    args = ["study", "evidence", str(tmp_path / "exceeds-hbm.json"), "--out", str(tmp_path / "e.md")]
    result = CliRunner().invoke(app, [*args, "--readme", str(readme)])
    assert result.exit_code == 0, result.output
    text = readme.read_text()
    assert "stale" not in text and text.startswith("# Title") and text.endswith("After.\n")
    row = "| exceeds-hbm: 5 sessions, gap ×1 | 5.0 ± 1.0 | — | 10.0 ± 1.0 | 30.0 ± 1.0 | — | 1.00 × `sleep-router` |"
    assert row + " sleep-router 1/2 |" in text
    readme.write_text("# No markers\n")
    result = CliRunner().invoke(app, [*args, "--readme", str(readme)])
    assert result.exit_code == 2 and "evidence-headline" in result.output


def test_the_readme_headline_is_the_stored_results() -> None:
    """`make evidence` wrote README.md's headline from docs/evidence/*.json as they are committed."""
    from planner_service.sim.evidence import README_BEGIN, README_END, headline

    root = Path(__file__).parents[2]
    readme = (root / "README.md").read_text()
    block = readme[readme.index(README_BEGIN) + len(README_BEGIN) : readme.index(README_END)]
    assert block.strip() == headline(sorted((root / "docs" / "evidence").glob("*.json"))).strip()
