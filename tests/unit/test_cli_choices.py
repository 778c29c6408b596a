"""The command line's fixed choices are enums: `--help` lists them and a wrong one is refused by name."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from planner_service.cli import app
from planner_service.sim.importers import TraceFormat
from planner_service.sim.policies.base import PolicyName
from planner_service.wire.enums import SolverName

WIDE = {"COLUMNS": "250"}  # rich folds a long `<a|b|c>` inside its table column otherwise


def flat(text: str) -> str:
    """Help text in one line, without rich's boxes and spaces."""
    return "".join(ch for ch in text if ch not in " \n│╭╮╰╯─")


@pytest.mark.parametrize(
    ("command", "choices"),
    [(["plan"], SolverName), (["bench", "plan"], SolverName), (["trace", "import"], TraceFormat)],
    ids=["plan", "bench plan", "trace import"],
)
def test_help_lists_the_choices(command: list[str], choices: type) -> None:
    result = CliRunner().invoke(app, [*command, "--help"], env=WIDE)
    assert result.exit_code == 0
    assert "<" + "|".join(c.value for c in choices) + ">" in flat(result.output)


def test_replay_help_lists_the_policies() -> None:
    result = CliRunner().invoke(app, ["replay", "--help"], env=WIDE)
    assert result.exit_code == 0 and ",".join(p.value for p in PolicyName) in flat(result.output)


def test_an_unknown_solver_is_refused_with_the_choices() -> None:
    result = CliRunner().invoke(app, ["plan", "--solver", "simplex"])
    assert result.exit_code == 2
    assert "simplex" in result.output and all(s.value in result.output for s in SolverName)
