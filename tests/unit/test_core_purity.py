"""The core (domain, planner, solver, sim) never imports web, HTTP or metrics libraries."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "planner_service"
CORE = ("domain", "planner", "solver", "sim")
FORBIDDEN = {"fastapi", "starlette", "httpx", "uvicorn", "prometheus_client", "requests"}


def core_files():
    for part in CORE:
        yield from sorted((PACKAGE / part).rglob("*.py"))


@pytest.mark.parametrize("path", list(core_files()), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_core_module_imports_no_web_or_metrics(path: Path) -> None:
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert not imported & FORBIDDEN, f"{path.name} imports {sorted(imported & FORBIDDEN)}"


def test_domain_does_not_import_upper_layers() -> None:
    for path in sorted((PACKAGE / "domain").rglob("*.py")):
        text = path.read_text()
        for layer in (
            "planner_service.planner",
            "planner_service.service",
            "planner_service.api",
            "planner_service.sim",
        ):
            assert layer not in text, f"{path.name} imports {layer}"
