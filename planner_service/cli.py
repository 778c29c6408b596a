"""The `statebudget` command line.

Results go to stdout (JSON with `--json`, else readable tables); logs and
errors go to stderr. Exit status 2 means the input cannot be planned (a
malformed scenario, or a constraint that cannot hold): the message names it.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import re
import sqlite3
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar
from urllib.parse import quote, quote_plus, unquote_plus

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from planner_service.domain.catalog_fits import catalog_fits_scenario
from planner_service.domain.demo import demo_scenario
from planner_service.domain.engines import EngineState
from planner_service.domain.exceeds import exceeds_scenario
from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.scenario import Scenario, ScenarioError, load_scenario
from planner_service.domain.state import Tier
from planner_service.planner.plan import Plan
from planner_service.sim.importers import TraceFormat
from planner_service.sim.policies.base import PolicyName
from planner_service.solver.registry import default_registry
from planner_service.wire.enums import SolverName

if TYPE_CHECKING:
    from clients.sdk import StateBudgetClient
    from planner_service.settings import Settings
    from planner_service.sim.fit import TraceFit
    from planner_service.sim.synth import SynthParams
    from planner_service.wire.calibration import CalibrationOut

T = TypeVar("T")

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # click's plain help: `--demo`, `--a / --no-a`, `<a|b>` choices; no `<bool>` on flags
    help="StateBudget: plan where LLM state lives.",
)
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print figures.")
app.add_typer(bench_app, name="bench")

out = Console()
err = Console(stderr=True)

ScenarioOpt = Annotated[
    Path | None,
    typer.Option(
        "--scenario",
        help="Scenario file (JSON or YAML), or a built-in one: demo, exceeds-hbm, catalog-fits; default: the demo.",
    ),
]
# built-in scenarios by name, for a --scenario that names no file
BUILTIN_SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "demo": demo_scenario,
    "exceeds-hbm": exceeds_scenario,
    "catalog-fits": catalog_fits_scenario,
}
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")]
ReplicasOpt = Annotated[
    str | None,
    typer.Option(
        help="Engine instances of a model, e.g. coder=2 (sim/replicas.py: each a whole copy the policies place, "
        "the gateway picking one per request); comma-separated; default one each."
    ),
]


def fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False, markup=True)
    return typer.Exit(code)


def read_scenario(path: Path | None) -> Scenario:
    if path is None:
        return demo_scenario()
    if not path.exists() and str(path) in BUILTIN_SCENARIOS:
        return BUILTIN_SCENARIOS[str(path)]()
    try:
        return load_scenario(path)
    except ScenarioError as error:
        raise fail(f"{path}: invalid scenario\n{error}") from None


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


@app.command()
def plan(
    scenario: ScenarioOpt = None,
    solver: Annotated[
        SolverName,
        typer.Option(help="greedy (the online default), search (greedy + local search) or milp (exact oracle)."),
    ] = SolverName.GREEDY,
    time_limit: Annotated[float, typer.Option("--time-limit", help="MILP time limit in seconds.")] = 60.0,
    seed: Annotated[int, typer.Option(help="MILP random seed.")] = 0,
    workers: Annotated[
        int,
        typer.Option(help="MILP workers: CBC processes (one per model variant, first proof wins) or CP-SAT threads."),
    ] = 2,
    as_json: JsonOpt = False,
) -> None:
    """Plan one scenario: the target placement and the operations that reach it."""
    parsed = read_scenario(scenario)
    try:
        problem = problem_from_scenario(parsed)
        solve = default_registry().get(solver)
        milp = solver is SolverName.MILP
        options = {"time_limit_seconds": time_limit, "seed": seed, "workers": workers} if milp else {}
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


def print_instances(result: Plan) -> None:
    """The engine instances of engine nodes after the plan, and the step that takes each there."""
    # (node, model) -> its steps in plan order (a stop, then a start, where a restart was split)
    steps: dict[tuple[str, str], dict[str, None]] = {}
    for op in result.operations:
        if op.engine is not None:
            said = f"{op.engine.transition.value} from {op.engine.from_state.value}"
            steps.setdefault((op.node, op.object.model), {})[said] = None
    table = Table(title="Engine instances after the plan", show_lines=False)
    for col in ("node", "model", "kind", "state", "precision", "gpus", "step"):
        table.add_column(col)
    for (node_id, model_id), view in sorted(result.instances.items()):
        step = steps.get((node_id, model_id))
        if view.state is EngineState.STOPPED and step is None:
            continue  # most engines of a catalog: stopped and staying so
        table.add_row(
            node_id,
            model_id,
            view.declared.kind.value,
            view.state.value,
            view.precision or "",
            "+".join(view.gpus),
            "" if step is None else ", then ".join(step),
        )
    out.print(table)


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
        table.add_row(
            gid, gpu.node, gpu.type, f"{used[gid] / gib:.1f} / {gpu.capacity_bytes / gib:.1f}", ", ".join(holdings[gid])
        )
    out.print(table)
    if result.instances:
        print_instances(result)
    out.print(f"\n[bold]{len(result.operations)} operations[/] (run in parallel once their dependencies are done)")
    for op in result.operations:
        route = f"{op.source.label() if op.source else 'prefill'} -> {op.dest.label() if op.dest else 'dropped'}"
        after = f" after {','.join(op.depends_on)}" if op.depends_on else ""
        engine = f" ({op.engine.transition.value} {op.engine.instance.id})" if op.engine is not None else ""
        out.print(
            f"{op.id:>6} {op.action.value:<7} {op.object.label()} {route} {op.bytes / gib:.2f} GiB{engine} "
            f"[{op.priority.value}]{after}\n         {op.reason}",
            highlight=False,
            markup=False,
        )


@bench_app.command("plan")
def bench_plan(
    scenario: Annotated[Path | None, typer.Option("--scenario", help="Plan this scenario.")] = None,
    gpus: Annotated[int, typer.Option(help="GPUs of a random scenario.")] = 16,
    models: Annotated[int, typer.Option(help="Models of a random scenario.")] = 7,
    sessions: Annotated[int, typer.Option(help="Sessions of a random scenario.")] = 100,
    repeat: Annotated[int, typer.Option(help="Plans from scratch to time.")] = 100,
    seed: Annotated[int, typer.Option(help="Seed of the random scenario.")] = 0,
    solver: Annotated[SolverName, typer.Option(help="Solver to time.")] = SolverName.GREEDY,
    warmup: Annotated[
        int,
        typer.Option(
            help="Untimed plans first: a fresh process pays once for warming the interpreter and growing its heap, "
            "which a running service has done long before."
        ),
    ] = 1,
    as_json: JsonOpt = False,
) -> None:
    """Time planning alone (no parsing), `repeat` times from scratch, and print p50/p99 and the machine.

    `reference_p50_ms` / `reference_p99_ms` time a fixed pure-Python workload run right after each plan:
    when the machine slows down, its tail grows with the planner's.
    """
    from planner_service.bench import machine, time_plans
    from planner_service.domain.generate import random_scenario

    parsed = (
        read_scenario(scenario) if scenario else random_scenario(np.random.default_rng(seed), gpus, models, sessions)
    )
    problem = problem_from_scenario(parsed)
    timings = time_plans(default_registry().get(solver), problem, repeat, warmup)
    result = {
        "gpus": len(problem.gpus),
        "models": len(problem.models),
        "sessions": len(problem.sessions),
        "repeat": repeat,
        **timings,
        "machine": machine(),
    }
    if as_json:
        emit_json(result)
    else:
        out.print(result)


@bench_app.command("ingest")
def bench_ingest(
    rounds: Annotated[int, typer.Option(help="Rounds of event batches, each then planned and reported done.")] = 10,
    batches: Annotated[int, typer.Option(help="Event batches per round.")] = 20,
    batch: Annotated[int, typer.Option(help="Events per batch.")] = 20,
    sessions: Annotated[int, typer.Option(help="Concurrent sessions the events belong to.")] = 200,
    as_json: JsonOpt = False,
) -> None:
    """Time event batches and done reports in process on the demo (no HTTP), and print p50/p95/mean, how often
    the live problem was compiled, the machine and the load average."""
    from planner_service.bench import machine
    from planner_service.bench_ingest import run

    result = {**run(rounds, batches, batch, sessions), "machine": machine()}
    if as_json:
        emit_json(result)
    else:
        out.print(result)


@bench_app.command("gateway")
def bench_gateway(
    rate: Annotated[
        list[float] | None, typer.Option(help="Requests per second, one phase each (repeat; default 100 500 1000).")
    ] = None,
    seconds: Annotated[float, typer.Option(min=1.0, max=120.0, help="Length of each phase.")] = 5.0,
    concurrency: Annotated[int, typer.Option(min=1, max=2000, help="Streams open at most at once.")] = 200,
    tokens: Annotated[int, typer.Option(min=1, max=1000, help="Tokens the fake engine streams per answer.")] = 4,
    token_latency: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="The fake engine's seconds per token.")
    ] = 0.005,
) -> None:
    """Direct to a fixed-latency fake engine vs through the gateway, in one run: the TTFT and stream time
    each, the latency the gateway adds at p50 and p99, requests per second and the gateway's CPU."""
    from clients.gateway.bench import report, run

    phases = run(rate or [100.0, 500.0, 1000.0], seconds, concurrency, tokens, token_latency)
    for line in report(phases):
        typer.echo(line)


