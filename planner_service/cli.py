"""The `statebudget` command line.

Results go to stdout (JSON with `--json`, else readable tables); logs and
errors go to stderr. Exit status 2 means the input cannot be planned (a
malformed scenario, or a constraint that cannot hold): the message names it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from planner_service.domain.demo import demo_scenario
from planner_service.domain.scenario import Scenario, ScenarioError, load_scenario
from planner_service.domain.state import Tier
from planner_service.planner.plan import Plan
from planner_service.planner.predictor import problem_from_scenario
from planner_service.planner.registry import default_registry

app = typer.Typer(no_args_is_help=True, add_completion=False, help="StateBudget: plan where LLM state lives.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print figures.")
app.add_typer(bench_app, name="bench")

out = Console()
err = Console(stderr=True)

ScenarioOpt = Annotated[Path | None, typer.Option("--scenario", help="Scenario file (JSON or YAML); default: the demo.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]


def fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False, markup=True)
    return typer.Exit(code)


def read_scenario(path: Path | None) -> Scenario:
    if path is None:
        return demo_scenario()
    try:
        return load_scenario(path)
    except ScenarioError as error:
        raise fail(f"{path}: invalid scenario\n{error}") from None


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


@app.command()
def plan(
    scenario: ScenarioOpt = None,
    solver: Annotated[str, typer.Option(help="greedy (online default) or milp (exact oracle).")] = "greedy",
    time_limit: Annotated[float, typer.Option("--time-limit", help="MILP time limit in seconds.")] = 60.0,
    seed: Annotated[int, typer.Option(help="MILP random seed.")] = 0,
    workers: Annotated[int, typer.Option(help="MILP worker threads.")] = 2,
    as_json: JsonOpt = False,
) -> None:
    """Plan one scenario: the target placement and the operations that reach it."""
    parsed = read_scenario(scenario)
    try:
        problem = problem_from_scenario(parsed)
        solve = default_registry().get(solver)
        options = {"time_limit_seconds": time_limit, "seed": seed, "workers": workers} if solver == "milp" else {}
        result = solve(problem, **options)
    except (ScenarioError, ValueError) as error:
        raise fail(str(error)) from None
    if result.unserved:
        reasons = "\n".join(f"  session {s}: {why}" for s, why in sorted(result.unserved.items()))
        raise fail(f"the scenario cannot be satisfied; violated constraint(s):\n{reasons}")
    if as_json:
        emit_json(result.to_json())
    else:
        print_plan(result, problem)


def print_plan(result: Plan, problem) -> None:
    gib = 2**30
    out.print(
        f"solver [bold]{result.solver}[/]  status [bold]{result.status.value}[/]  objective {result.objective.total:.2f}  "
        f"predicted P95 switch latency {result.predicted.switch_latency_p95_seconds:.2f} s  "
        f"GPU bytes {result.predicted.gpu_bytes / gib:.1f} GiB  solved in {result.solve_seconds * 1000:.1f} ms"
    )
    table = Table(title="GPUs after the plan", show_lines=False)
    for col in ("gpu", "node", "type", "used / capacity GiB", "holds"):
        table.add_column(col)
    holdings: dict[str, list[str]] = {g: [] for g in problem.gpus}
    used: dict[str, int] = {g: 0 for g in problem.gpus}
    for (obj, loc), nbytes in sorted(result.placement.items()):
        if loc.tier is Tier.GPU:
            holdings[loc.id].append(f"{obj.label()} {nbytes / gib:.1f}")
            used[loc.id] += nbytes
    for gid, gpu in sorted(problem.gpus.items()):
        table.add_row(gid, gpu.node, gpu.type, f"{used[gid] / gib:.1f} / {gpu.capacity_bytes / gib:.1f}", ", ".join(holdings[gid]))
    out.print(table)
    ops = Table(title=f"{len(result.operations)} operations")
    for col in ("id", "action", "object", "from", "to", "GiB", "priority", "after", "why"):
        ops.add_column(col)
    for op in result.operations:
        ops.add_row(
            op.id,
            op.action.value,
            op.object.label(),
            op.source.label() if op.source else "-",
            op.dest.label() if op.dest else "-",
            f"{op.bytes / gib:.2f}",
            op.priority.value,
            ",".join(op.depends_on),
            op.reason,
        )
    out.print(ops)


@bench_app.command("plan")
def bench_plan(
    scenario: Annotated[Path | None, typer.Option("--scenario", help="Plan this scenario.")] = None,
    gpus: Annotated[int, typer.Option(help="GPUs of a random scenario.")] = 16,
    models: Annotated[int, typer.Option(help="Models of a random scenario.")] = 7,
    sessions: Annotated[int, typer.Option(help="Sessions of a random scenario.")] = 100,
    repeat: Annotated[int, typer.Option(help="Plans from scratch to time.")] = 100,
    seed: Annotated[int, typer.Option(help="Seed of the random scenario.")] = 0,
    solver: Annotated[str, typer.Option(help="Solver to time.")] = "greedy",
    as_json: JsonOpt = False,
) -> None:
    """Time planning alone (no parsing), `repeat` times from scratch, and print p50/p99."""
    from planner_service.domain.generate import random_scenario

    parsed = read_scenario(scenario) if scenario else random_scenario(np.random.default_rng(seed), gpus, models, sessions)
    problem = problem_from_scenario(parsed)
    solve = default_registry().get(solver)
    timings = []
    for _ in range(repeat):
        started = time.perf_counter()
        solve(problem)
        timings.append((time.perf_counter() - started) * 1000)
    result = {
        "gpus": len(problem.gpus),
        "models": len(problem.models),
        "sessions": len(problem.sessions),
        "repeat": repeat,
        "p50_ms": round(float(np.percentile(timings, 50)), 3),
        "p99_ms": round(float(np.percentile(timings, 99)), 3),
    }
    if as_json:
        emit_json(result)
    else:
        out.print(result)


@app.command("export-schemas")
def export_schemas(
    out_dir: Annotated[Path, typer.Option("--out", help="Folder for the JSON Schema files.")] = Path("schemas"),
) -> None:
    """Write the JSON Schemas of the project's file formats."""
    from planner_service.schemas import write_schemas

    for path in write_schemas(out_dir):
        err.print(f"wrote {path}")


def main() -> None:  # pragma: no cover - console script entry
    app()
