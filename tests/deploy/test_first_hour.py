"""What a new user meets first: `make run` installs only what serving needs and starts the demo afresh,
`make fake-agents` runs agents on fake engines for that planner, `make clean` removes the demo's database,
`serve --reset` deletes a database before starting, and CI still runs the compiled-build comparison that
`make test` leaves to `make test-compiled`."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

from planner_service.cli import delete_database

REPO = Path(__file__).resolve().parents[2]


def dry_run(*target: str) -> list[str]:
    """The commands `make -n` would run, as if no stamp existed yet."""
    out = subprocess.run(
        ["make", "-n", "-B", "VENV=/nonexistent/venv", *target], cwd=REPO, capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


def test_make_run_installs_no_extras_and_starts_a_fresh_demo() -> None:
    commands = dry_run("run")
    installs = [c for c in commands if "pip install" in c and "--upgrade pip" not in c]
    assert installs and all("[" not in c for c in installs), installs  # `-e .`: no test, lint or compile extras
    (serve,) = [c for c in commands if " serve " in c]
    assert "--demo" in serve and "--reset" in serve and "--db statebudget-demo.db" in serve
    (kept,) = [c for c in dry_run("run", "KEEP=1") if " serve " in c]
    assert "--reset" not in kept


def test_make_fake_agents_works_for_the_make_run_planner() -> None:
    (line,) = [c for c in dry_run("fake-agents") if "demo_cluster.py" in c]
    assert "--server http://127.0.0.1:8080" in line and "--hour-seconds 300" in line
    (other,) = [c for c in dry_run("fake-agents", "PLANNER=http://10.0.0.5:8080") if "demo_cluster.py" in c]
    assert "--server http://10.0.0.5:8080" in other


def test_make_clean_removes_the_demo_database() -> None:
    (line,) = [c for c in dry_run("clean") if "statebudget-demo.db" in c]
    assert line.startswith("rm -f") and "statebudget-demo.db-wal" in line


def test_make_test_leaves_the_compiled_build_to_its_own_target_and_ci_runs_both() -> None:
    (test,) = [c for c in dry_run("test") if "pytest" in c]
    assert "--ignore=tests/deploy/test_compiled_build.py" in test
    (compiled,) = [c for c in dry_run("test-compiled") if "pytest" in c]
    assert compiled.endswith("tests/deploy/test_compiled_build.py")
    ci = (REPO / ".ci" / "run").read_text()
    assert ci.index("make test\n") < ci.index("make test-compiled")


def test_reset_deletes_the_database_and_its_journal_and_says_so(tmp_path, caplog) -> None:
    db = tmp_path / "state.db"
    for path in (db, tmp_path / "state.db-wal", tmp_path / "state.db-shm"):
        path.write_bytes(b"x")
    with caplog.at_level(logging.INFO, logger="planner_service"):
        delete_database(db)
    assert not list(tmp_path.iterdir())
    assert "--reset: deleted the database" in caplog.text and "state.db-wal" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="planner_service"):
        delete_database(db)
    assert "no database at" in caplog.text
