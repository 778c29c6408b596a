"""`statebudget serve` as a command: help lists every setting, a bad seed fails before listening."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from planner_service.settings import Settings


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "planner_service.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"},
        check=False,
    )


def test_help_documents_every_setting():
    out = run("--help")
    assert out.returncode == 0, out.stderr
    for name in Settings.model_fields:
        assert f"STATEBUDGET_{name.upper()}" in out.stdout, name
    for option in ("--scenario", "--demo", "--host", "--port", "--db"):
        assert option in out.stdout


def test_bad_seed_scenario_fails_with_exit_2_naming_the_field(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: {nodes: []}\nmodels: []\n")
    out = run("--scenario", str(bad), "--db", str(tmp_path / "x.db"))
    assert out.returncode == 2
    assert "cluster.nodes" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "x.db").exists()


def test_scenario_and_demo_together_are_refused(tmp_path: Path):
    out = run("--scenario", "x.yaml", "--demo", "--db", str(tmp_path / "x.db"))
    assert out.returncode == 2 and "not both" in out.stderr
