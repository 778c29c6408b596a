"""The compiled build (setup.py, `STATEBUDGET_COMPILE=1`, what the Docker image ships): a real mypyc build
of the wheel, whose planner modules are C extensions and make the same plans as the pure Python sources."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _compiled_modules() -> list[str]:
    """setup.py's COMPILED list, read without running setup()."""
    for node in ast.parse((REPO / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["COMPILED"]:
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no COMPILED list")


COMPILED = _compiled_modules()

# Prints one line per plan: which files the compiled modules came from, then each plan's objective,
# placement and operations (every field) for the demo and random scenarios of three sizes. Each problem and
# plan must also cross to the planning worker and back as it was (`service/solving.py`).
PLANS = """
import hashlib, importlib, json, sys
from multiprocessing.reduction import ForkingPickler
import numpy as np
import planner_service.service.solving  # how compiled frozen dataclasses pickle
from planner_service.domain.demo import demo_scenario
from planner_service.domain.generate import random_scenario
from planner_service.domain.state import placement_to_json
from planner_service.domain.predictions import problem_from_scenario
from planner_service.solver.registry import default_registry

modules = [path[:-3].replace("/", ".") for path in sys.argv[1:]]
print(sorted(importlib.import_module(m).__file__.rsplit(".", 1)[-1] for m in modules))
solve = default_registry().get("greedy")
scenarios = [demo_scenario()] + [
    random_scenario(np.random.default_rng(seed), gpus, models, sessions)
    for seed in range(6) for gpus, models, sessions in ((8, 5, 20), (16, 7, 100), (64, 16, 500))
]
for scenario in scenarios:
    problem = problem_from_scenario(scenario)
    plan = solve(problem)
    assert ForkingPickler.loads(ForkingPickler.dumps(problem)) == problem
    assert ForkingPickler.loads(ForkingPickler.dumps(plan)) == plan
    operations = [
        (o.id, o.action.value, o.object.label(), o.source, o.dest, o.bytes, o.priority.value,
         tuple(o.depends_on), round(o.estimated_seconds, 9), o.reason)
        for o in plan.operations
    ]
    placement = json.dumps(placement_to_json(plan.placement))
    digest = hashlib.sha256((placement + repr(operations)).encode()).hexdigest()[:16]
    print(f"{plan.objective.total:.9f} {len(plan.operations)} {digest}")
"""


def _plans(python_path: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(python_path)}
    done = subprocess.run(
        [sys.executable, "-c", PLANS, *COMPILED],
        env=env,
        cwd=python_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_compiled_wheel_makes_the_same_plans(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("planner_service", "clients"):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    env = {**os.environ, "STATEBUDGET_COMPILE": "1"}
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-build-isolation",
            "--no-deps",
            "-w",
            str(tmp_path / "dist"),
            ".",
        ],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (tmp_path / "dist").glob("statebudget-*.whl")
    installed = tmp_path / "installed"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(installed)
        extensions = [n for n in archive.namelist() if n.endswith(".so")]
    assert len(extensions) >= len(COMPILED), extensions  # a shim per module beside the shared library

    compiled, pure = _plans(installed), _plans(REPO)
    assert compiled[0] == str(["so"] * len(COMPILED)), "the compiled modules were not the ones imported"
    assert pure[0] == str(["py"] * len(COMPILED))
    assert len(compiled) == 1 + 1 + 18
    assert compiled[1:] == pure[1:]
