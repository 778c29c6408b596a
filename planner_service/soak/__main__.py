"""`python -m planner_service.soak`: every reliability trial, `docs/reliability.md`, and a summary."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from planner_service.soak.faults import run_faults
from planner_service.soak.fuzz import run_fuzz
from planner_service.soak.report import Results, render, summary
from planner_service.soak.trials import (
    KillConfig,
    LoadConfig,
    run_kill_trials,
    run_load,
    write_large_scenario,
)

ROOT = Path(__file__).resolve().parents[2]
app = typer.Typer(add_completion=False)


@app.command()
def soak(
    duration_seconds: Annotated[float, typer.Option(min=1, max=86400, help="Steady load on the demo.")] = 600.0,
    large_duration_seconds: Annotated[
        float, typer.Option(min=0, max=86400, help="Steady load on the generated cluster (0: skip).")
    ] = 600.0,
    large_nodes: Annotated[int, typer.Option(min=1, max=500, help="Nodes of the generated cluster.")] = 50,
    trials: Annotated[int, typer.Option(min=0, max=10_000, help="SIGKILL trials (0: skip).")] = 50,
    faults: Annotated[bool, typer.Option(help="Run the fault cases.")] = True,
    fuzz_examples: Annotated[
        int, typer.Option(min=0, max=100_000, help="schemathesis examples per operation and phase (0: skip).")
    ] = 50,
    fuzz_stateful_examples: Annotated[
        int, typer.Option(min=1, max=100_000, help="schemathesis stateful scenarios per run.")
    ] = 200,
    out: Annotated[Path | None, typer.Option(help="Write the report here.")] = ROOT / "docs" / "reliability.md",
    workdir: Annotated[
        Path | None, typer.Option(help="Keep databases and logs here (default: a temporary folder, removed).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of every random choice of the load.")] = 0,
) -> None:
    """Run the reliability trials against `statebudget serve` on loopback and write the report."""
    began = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="statebudget-soak-")) if workdir is None else workdir
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        loads = [run_load(LoadConfig("demo", duration_seconds=duration_seconds, rng_seed=seed), scratch)]
        typer.echo(summary(Results(loads, None, [], 0.0))[-1])
        if large_duration_seconds > 0:
            scenario = write_large_scenario(scratch / f"cluster-{large_nodes}.json", large_nodes, seed)
            config = LoadConfig(
                f"{large_nodes}-nodes",
                seed=("--scenario", str(scenario)),
                duration_seconds=large_duration_seconds,
                agents_per_node=1,
                rng_seed=seed + 1,
            )
            loads.append(run_load(config, scratch))
            typer.echo(summary(Results(loads[-1:], None, [], 0.0))[-1])
        kill = run_kill_trials(KillConfig(trials=trials, rng_seed=seed + 2), scratch) if trials > 0 else None
        cases = run_faults(scratch) if faults else []
        fuzz = []
        if fuzz_examples > 0:
            fuzz = run_fuzz(
                scratch, examples=fuzz_examples, stateful_examples=fuzz_stateful_examples, stateful_steps=10, seed=seed
            )
        results = Results(loads, kill, cases, time.monotonic() - began, fuzz)
    finally:
        if workdir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    if out is not None:
        out.write_text(render(results, ROOT))
        typer.echo(f"wrote {out}")
    typer.echo("\n".join(summary(results)))
    raise typer.Exit(0 if results.ok else 1)


if __name__ == "__main__":
    app()
