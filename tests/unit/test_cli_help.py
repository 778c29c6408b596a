"""`--help` of both command lines: real flag syntax (`--demo`, `--a / --no-a`, never a `<bool>` metavar), the
choices of every enum option, and every default; a wrong value is one clear line that lists the choices."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from clients.agent.cli import app as agent_app
from planner_service.cli import app as statebudget_app

WIDE = {"COLUMNS": "250"}


def commands(app: typer.Typer) -> Iterator[tuple[list[str], Any]]:
    """Every command of `app` (subcommands of groups included), with the words that invoke it."""
    todo: list[tuple[list[str], Any]] = [([], typer.main.get_command(app))]
    while todo:
        words, command = todo.pop()
        if hasattr(command, "commands"):
            todo += [([*words, name], sub) for name, sub in command.commands.items()]
        else:
            yield words, command


def option_entries(help_text: str) -> dict[str, str]:
    """The Options section of a help page: an option's first name -> its whole entry (names, value, help)."""
    section = help_text.split("Options:\n", 1)[1]
    entries: dict[str, str] = {}
    current = None
    for line in section.splitlines():
        if not line.strip():
            break
        if match := re.match(r"^  (-\w, )?(--[\w-]+)", line):
            current = match.group(2)
            entries[current] = line
        elif current is not None:
            entries[current] += " " + line.strip()
    return entries


CASES = [
    pytest.param(app, words, command, id=" ".join([name, *words]))
    for name, app in (("statebudget", statebudget_app), ("statebudget-agent", agent_app))
    for words, command in commands(app)
]


@pytest.mark.parametrize(("app", "words", "command"), CASES)
def test_help_shows_flags_choices_and_defaults(app: typer.Typer, words: list[str], command: Any) -> None:
    result = CliRunner().invoke(app, [*words, "--help"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output
    entries = option_entries(result.output)
    for param in command.params:
        name = next((o for o in param.opts if o.startswith("--")), None)
        if name is None:  # a positional argument: listed under Arguments, with no flag syntax to check
            continue
        entry = entries[name]
        if param.is_flag:
            names = " / ".join([*param.opts, *param.secondary_opts])
            assert re.match(rf"^\s*{re.escape(names)}(\s|$)", entry), entry  # the flag alone: no value after it
        if param.type_descriptor.is_choice:
            assert "<" + "|".join(str(c.value) for c in param.type_descriptor.choices) + ">" in entry
        if param.default is not None and not param.required and not (param.is_flag and not param.secondary_opts):
            assert "default:" in entry, entry


def test_serve_takes_demo_and_reset_as_plain_flags() -> None:
    help_text = CliRunner().invoke(statebudget_app, ["serve", "--help"], env=WIDE).output
    assert "--demo " in help_text and "--reset " in help_text and "<bool>" not in help_text


def test_the_agent_lists_its_executors_and_refuses_an_unknown_one_in_a_line() -> None:
    help_text = CliRunner().invoke(agent_app, ["run", "--help"], env=WIDE).output
    assert "--executor <local|vllm|sglang>" in help_text
    bad = CliRunner().invoke(agent_app, ["run", "--node", "n1", "--executor", "tgi"])
    assert bad.exit_code == 2
    (line,) = [line for line in bad.output.splitlines() if "tgi" in line]
    assert all(name in line for name in ("local", "vllm", "sglang"))
    assert "pydantic" not in bad.output and "http" not in bad.output


def test_a_bad_configuration_file_is_one_line_per_field_without_links(tmp_path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("node_id: n1\nexecutor: tgi\nscale: 5\n")
    bad = CliRunner().invoke(agent_app, ["run", "--config", str(path)])
    assert bad.exit_code == 2
    (line,) = bad.output.strip().splitlines()
    assert line.startswith("invalid agent configuration: executor:") and "'tgi'" in line and "scale:" in line
    assert all(name in line for name in ("local", "vllm", "sglang"))
    assert "errors.pydantic.dev" not in bad.output and "validation error" not in bad.output