@bench_app.command("load")
def bench_load(
    agents: Annotated[int, typer.Option(min=1, max=1000, help="Node agents leasing and reporting done.")] = 50,
    rate: Annotated[
        list[float] | None,
        typer.Option(
            "--rate", min=1.0, max=100_000.0, help="Session events per second offered; repeat for one phase per rate."
        ),
    ] = None,
    batch: Annotated[int, typer.Option(min=1, max=10_000, help="Events per request (a router batches).")] = 20,
    duration: Annotated[float, typer.Option(min=1.0, max=3600.0, help="Seconds of load per phase.")] = 30.0,
    sessions: Annotated[int, typer.Option(min=1, max=100_000, help="Concurrent sessions the events belong to.")] = 200,
    replan_every: Annotated[
        float, typer.Option(min=0.0, help="Force a replan (POST /v1/plan) this often, seconds; 0 for none.")
    ] = 5.0,
    op_seconds: Annotated[float, typer.Option(min=0.0, max=60.0, help="Seconds an agent takes per operation.")] = 0.05,
    connections: Annotated[
        int,
        typer.Option(min=1, max=1000, help="The router's connections: each sends its sessions' events in order."),
    ] = 64,
    warmup: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=600.0,
            help="Seconds at the start whose latencies are reported apart (every agent and lane connects then).",
        ),
    ] = 2.0,
    scenario: Annotated[Path | None, typer.Option("--scenario", help="Seed scenario; default: the demo.")] = None,
    server_log_level: Annotated[
        str, typer.Option(help="The server's log level (info adds an access log line per request).")
    ] = "warning",
    seed: Annotated[int, typer.Option(help="Seed of the event stream.")] = 0,
    as_json: JsonOpt = False,
) -> None:
    """Load a real `statebudget serve` on loopback (fresh database, one phase per --rate) with agents that
    long-poll and report done, session events and forced replans; print latency percentiles, errors, events/s
    achieved and the server's replan figures. Bounded by --duration; figures, not a test."""
    from planner_service.bench import machine
    from planner_service.bench_load import LoadConfig, run_phase

    if server_log_level not in ("debug", "info", "warning", "error"):
        raise fail(f"--server-log-level: {server_log_level!r} is not one of debug, info, warning, error")
    phases = []
    for events_per_s in rate or [1000.0]:
        config = LoadConfig(
            agents=agents,
            events_per_s=events_per_s,
            batch=batch,
            duration_seconds=duration,
            sessions=sessions,
            replan_every_seconds=replan_every,
            op_seconds=op_seconds,
            connections=connections,
            warmup_seconds=min(warmup, duration / 2),
            seed=seed,
            scenario=scenario,
            server_log_level=server_log_level,
        )
        try:
            phases.append(run_phase(config))
        except RuntimeError as error:
            raise fail(str(error), code=1) from None
        if not as_json:
            out.print(phases[-1])
    if as_json:
        emit_json({"phases": phases, "machine": machine()})
    else:
        out.print({"machine": machine()})


