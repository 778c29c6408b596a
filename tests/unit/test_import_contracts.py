"""The import contracts in pyproject.toml (`[tool.importlinter]`): each holds, each covers every package,
and each breaks when a forbidden import is added."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROOT_PACKAGES = ("planner_service", "clients")


def lint_imports_command() -> list[str]:
    found = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert found, "lint-imports is not installed (pip install '.[lint]')"
    return [found, "--no-logo", "--no-cache"]


def contracts() -> list[dict[str, Any]]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]["contracts"]


def lint_imports(cwd: Path, *contract_ids: str) -> subprocess.CompletedProcess[str]:
    """`lint-imports` in `cwd`, on the packages found there first (wide lines: a contract's name stays whole)."""
    command = lint_imports_command() + [arg for cid in contract_ids for arg in ("--contract", cid)]
    env = {**os.environ, "PYTHONPATH": str(cwd), "COLUMNS": "400"}
    return subprocess.run(command, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("contract", contracts(), ids=lambda c: c["id"])
def test_contract_is_kept(contract: dict[str, Any]) -> None:
    result = lint_imports(ROOT, contract["id"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{contract['name']} KEPT" in result.stdout


def modules_under(root: str) -> list[str]:
    """Every package and module of a root package, dotted (`planner_service.sim.policies.base`)."""
    names = []
    for path in sorted((ROOT / root).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def layered_modules() -> set[str]:
    """The modules named in a layers contract (`a | b` and `a : b` name two; `(a)` an optional one)."""
    named = set()
    for contract in contracts():
        if contract["type"] == "layers":
            for layer in contract["layers"]:
                named |= {m.strip("() ") for m in re.split(r"[|:]", layer)}
    return named


def unplaced(modules: list[str], named: set[str]) -> list[str]:
    """The modules neither named in a layer nor inside a package that is (a root package names nothing)."""
    return [
        module
        for module in modules
        if module not in ROOT_PACKAGES
        and not any(".".join(module.split(".")[:depth]) in named for depth in range(2, module.count(".") + 2))
    ]


@pytest.mark.parametrize("root", ROOT_PACKAGES)
def test_every_package_has_a_layer(root: str) -> None:
    missing = unplaced(modules_under(root), layered_modules())
    assert not missing, f"give these a layer in pyproject.toml [tool.importlinter]: {missing}"


def test_a_package_without_a_layer_is_found() -> None:
    modules = ["clients", "clients.proxy", "clients.proxy.app", "clients.sdk.client", "planner_service.sim.floor"]
    assert unplaced(modules, layered_modules()) == ["clients.proxy", "clients.proxy.app"]


# (module edited, the line added to it, the contract it breaks, the import it reports)
FORBIDDEN = [
    pytest.param(
        "planner_service/domain/units.py",
        "import planner_service.api.app",
        "layers",
        "planner_service.domain.units -> planner_service.api.app",
        id="domain-imports-api",
    ),
    pytest.param(
        "planner_service/planner/plan.py",
        "from planner_service.solver import milp",
        "layers",
        "planner_service.planner.plan -> planner_service.solver.milp",
        id="planner-imports-solver",
    ),
    pytest.param(
        "planner_service/sim/report.py",
        "import planner_service.service.store",
        "layers",
        "planner_service.sim.report -> planner_service.service.store",
        id="sim-imports-service",
    ),
    pytest.param(
        "planner_service/solver/gap.py",
        "import fastapi",
        "core",
        "planner_service.solver.gap -> fastapi",
        id="core-imports-fastapi",
    ),
    pytest.param(
        "planner_service/planner/costs.py",
        "import planner_service.metrics",
        "core",
        "planner_service.planner.costs -> planner_service.metrics",
        id="core-imports-metrics",
    ),
    pytest.param(
        "clients/sdk/client.py",
        "import planner_service.planner.plan",
        "clients",
        "clients.sdk.client -> planner_service.planner.plan",
        id="sdk-imports-planner",
    ),
    pytest.param(
        "clients/sdk/errors.py",
        "import clients.agent.runner",
        "agent-sdk",
        "clients.sdk.errors -> clients.agent.runner",
        id="sdk-imports-agent",
    ),
    pytest.param(
        "planner_service/sim/executor.py",
        "import planner_service.sim.policies.base",
        "no-circles",
        ".executor -> .policies",
        id="executor-and-policies-circle",
    ),
]


@pytest.mark.parametrize(("path", "line", "contract_id", "reported"), FORBIDDEN)
def test_a_forbidden_import_breaks_its_contract(
    tmp_path: Path, path: str, line: str, contract_id: str, reported: str
) -> None:
    for root in ROOT_PACKAGES:
        shutil.copytree(ROOT / root, tmp_path / root, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    edited = tmp_path / path
    edited.write_text(edited.read_text() + f"\n{line}\n")

    result = lint_imports(tmp_path, contract_id)

    (contract,) = [c for c in contracts() if c["id"] == contract_id]
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{contract['name']} BROKEN" in result.stdout
    assert reported in result.stdout, result.stdout