@bench_app.command("wake")
def bench_wake(
    trials: Annotated[int, typer.Option(min=2, max=1000, help="Requests, alternating between the two models.")] = 40,
    debounce: Annotated[
        float | None,
        typer.Option(min=0.0, max=10.0, help="The server's replan debounce, seconds (default: the server's own)."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """The control path of a wake on request against a real `statebudget serve` on loopback: from a request
    event for a model that runs nowhere until the gateway's route table shows it running (the engine's own
    wake counted as zero); p50/p95/p99 of each step. Figures, not a test."""
    from planner_service.bench import machine
    from planner_service.bench_wake import WakeConfig, run

    try:
        figures = run(WakeConfig(trials=trials, replan_debounce_seconds=debounce))
    except RuntimeError as error:
        raise fail(str(error), code=1) from None
    figures["machine"] = machine()
    if as_json:
        emit_json(figures)
    else:
        out.print(figures)


@app.command()
def gap(
    scenarios: Annotated[
        int, typer.Option(help="Random scenarios to plan (or files to take from --scenario-dir).")
    ] = 50,
    seed: Annotated[
        int, typer.Option(help="Scenario i is random_scenario(default_rng(seed + i)); also the MILP seed.")
    ] = 0,
    gpus: Annotated[int, typer.Option(help="GPUs of each random scenario.")] = 16,
    models: Annotated[int, typer.Option(help="Models of each random scenario.")] = 7,
    sessions: Annotated[int, typer.Option(help="Sessions of each random scenario.")] = 100,
    time_limit: Annotated[float, typer.Option("--time-limit", help="MILP time limit per scenario, seconds.")] = 20.0,
    workers: Annotated[
        int,
        typer.Option(help="MILP workers: CBC processes (one per model variant, first proof wins) or CP-SAT threads."),
    ] = 2,
    scenario_dir: Annotated[
        Path | None, typer.Option("--scenario-dir", help="Plan these scenario files instead.")
    ] = None,
    engines: Annotated[
        bool,
        typer.Option(
            "--engines", help="Random scenarios whose nodes serve every model through engines of random kinds."
        ),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """The greedy's optimality gap: plan each scenario with greedy and MILP, print ratios on the avoidable objective."""
    from planner_service.solver.gap import gap_study, random_scenarios, scenario_files

    if scenario_dir is not None:
        cases = scenario_files(scenario_dir, scenarios)
    else:
        cases = random_scenarios(scenarios, seed, gpus, models, sessions, engines=engines)

    def progress(row) -> None:
        err.print(
            f"{row.scenario}: greedy {row.greedy_objective:.2f}  milp {row.milp_objective:.2f} ({row.milp_status}, "
            f"gap {_percent(row.gap)}, {row.milp_seconds:.1f} s)  unavoidable {row.unavoidable:.2f}  ratio {row.ratio:.4f}  "
            f"search {row.search_objective:.2f} ratio {row.search_ratio:.4f}",
            highlight=False,
            soft_wrap=True,
        )

    try:
        summary = gap_study(cases, time_limit_seconds=time_limit, seed=seed, workers=workers, progress=progress)
    except (ScenarioError, ValueError) as error:
        raise fail(str(error)) from None
    if as_json:
        emit_json(summary)
        return
    # objectives in seconds to 0.1 s, so that the whole table fits an 80-column terminal (the JSON has every digit)
    table = Table(title="greedy vs MILP (objectives in seconds; search: the local search's ratio)", box=None)
    table.add_column("scenario", no_wrap=True)
    for col in ("greedy", "MILP", "status", "gap", "MILP s", "unavoidable", "ratio", "search"):
        table.add_column(col, justify="right", no_wrap=True)
    for row in summary["per_scenario"]:
        table.add_row(
            row["scenario"],
            f"{row['greedy_objective']:.1f}",
            f"{row['milp_objective']:.1f}",
            row["milp_status"],
            _percent(row["gap"]),
            f"{row['milp_seconds']:.1f}",
            f"{row['unavoidable']:.1f}",
            f"{row['ratio']:.3f}",
            f"{row['search_ratio']:.3f}",
        )
    out.print(table)
    out.print({k: v for k, v in summary.items() if k != "per_scenario"})


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


@app.command("export-schemas")
def export_schemas(
    out_dir: Annotated[Path, typer.Option("--out", help="Folder for the JSON Schema files.")] = Path("schemas"),
) -> None:
    """Write the JSON Schemas of the project's file formats."""
    from planner_service.schemas import write_schemas

    for path in write_schemas(out_dir):
        err.print(f"wrote {path}")


trace_app = typer.Typer(no_args_is_help=True, help="Agent traces: synthesize one, or import a public trace.")
app.add_typer(trace_app, name="trace")
OutOpt = Annotated[Path, typer.Option("--out", help="Trace file to write (JSON Lines, sorted by time).")]


def report_trace(path: Path, summary, as_json: bool) -> None:
    result = {"out": str(path), **summary.to_json()}
    if as_json:
        emit_json(result)
    else:
        models = ", ".join(f"{m} {n}" for m, n in result["models"].items())
        out.print(
            f"wrote {path}: {result['requests']} requests, {result['sessions']} sessions, "
            f"{result['duration_seconds'] / 3600:.2f} h; requests per model: {models}",
            highlight=False,
        )


@trace_app.command("synth")
def trace_synth(
    out_path: OutOpt,
    sessions: Annotated[int, typer.Option(help="Sessions alive at a time.")] = 10,
    hours: Annotated[float, typer.Option(help="Length of the trace in hours.")] = 8.0,
    users: Annotated[int, typer.Option(help="Engineers who own the sessions.")] = 10,
    seed: Annotated[int, typer.Option(help="Random seed; the same seed gives the same trace.")] = 0,
    gap_scale: Annotated[float, typer.Option(help="Every gap between a session's turns times this.")] = 1.0,
    handoff_rate: Annotated[
        float | None,
        typer.Option(help="Share of a session's later turns that hand off (default: the hour's chain decides)."),
    ] = None,
    context: Annotated[
        str, typer.Option(help="What a hand-off's model sees: shared (the whole history) or fresh (a sub-agent's own).")
    ] = "shared",
    scenario: ScenarioOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write a synthetic agent trace: hand-offs drift by hour, heavy-tailed tool gaps, growing contexts."""
    from planner_service.sim.synth import SynthParams, synth_trace
    from planner_service.sim.trace import write_trace_stream

    parsed = read_scenario(scenario)
    try:
        params = SynthParams(
            sessions=sessions,
            hours=hours,
            users=users,
            gap_scale=gap_scale,
            handoff_rate=handoff_rate,
            context=context,
        )
    except ValueError as error:
        raise fail(str(error)) from None
    records = synth_trace(parsed, params, np.random.default_rng(seed))
    report_trace(out_path, write_trace_stream(out_path, records), as_json)


@trace_app.command("import")
def trace_import(
    fmt: Annotated[TraceFormat, typer.Option("--format", help="Source format.")],
    input_path: Annotated[Path, typer.Option("--input", help="The source file or its folder.")],
    out_path: OutOpt,
    scenario: ScenarioOpt = None,
    limit: Annotated[int | None, typer.Option(help="Read at most this many source requests.")] = None,
    models: Annotated[
        str | None, typer.Option(help="Comma-separated scenario models to map onto (the format's docs say how).")
    ] = None,
    idle_timeout: Annotated[
        float | None, typer.Option("--idle-timeout", help="Seconds without a request that end a session.")
    ] = None,
    handoffs: Annotated[
        bool,
        typer.Option(help="Azure, Mooncake: later turns of a session follow the scenario's hand-off chain."),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Convert a public trace (Azure 2023, Mooncake, Alibaba GenAI 2026) into a StateBudget trace."""
    from planner_service.sim.importers import ImportOptions, default_registry
    from planner_service.sim.trace import write_trace_stream

    parsed = read_scenario(scenario)
    if not input_path.exists():
        raise fail(f"{input_path}: no such file or folder")
    chosen = tuple(m.strip() for m in models.split(",") if m.strip()) if models else ()
    try:
        importer = default_registry().get(fmt)
        options = ImportOptions(limit=limit, models=chosen, idle_timeout_seconds=idle_timeout, handoffs=handoffs)
        summary = write_trace_stream(out_path, importer.records(input_path, parsed, options))
    except ValueError as error:  # TraceError included
        raise fail(str(error)) from None
    report_trace(out_path, summary, as_json)


REDACTED = "[redacted]"
CREDENTIAL_PARAMETER = re.compile(r"token|api[-_]?key|secret|passw|auth|credential", re.IGNORECASE)
"""Query parameters whose values the access log blanks (`token`, `access_token`, `api_key`, ...)."""


class RedactCredentials(logging.Filter):
    """Blanks credentials in the access log's request line: the value of every query parameter named like one,
    and each configured token wherever it appears (raw or percent-encoded).

    Tokens belong in the `Authorization` header, which is never logged; a client that puts one in the URL
    (`?token=...`) must not leave it in the log as well, where anyone who reads the logs could reuse it.
    """

    def __init__(self, tokens: Sequence[str] = ()) -> None:
        super().__init__()
        forms = {form for t in tokens if t for form in (t, quote(t, safe=""), quote_plus(t))}
        self._tokens = sorted(forms, key=len, reverse=True)  # longest first: no token is a prefix left behind

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self.redact(a) if isinstance(a, str) else a for a in record.args)
        return True

    def redact(self, text: str) -> str:
        for token in self._tokens:
            text = text.replace(token, REDACTED)
        path, sep, query = text.partition("?")
        if not sep:
            return text
        pairs = []
        for pair in query.split("&"):
            name, eq, value = pair.partition("=")
            secret = bool(eq and value and CREDENTIAL_PARAMETER.search(unquote_plus(name)))
            pairs.append(f"{name}={REDACTED}" if secret else pair)
        return f"{path}?{'&'.join(pairs)}"


def serve_log_config(settings: Settings) -> dict[str, Any]:
    """uvicorn's own logging configuration, with `RedactCredentials` on its access log."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    tokens = [*settings.operator_tokens, *settings.node_tokens.values()]
    config.setdefault("filters", {})["redact_credentials"] = {"()": RedactCredentials, "tokens": tokens}
    access = config["handlers"]["access"]
    access["filters"] = [*access.get("filters", []), "redact_credentials"]
    return config


def open_database(path: Path) -> None:
    """Bring the database to this build's schema before listening, or exit naming why it cannot be (a newer
    build's database), rather than failing inside the server's startup with a traceback."""
    from planner_service.service.store import SchemaError, SqliteStore

    store = SqliteStore(path)
    try:
        store.open()
    except SchemaError as error:
        raise fail(str(error)) from None
    except sqlite3.DatabaseError as error:
        raise fail(f"database {path}: {error}") from None
    store.close()


def delete_database(path: Path) -> None:
    """Delete a SQLite database and the journal files beside it (`serve --reset`), saying what went."""
    log = logging.getLogger("planner_service")
    gone = []
    for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            file.unlink()
        except FileNotFoundError:
            continue
        except OSError as error:
            raise fail(f"--reset: cannot delete {file}: {error.strerror}") from None
        gone.append(file.name)
    if gone:
        log.warning("--reset: deleted the database %s (%s); the service starts from its seed", path, ", ".join(gone))
    else:
        log.info("--reset: no database at %s; the service starts from its seed", path)


def _serve_epilog() -> str:
    from planner_service.settings import env_help

    return env_help()


@app.command(epilog=_serve_epilog())
def serve(
    scenario: Annotated[
        Path | None, typer.Option("--scenario", help="Seed an empty database from this scenario file (JSON or YAML).")
    ] = None,
    demo: Annotated[
        bool, typer.Option("--demo", help="Seed an empty database with the demo scenario (the default seed).")
    ] = False,
    host: Annotated[str | None, typer.Option(help="Address to listen on (STATEBUDGET_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (STATEBUDGET_PORT).")] = None,
    db: Annotated[
        Path | None,
        typer.Option(
            "--db", help="SQLite database (STATEBUDGET_DB_PATH); an existing one wins over --scenario/--demo."
        ),
    ] = None,
    reset: Annotated[
        bool,
        typer.Option(
            "--reset", help="Delete the database (with its -wal and -shm files) first: start from the seed again."
        ),
    ] = False,
) -> None:
    """Run the planner service: HTTP API, planning loop, Prometheus metrics at /metrics."""
    import uvicorn
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from planner_service.api.app import create_app
    from planner_service.settings import Settings

    if scenario is not None and demo:
        raise fail("give --scenario or --demo, not both")
    overrides: dict[str, Any] = {"host": host, "port": port, "db_path": db, "scenario_path": scenario}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if demo:
        overrides["demo"] = True
    try:
        settings = Settings(**overrides)  # its errors never echo the values given (the tokens are secrets)
    except (ValidationError, SettingsError) as error:
        raise fail(f"invalid settings\n{error}") from None
    if settings.scenario_path is not None:
        read_scenario(settings.scenario_path)  # a bad seed fails here, with its field, before listening
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    if reset:
        delete_database(settings.db_path)
    open_database(settings.db_path)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=serve_log_config(settings),
        timeout_graceful_shutdown=5,  # lease long-polls must not hold a shutdown for their whole wait
        timeout_keep_alive=settings.keep_alive_seconds,
    )


@app.command()
def gateway(
    planner: Annotated[
        str | None, typer.Option("--planner", help="The planner's URL (STATEBUDGET_GATEWAY_PLANNER_URL).")
    ] = None,
    host: Annotated[str | None, typer.Option(help="Address to listen on (STATEBUDGET_GATEWAY_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (STATEBUDGET_GATEWAY_PORT, default 8090).")] = None,
) -> None:
    """Run the gateway: an OpenAI-compatible endpoint that routes by the planner's route table.

    The planner token (a router token) comes from STATEBUDGET_GATEWAY_PLANNER_TOKEN; README, "Point your
    agents at the gateway", lists what it does on each request.
    """
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from clients.gateway.cli import serve as serve_gateway

    try:
        serve_gateway(planner_url=planner, host=host, port=port)
    except (ValidationError, SettingsError) as error:
        raise fail(f"invalid gateway settings\n{error}") from None
    except ModuleNotFoundError as error:  # the gateway's extra not installed: the message says which
        raise fail(str(error)) from None


# -- calibration of a running service (over HTTP, with the SDK) ----------------------------------------

calibration_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,
    help="See and reset the bandwidths a running service learned from measured copies (operator token).",
)
app.add_typer(calibration_app, name="calibration")
UrlOpt = Annotated[str, typer.Option("--url", envvar="STATEBUDGET_URL", help="The service's base URL.")]
TokenOpt = Annotated[
    str | None, typer.Option("--token", envvar="STATEBUDGET_TOKEN", help="An operator token (open service: none).")
]


def operator_client(url: str, token: str | None) -> StateBudgetClient:
    """The SDK client the calibration commands use (a test hands in one bound to its in-process app): one try per
    call, since an operator at a terminal sees the error and runs it again."""
    from clients.sdk import RetryPolicy, StateBudgetClient

    return StateBudgetClient(url, token=token, retry=RetryPolicy(attempts=1))


def _calibration_call(url: str, token: str | None, call: Callable[[StateBudgetClient], T]) -> T:
    from clients.sdk import APIError
    from clients.sdk import ConnectionError as SdkConnectionError

    try:
        with operator_client(url, token) as sb:
            return call(sb)
    except APIError as error:
        raise fail(f"{url}: {error}", 1) from None
    except SdkConnectionError as error:
        raise fail(f"{url}: no answer ({error.message})", 1) from None


def print_calibration(calibration: CalibrationOut) -> None:
    table = Table(title="learned bandwidths (GB/s); a link not listed plans with its catalog figure")
    for col in ("node", "scale", "link", "field", "catalog", "learned", "samples", "last measured", "outliers"):
        table.add_column(col, justify="left" if col in ("node", "link", "field") else "right")
    for node in calibration.nodes:
        scale = f"{node.scale:g}" + ("" if node.calibrates else " (no calibration)")
        links = [(node.id, node.calibrated), *((g.id, g.calibrated) for g in node.gpus)]
        rows = [(link, field, entry) for link, fields in links for field, entry in sorted(fields.items())]
        if not rows:
            table.add_row(node.id, scale, "-", "-", "", "", "", "", "")
        for link, field, entry in rows:
            table.add_row(
                node.id,
                scale,
                link,
                field,
                f"{entry.catalog / 1e9:.3g}" if entry.catalog is not None else "?",
                f"{entry.value / 1e9:.3g}",
                str(entry.samples),
                f"{entry.last_measured / 1e9:.3g}",
                str(entry.outliers),
            )
    out.print(table)


@calibration_app.command("show")
def calibration_show(
    url: UrlOpt = "http://127.0.0.1:8080",
    token: TokenOpt = None,
    node: Annotated[str | None, typer.Option(help="Only this node (and its GPUs).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Per node and GPU: each learned bandwidth against its catalog figure, and whether the node calibrates."""
    calibration = _calibration_call(url, token, lambda sb: sb.get_calibration(node=node))
    if as_json:
        emit_json(calibration.model_dump(mode="json"))
    else:
        print_calibration(calibration)


@calibration_app.command("reset")
def calibration_reset(
    url: UrlOpt = "http://127.0.0.1:8080",
    token: TokenOpt = None,
    node: Annotated[str | None, typer.Option(help="Forget what this node's links learned (NVMe and GPUs).")] = None,
    gpu: Annotated[str | None, typer.Option(help="Forget what this GPU's links learned.")] = None,
    field: Annotated[
        str | None,
        typer.Option(
            help="Only this bandwidth: nvme_read_bytes_per_s or nvme_write_bytes_per_s (--node), "
            "h2d_bytes_per_s or d2h_bytes_per_s (--gpu)."
        ),
    ] = None,
    everything: Annotated[bool, typer.Option("--all", help="Forget every learned bandwidth.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Forget learned bandwidths: the links plan with their catalog (or explicit) figures again."""
    from planner_service.wire.enums import CalibrationScope

    if sum((node is not None, gpu is not None, everything)) != 1:
        raise fail("give one of --node, --gpu or --all")
    if field is not None and everything:
        raise fail("--field needs --node or --gpu")
    if everything:
        result = _calibration_call(url, token, lambda sb: sb.reset_calibration())
    else:
        scope, key = (CalibrationScope.NODES, node) if node is not None else (CalibrationScope.GPUS, gpu)
        result = _calibration_call(url, token, lambda sb: sb.reset_calibration(scope, key, field))
    if as_json:
        emit_json(result.model_dump(mode="json"))
        return
    err.print(f"forgot {result.forgotten} learned bandwidth(s)", highlight=False)
    print_calibration(result)


# -- trace replay and studies (planner_service/sim) --------------------------------------------------

study_app = typer.Typer(no_args_is_help=True, help="The paper's measurements on a trace: h1, h3, pareto.")
app.add_typer(study_app, name="study")
TraceOpt = Annotated[Path, typer.Option("--trace", help="Agent trace (JSON Lines).")]


def read_trace_file(path: Path) -> list:
    from planner_service.sim.trace import TraceError, read_trace

    try:
        return read_trace(path)
    except (OSError, TraceError) as error:
        raise fail(f"{path}: {error}") from None


def replay_tables(metrics: Sequence[str], rows: list[list[str]], title: str, width: int) -> list[Table]:
    """A row per metric and a column per policy (`rows`: a policy's name, then its figures), as many
    tables as the width needs: no column narrower than its policy's name and figures (a number folded
    in two reads as two numbers)."""
    label = max(map(len, metrics)) + 3  # text, padding and border
    groups: list[list[list[str]]] = [[]]
    used = label + 1
    for row in rows:
        need = max(map(len, row)) + 3
        if groups[-1] and used + need > width:
            groups.append([])
            used = label + 1
        groups[-1].append(row)
        used += need
    tables: list[Table] = []
    for group in groups:
        table = Table(title=title if not tables else None)
        table.add_column(metrics[0], no_wrap=True)
        for row in group:
            table.add_column(row[0], justify="right", no_wrap=True)
        for i, metric in enumerate(metrics[1:], start=1):
            table.add_row(metric, *(row[i] for row in group))
        tables.append(table)
    return tables


@app.command()
def replay(
    trace: TraceOpt,
    scenario: ScenarioOpt = None,
    policies: Annotated[
        str,
        typer.Option(
            help=f"Comma-separated policies to compare, of: {', '.join(PolicyName)}. "
            "[default: statebudget, sleep-router, swap-ttl, static, lru, independent, oracle]",
            show_default=False,
        ),
    ] = "statebudget,sleep-router,swap-ttl,static,lru,independent,oracle",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report (JSON) here.")] = None,
    plots: Annotated[Path | None, typer.Option("--plots", help="Write the PNG plots into this folder.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the replay (same seed, same report).")] = 0,
    expert_miss_decode: Annotated[
        bool,
        typer.Option(help="Slow MoE decode down for routed experts off GPU (costs.decode_slowdown_seconds)."),
    ] = True,
    gateway: Annotated[
        str,
        typer.Option(
            help="The gateway in front of the engines (sim/gateway.py): none, affinity, affinity+warmups (the "
            "planner's warm-up directives on idle cards) or affinity+eager-warmups (the ablation that never yields)."
        ),
    ] = "none",
    replicas: ReplicasOpt = None,
) -> None:
    """Replay a trace through the simulated cluster under each policy and compare them."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from planner_service.sim.engine import SimulationError
    from planner_service.sim.gateway import GatewayMode
    from planner_service.sim.policies import default_registry as policy_registry
    from planner_service.sim.report import TABLE_COLUMNS, comparison, table_rows, write_json
    from planner_service.sim.report import replay as run_replay

    if gateway not in {str(m) for m in GatewayMode}:
        raise fail(f"--gateway: one of {', '.join(GatewayMode)}, got {gateway!r}")
    parsed = read_scenario(scenario)
    records = read_trace_file(trace)
    names = [p.strip() for p in policies.split(",") if p.strip()]
    known = policy_registry().names()
    for name in names:
        if name not in known:
            raise fail(f"unknown policy {name!r}; choose one of: {', '.join(known)}")
    horizon = max((r.t for r in records), default=0.0) or 1.0
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=err) as progress:
        tasks = {n: progress.add_task(f"{n:12s}", total=horizon) for n in names}

        def advance(name: str, t: float) -> None:
            progress.update(tasks[name], completed=min(t, horizon))

        try:
            result = run_replay(
                parsed,
                records,
                names,
                scenario_name=str(scenario or "demo"),
                seed=seed,
                on_progress=advance,
                expert_miss_decode=expert_miss_decode,
                gateway=gateway,
                replicas=_replicas(replicas),
            )
        except (SimulationError, ValueError) as error:
            raise fail(str(error)) from None
    title = f"replay of {trace} ({result.report['trace']['requests']} requests)"
    for table in replay_tables(TABLE_COLUMNS, table_rows(result.report), title, out.width):
        out.print(table)
    floor = result.report["trace"]["handoff_reprefill_floor_seconds"]
    out.print(
        f"hand-off re-prefill floor (no policy beats it on this cluster): P95 {floor['p95']:.2f} s", highlight=False
    )
    ratios = comparison(result.report)
    if ratios:
        out.print(", ".join(f"{k} {v:.2f}" for k, v in ratios.items()), highlight=False)
    overran = [name for name, m in result.report["policies"].items() if m["saturated"]]
    if overran:
        out.print(f"saturated (ran > 5 % past the trace; no ratio quoted): {', '.join(overran)}", highlight=False)
    if json_out is not None:
        write_json(json_out, result.report)
        err.print(f"wrote {json_out}")
    if plots is not None:
        from planner_service.sim.plots import replay_plots

        for path in replay_plots(result.results, result.report, plots):
            err.print(f"wrote {path}")


def _study(kind: str, scenario: Path | None, trace: Path, out_dir: Path, as_json: bool) -> None:
    from planner_service.sim import studies

    parsed = read_scenario(scenario)
    records = read_trace_file(trace)
    try:
        result = studies.run_study(kind, parsed, records, out_dir)
    except ValueError as error:
        raise fail(str(error)) from None
    if as_json:
        emit_json(result.data)
        return
    table = Table(title=result.title)
    for col in result.columns:
        table.add_column(col, overflow="fold")  # wrap a long name rather than cut it
    for row in result.rows:
        table.add_row(*row)
    out.print(table)
    for line in result.notes:
        out.print(line, highlight=False)
    err.print(f"wrote {result.plot}")


StudyOutOpt = Annotated[Path, typer.Option("--out", help="Folder for the study's plot.")]


@study_app.command("h1")
def study_h1(
    trace: TraceOpt, scenario: ScenarioOpt = None, out_dir: StudyOutOpt = Path("."), as_json: JsonOpt = False
) -> None:
    """H1: CDF of concurrently active models and aggregate KV; KV capacity pooling gains over per-model pools."""
    _study("h1", scenario, trace, out_dir, as_json)


@study_app.command("h3")
def study_h3(
    trace: TraceOpt, scenario: ScenarioOpt = None, out_dir: StudyOutOpt = Path("."), as_json: JsonOpt = False
) -> None:
    """H3: add warm models one by one; which runs out first (weights or KV), and the next model's cold load."""
    _study("h3", scenario, trace, out_dir, as_json)


@study_app.command("pareto")
def study_pareto(
    trace: TraceOpt, scenario: ScenarioOpt = None, out_dir: StudyOutOpt = Path("."), as_json: JsonOpt = False
) -> None:
    """P95 switch latency against GPU bytes kept warm as the warm-memory price varies (statebudget policy)."""
    _study("pareto", scenario, trace, out_dir, as_json)


def _seed_list(text: str, field: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise fail(f"--{field}: comma-separated integers, got {text!r}") from None


def _replicas(text: str | None) -> dict[str, int]:
    """`--replicas coder=2,reasoner=2` -> {"coder": 2, "reasoner": 2}."""
    out: dict[str, int] = {}
    for part in (p.strip() for p in (text or "").split(",")):
        if not part:
            continue
        model, _, count = part.partition("=")
        if not model.strip() or not count.strip().isdigit() or int(count) < 1:
            raise fail(f"--replicas: model=count with a count of at least 1, comma-separated, got {part!r}")
        out[model.strip()] = int(count)
    return out


def _float_list(text: str, field: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise fail(f"--{field}: comma-separated numbers, got {text!r}") from None
    if not values:
        raise fail(f"--{field}: at least one number")
    return values


def _study_scenario(scenario: Path | None, precision: str) -> Scenario:
    """The study's scenario; at `native` precision every policy serves each model at its preferred one."""
    from planner_service.domain.problem import native_precision_scenario

    if precision not in ("allowed", "native"):
        raise fail(f"--precision: allowed or native, got {precision!r}")
    parsed = read_scenario(scenario)
    return native_precision_scenario(parsed) if precision == "native" else parsed


def _team_trace(sessions: int, hours: float, gap_scale: float, **options: Any) -> SynthParams:
    """A study's synthetic trace: the team arrives and leaves within a quarter of a short trace."""
    from planner_service.sim.synth import SynthParams

    spread = min(1800.0, hours * 900.0)
    return SynthParams(
        sessions=sessions,
        hours=hours,
        arrival_spread_seconds=spread,
        departure_spread_seconds=spread,
        gap_scale=gap_scale,
        **options,
    )


@study_app.command("seeds")
def study_seeds(
    scenario: ScenarioOpt = None,
    policies: Annotated[
        str, typer.Option(help="Comma-separated policies to compare.")
    ] = "statebudget,statebudget-groups,sleep-router,swap-ttl,static-tuned",
    seeds: Annotated[str, typer.Option(help="Reported seeds, comma-separated (one synthetic trace each).")] = "1,2,3",
    train_seeds: Annotated[
        str, typer.Option(help="Training seeds for static-tuned's search, kept apart from the reported ones.")
    ] = "101",
    sessions: Annotated[
        str, typer.Option(help="Sessions alive at a time in each trace; comma-separated: one load level each.")
    ] = "10",
    gap_scale: Annotated[
        str,
        typer.Option(
            "--gap-scale",
            help="Every gap between a session's turns times this (4: a quarter of the fitted turn rate); "
            "comma-separated: one load level each.",
        ),
    ] = "1",
    hours: Annotated[float, typer.Option(help="Length of each trace in hours.")] = 0.5,
    precision: Annotated[
        str,
        typer.Option(
            help="allowed: every policy may serve any of a model's precisions; native: only its preferred one "
            "(the same precision for every policy)."
        ),
    ] = "allowed",
    tune_budget: Annotated[int, typer.Option(help="Replays static-tuned's search may run (at each load level).")] = 200,
    handoff_rate: Annotated[
        str | None,
        typer.Option(
            "--handoff-rate",
            help="Share of a session's later turns that hand off (0.05 to 0.5; default: the hour's chain decides); "
            "comma-separated: one level each.",
        ),
    ] = None,
    context: Annotated[
        str,
        typer.Option(
            help="What a hand-off's model sees: shared (the session's whole history) or fresh (a sub-agent's own)."
        ),
    ] = "shared",
    fit: Annotated[
        str | None,
        typer.Option(
            "--fit",
            help="Fit the synthetic traces' gaps and tokens to a real trace: azure, mooncake, alibaba (from "
            "--traces-dir) or a trace file; default: the TraceLab sample's (synth.py).",
        ),
    ] = None,
    trace: Annotated[
        str | None,
        typer.Option(
            "--trace",
            help="Replay a real trace instead of synthetic ones: azure, mooncake or alibaba (imported from "
            "--traces-dir) or a trace file, cut into windows of --hours; --seeds and --train-seeds then number "
            "the reported and training windows (0: the first), and intervals are bootstraps over sessions.",
        ),
    ] = None,
    traces_dir: Annotated[
        Path, typer.Option("--traces-dir", help="The public traces' folder, for --trace by name.")
    ] = Path("../shared/traces"),
    out_dir: StudyOutOpt = Path("."),
    as_json: JsonOpt = False,
) -> None:
    """Every policy over N seeds at each load level: each metric's mean with its 95 % t-interval, saturated runs
    counted. Load levels are every --sessions by every --gap-scale by every --handoff-rate; static-tuned is
    searched at each one. With --trace, every policy on windows of a real trace instead."""
    from planner_service.sim import seeds as seed_runs
    from planner_service.sim.engine import SimulationError

    parsed = _study_scenario(scenario, precision)
    if trace is not None:
        name = str(scenario) if scenario is not None else "demo"
        _trace_study(
            parsed, name, precision, trace, traces_dir, hours, policies, seeds, train_seeds, tune_budget, as_json
        )
        return
    session_levels = _seed_list(sessions, "sessions")
    if not session_levels:
        raise fail("--sessions: at least one count")
    scales = _float_list(gap_scale, "gap-scale")
    rates: list[float | None] = [None] if handoff_rate is None else list(_float_list(handoff_rate, "handoff-rate"))
    studies = []
    try:
        fitted = _fit(parsed, fit, traces_dir) if fit is not None else None
        for count, scale, rate in itertools.product(session_levels, scales, rates):
            params = _team_trace(count, hours, scale, handoff_rate=rate, context=context)
            params = fitted.apply(params) if fitted is not None else params
            err.print(
                f"load level: {count} sessions, gap scale {scale:g}"
                + (f", hand-off rate {rate:g}" if rate is not None else "")
                + f", {context} context",
                highlight=False,
            )
            studies.append(
                seed_runs.seed_study(
                    parsed,
                    params,
                    [p.strip() for p in policies.split(",") if p.strip()],
                    _seed_list(seeds, "seeds"),
                    _seed_list(train_seeds, "train-seeds"),
                    tune_budget=tune_budget,
                    on_progress=lambda line: err.print(line, highlight=False),
                )
            )
            studies[-1].fit = fitted.to_json() if fitted is not None else None
    except (SimulationError, ValueError) as error:
        raise fail(str(error)) from None
    if as_json:
        name = str(scenario) if scenario is not None else "demo"
        emit_json({"scenario": name, "precision": precision, "levels": [s.to_json() for s in studies]})
        return
    for study in studies:
        columns, rows = seed_runs.table(study)
        p = study.params
        table = Table(
            title=f"{len(study.seeds)} seeds, {p.sessions} sessions x {hours:g} h, gap scale {p.gap_scale:g}: "
            "mean ± 95 % t-interval"
        )
        for col in columns:
            table.add_column(col, overflow="fold")
        for row in rows:
            table.add_row(*row)
        out.print(table)
        if study.tuning is not None:
            t = study.tuning
            out.print(
                f"static-tuned: trained on seeds {', '.join(map(str, study.train_seeds))}; space {t.space_size} "
                f"partitions, {t.candidates_scored} scored in {t.replays} replays (budget {tune_budget}), "
                f"{t.pruned} pruned by memory fit, {'exhaustive' if t.exhaustive else 'sampled'}",
                highlight=False,
            )
    err.print(f"wrote {seed_runs.plot(studies[-1], out_dir)}")
    if len(studies) > 1:
        err.print(f"wrote {seed_runs.load_plot(studies, out_dir)}")


def _fit(scenario: Scenario, source: str, traces_dir: Path) -> TraceFit:
    """`study seeds --fit`: the gap and token distributions of a real trace (`sim/fit.py`)."""
    from planner_service.sim.fit import fit_trace
    from planner_service.sim.windows import load_trace

    fitted = fit_trace(load_trace(source, scenario, traces_dir), source)
    g = fitted.gap_seconds
    err.print(
        f"fitted to {source}: gaps median {g.median:.1f} s, sigma {g.sigma:.2f}; tokens first / later / output "
        f"median {fitted.first_input_tokens.median:.0f} / {fitted.turn_input_tokens.median:.0f} / "
        f"{fitted.output_tokens.median:.0f}; the trace hands off on {fitted.handoff_share:.1%} of later turns",
        highlight=False,
    )
    return fitted


def _trace_study(
    scenario: Scenario,
    name: str,
    precision: str,
    source: str,
    traces_dir: Path,
    hours: float,
    policies: str,
    windows: str,
    train_windows: str,
    tune_budget: int,
    as_json: bool,
) -> None:
    """`study seeds --trace`: every policy on the reported windows of a real trace (`sim/windows.py`)."""
    from planner_service.sim import seeds as seed_runs
    from planner_service.sim import windows as window_runs
    from planner_service.sim.engine import SimulationError

    try:
        records = window_runs.load_trace(source, scenario, traces_dir)
        err.print(f"{source}: {len(records):,} records, windows of {hours:g} h", highlight=False)
        study = window_runs.window_study(
            scenario,
            records,
            source,
            hours,
            [p.strip() for p in policies.split(",") if p.strip()],
            _seed_list(windows, "seeds"),
            _seed_list(train_windows, "train-seeds"),
            tune_budget=tune_budget,
            on_progress=lambda line: err.print(line, highlight=False),
        )
    except (SimulationError, ValueError) as error:  # TraceError included
        raise fail(str(error)) from None
    if as_json:
        emit_json({"scenario": name, "precision": precision, "levels": [study.to_json()]})
        return
    columns, rows = seed_runs.table(study)
    table = Table(title=f"{source}: windows {', '.join(map(str, study.windows))} of {hours:g} h")
    for col in columns:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*row)
    out.print(table)
    out.print(window_runs.INTERVAL_NOTE, highlight=False)


@study_app.command("decompose")
def study_decompose(
    scenario: ScenarioOpt = None,
    seeds: Annotated[str, typer.Option(help="Reported seeds, comma-separated (one synthetic trace each).")] = "1,2,3",
    train_seeds: Annotated[
        str, typer.Option(help="Training seeds for static-tuned's search, kept apart from the reported ones.")
    ] = "101",
    sessions: Annotated[int, typer.Option(min=1, help="Sessions alive at a time in each trace.")] = 5,
    gap_scale: Annotated[
        str, typer.Option("--gap-scale", help="Every gap between a session's turns times this; comma-separated.")
    ] = "16",
    hours: Annotated[float, typer.Option(help="Length of each trace in hours.")] = 1.0,
    precision: Annotated[
        str, typer.Option(help="allowed or native (every policy at each model's preferred precision).")
    ] = "native",
    tune_budget: Annotated[int, typer.Option(help="Replays static-tuned's search may run (at each level).")] = 200,
    as_json: JsonOpt = False,
) -> None:
    """static-tuned, then the planner on the operator's groups without and with switch prediction, then moving
    engines: each rung over N seeds, and each step's effect paired by seed (sim/decompose.py)."""
    from planner_service.sim import decompose
    from planner_service.sim.engine import SimulationError

    parsed = _study_scenario(scenario, precision)
    levels = []
    try:
        for scale in _float_list(gap_scale, "gap-scale"):
            params = _team_trace(sessions, hours, scale)
            err.print(f"load level: {sessions} sessions, gap scale {scale:g}", highlight=False)
            levels.append(
                decompose.decompose(
                    parsed,
                    params,
                    _seed_list(seeds, "seeds"),
                    _seed_list(train_seeds, "train-seeds"),
                    tune_budget=tune_budget,
                    on_progress=lambda line: err.print(line, highlight=False),
                )
            )
    except (SimulationError, ValueError) as error:
        raise fail(str(error)) from None
    data = {
        "kind": "decomposition",
        "scenario": str(scenario) if scenario is not None else "demo",
        "precision": precision,
        "levels": levels,
    }
    if as_json:
        emit_json(data)
        return
    out.print(decompose.markdown("decomposition", data), highlight=False, soft_wrap=True)


@study_app.command("gateway")
def study_gateway(
    scenario: ScenarioOpt = None,
    policies: Annotated[str, typer.Option(help="Comma-separated policies, each run with and without warm-ups.")] = (
        "statebudget,sleep-router"
    ),
    seeds: Annotated[str, typer.Option(help="Seeds, comma-separated: one trace (or window) per workload each.")] = (
        "1,2,3,4,5,6,7,8,9,10"
    ),
    sessions: Annotated[int, typer.Option(help="Sessions alive at a time in each synthetic trace.")] = 5,
    hours: Annotated[float, typer.Option(help="Length of each synthetic trace in hours.")] = 0.5,
    gap_scale: Annotated[
        str,
        typer.Option("--gap-scale", help="Synthetic load levels: each a gap scale (the smallest is the loaded one)."),
    ] = "16,4",
    traces: Annotated[
        Path | None,
        typer.Option(help="Folder of the public traces (azure_llm_2023, alibaba_genai_2026); none: synthetic only."),
    ] = None,
    azure_window: Annotated[float, typer.Option(help="Seconds of each Azure window.")] = 60.0,
    alibaba_window: Annotated[float, typer.Option(help="Seconds of each Alibaba window.")] = 4 * 3600.0,
    precision: Annotated[str, typer.Option(help="native (every model at its preferred precision) or allowed.")] = (
        "native"
    ),
    arms: Annotated[
        str,
        typer.Option(
            help="Comma-separated arms (sim/gateway_study.py: none, warmups, warmups-top, warmups-handoff, "
            "eager-handoff); the first is the one the others are paired against."
        ),
    ] = "none,warmups,warmups-top,warmups-handoff,eager-handoff",
    replicas: ReplicasOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The gateway's warm-ups against the same policy without them, over seeds (sim/gateway_study.py)."""
    from planner_service.domain.problem import native_precision_scenario
    from planner_service.sim import gateway_study
    from planner_service.sim.engine import SimulationError
    from planner_service.sim.importers import ImportOptions
    from planner_service.sim.importers import default_registry as importers
    from planner_service.sim.synth import SynthParams

    parsed = read_scenario(scenario)
    if precision not in ("allowed", "native"):
        raise fail(f"--precision: allowed or native, got {precision!r}")
    if precision == "native":
        parsed = native_precision_scenario(parsed)
    spread = min(1800.0, hours * 900.0)
    workloads = [
        gateway_study.synthetic(
            parsed,
            SynthParams(
                sessions=sessions,
                hours=hours,
                arrival_spread_seconds=spread,
                departure_spread_seconds=spread,
                gap_scale=scale,
            ),
            f"synthetic gap ×{scale:g}",
        )
        for scale in _float_list(gap_scale, "gap-scale")
    ]
    if traces is not None:
        for fmt, folder, seconds, options, source in (
            ("azure", "azure_llm_2023", azure_window, ImportOptions(handoffs=True), "Azure LLM 2023, `--handoffs`"),
            ("alibaba", "alibaba_genai_2026", alibaba_window, ImportOptions(), "Alibaba GenAI 2026"),
        ):
            if not (traces / folder).exists():
                raise fail(f"--traces: {traces / folder} is missing")
            records = list(importers().get(fmt).records(traces / folder, parsed, options))
            workloads.append(gateway_study.window(records, seconds, fmt, source))
    try:
        data = gateway_study.gateway_study(
            parsed,
            workloads,
            [p.strip() for p in policies.split(",") if p.strip()],
            _seed_list(seeds, "seeds"),
            on_progress=lambda line: err.print(line, highlight=False),
            arms=[a.strip() for a in arms.split(",") if a.strip()],
            replicas=_replicas(replicas),
        )
    except (SimulationError, ValueError) as error:
        raise fail(str(error)) from None
    data.update(scenario=str(scenario) if scenario is not None else "demo", precision=precision)
    if as_json:
        emit_json(data)
        return
    from planner_service.sim.evidence import render_gateway

    out.print(render_gateway("gateway", data), markup=False, highlight=False)


EVIDENCE_PREAMBLE = """# Evidence: policies over seeds

Generated by `make evidence` from the stored results in docs/evidence/ (`statebudget study seeds --json`;
the decomposition and gateway sections from `study decompose --json` and `study gateway --json`) and, last,
the findings written from them (docs/evidence/findings.md); edit those, not this page. Each figure is a mean
over the reported seeds with its 95 % Student t half width.
"""


@study_app.command("evidence")
def study_evidence(
    results: Annotated[
        list[Path], typer.Argument(help="Stored results of `statebudget study seeds`, `decompose` or `gateway --json`.")
    ],
    out_path: Annotated[Path, typer.Option("--out", help="The Markdown page to write.")] = Path("docs/evidence.md"),
    findings: Annotated[
        Path | None, typer.Option(help="A Markdown file of findings from the results, appended after them.")
    ] = None,
    readme: Annotated[
        Path | None, typer.Option(help="A README whose headline block (its markers) gets the headline table.")
    ] = None,
) -> None:
    """Render docs/evidence.md from stored seed-study results (no replay), and the README's headline table."""
    from planner_service.sim.evidence import headline, render, with_headline

    try:
        page = render(results, EVIDENCE_PREAMBLE)
        if findings is not None:
            page += "\n" + findings.read_text().strip() + "\n"
        updated = with_headline(readme.read_text(), headline(results)) if readme is not None else None
    except ValueError as error:
        raise fail(str(error)) from None
    except OSError as error:
        raise fail(f"--findings / --readme: {error}") from None
    out_path.write_text(page)
    err.print(f"wrote {out_path}")
    if readme is not None and updated is not None:
        readme.write_text(updated)
        err.print(f"wrote the headline table into {readme}")


def main() -> None:  # pragma: no cover - console script entry
    app()


if __name__ == "__main__":
    app()
