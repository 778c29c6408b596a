"""`docs/reliability.md` from the trials' results, and the summary `make soak` prints."""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from planner_service.soak.faults import FaultCase
from planner_service.soak.fuzz import PHASES, FuzzRun
from planner_service.soak.trials import KillResult, LoadResult

LATENCY_KINDS = (
    ("event", "POST /v1/events"),
    ("report", "POST /v1/operations/{id}/report"),
    ("lease", "POST /v1/nodes/{id}/lease (long-poll, wait ≤ 1 s)"),
    ("read srv", "GET /v1/srv"),
)


@dataclass(frozen=True)
class Results:
    loads: Sequence[LoadResult]
    kill: KillResult | None
    faults: Sequence[FaultCase]
    seconds: float
    fuzz: Sequence[FuzzRun] = ()

    @property
    def ok(self) -> bool:
        return (
            all(r.ok for r in self.loads)
            and (self.kill is None or self.kill.ok)
            and all(c.ok or c.open for c in self.faults)
            and all(f.ok for f in self.fuzz)
        )


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    if names:
        cpu = names[0]
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{cpu}, {usable} usable CPU(s); {platform.system()} {platform.release()}; Python {platform.python_version()}"
    )


def commit(root: Path) -> str:
    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", *args], check=False, cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "planner_service", "clients")
    return f"{head}" + (" (with uncommitted changes to planner_service or clients)" if dirty else "")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _yes(ok: bool) -> str:
    return "ok" if ok else "**FAILED**"


def _load_rows(loads: Sequence[LoadResult]) -> list[str]:
    head = "| | " + " | ".join(f"`{r.config.name}`" for r in loads) + " |"
    rows = [head, "|---|" + "---|" * len(loads)]

    def row(label: str, cells: list[str]) -> None:
        rows.append(f"| {label} | " + " | ".join(cells) + " |")

    row("result", [_yes(r.ok) for r in loads])
    row("cluster", [f"{r.nodes} nodes, {r.gpus} GPUs" for r in loads])
    row("node agents (per node)", [f"{r.agents} ({r.config.agents_per_node})" for r in loads])
    row("load", [f"{r.config.events_per_second:g} events/s from {r.config.sessions} sessions" for r in loads])
    row(
        "ran", [f"{r.seconds:.0f} s ({r.events_acked / max(r.seconds, 1e-9):.1f} events/s acknowledged)" for r in loads]
    )
    row("events sent / acknowledged / lost", [f"{r.events_sent} / {r.events_acked} / {r.events_lost}" for r in loads])
    row(
        "reports done (resent, answered duplicate)",
        [f"{r.reports_done} ({r.tally.of('resend', '200')})" for r in loads],
    )
    row("reports refused 409 (lease ran out or superseded)", [str(r.tally.of("report", "409")) for r in loads])
    row("done reports recorded as conflicts", [str(len(r.conflicts)) for r in loads])
    row("double-applied", [str(len(r.double_applied) + len(r.resent_not_duplicate)) for r in loads])
    row(
        "capacity or size violations (watched rounds)",
        [f"{r.capacity_violations} ({r.watch_rounds} rounds)" for r in loads],
    )
    row(
        "replay of the done reports = confirmed placement",
        [f"{'yes' if not r.placement_differences else '**no**'} ({r.replay_applied} applied)" for r in loads],
    )
    row("5xx answers", [str(r.tally.status_5xx()) for r in loads])
    row("plan epochs (first → last seen)", [f"{r.epochs[0]} → {r.epochs[1]}" if r.epochs else "-" for r in loads])
    row("SIGTERM: exit, seconds", [f"{r.sigterm_exit}, {_ms(r.sigterm_seconds)}" for r in loads])
    row(
        "restart on the same database",
        [
            f"{_yes(r.restart_ok)}: ready in {r.restart_seconds:.1f} s, SRV version "
            f"{r.restored_version[0]} → {r.restored_version[1]}, placement "
            f"{'the same' if r.restored_placement else '**different**'}, {r.quarantine} quarantined"
            if r.restored_version and r.restart_seconds is not None
            else f"**failed**: {(r.restart_error or r.error or '')[:200]}"
            for r in loads
        ],
    )
    row(
        "log: unplannable / tracebacks",
        [f"{r.alarms.get('unplannable', 0)} / {r.alarms.get('tracebacks', 0)}" for r in loads],
    )
    for kind, label in LATENCY_KINDS:
        cells = []
        for r in loads:
            p50, p99 = r.tally.percentiles_ms(kind)
            cells.append(f"{_ms(p50)} / {_ms(p99)}")
        row(f"{label}: p50 / p99 ms", cells)
    return rows


def _phases(run: FuzzRun) -> str:
    return ", ".join(f"{phase} {run.phases.get(phase, 'did not run')}" for phase in PHASES)


def _findings(results: Results) -> list[str]:
    lines = []
    for r in results.loads:
        items = [
            ("error", [r.error] if r.error else []),
            ("capacity or size violations seen while running", r.watch_violations),
            ("violations in the replay", r.replay_violations),
            ("double-applied", r.double_applied + r.resent_not_duplicate),
            ("sources that did not hold what they gave", r.source_short[:10]),
            ("replay differs from the confirmed placement", r.placement_differences),
            ("5xx answers", r.tally.server_errors),
            ("conflicts", r.conflicts[:10]),
            ("restart", [r.restart_error] if r.restart_error else []),
        ]
        for what, found in items:
            if found:
                lines.append(f"- `{r.config.name}`, {what}:")
                lines += [f"  - `{f}`" for f in found[:10]]
    for f in results.fuzz:
        if f.failures:
            lines.append(f"- fuzzing, `{f.label}`:")
            lines += [f"  - `{line[:300]}`" for line in f.failures[:10]]
    if results.kill is not None:
        if results.kill.error:
            lines.append(f"- SIGKILL trials: `{results.kill.error[:500]}`")
        for t in results.kill.trials:
            if not t.ok:
                what = t.error or "; ".join(t.placement_differences[:3]) or "see the table"
                lines.append(f"- SIGKILL trial {t.trial}: `{what[:500]}`")
    return lines


def render(results: Results, root: Path) -> str:
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        "# Reliability",
        "",
        (
            "Regenerated by `make soak` (`python -m planner_service.soak`, the harness in `planner_service/soak/`); "
            "`tests/e2e/test_soak.py` runs a bounded version of each trial. Do not edit this page by hand."
        ),
        "",
        f"- date: {now}",
        f"- machine: {machine()}",
        f"- commit: `{commit(root)}`",
        f"- the whole run: {results.seconds / 60:.1f} min; result: {_yes(results.ok)}",
        "",
        (
            "Every trial runs `statebudget serve` as a real process on a loopback port with a fresh database in a "
            "temporary folder, and talks to it only over HTTP."
        ),
        "",
    ]
    if results.loads:
        out += [
            "## Steady load with node agents, and a restart",
            "",
            (
                "The load scenario (F1): the service seeded with the demo (or a generated cluster), node "
                "agents that long-poll their node's queue (several per node, competing for it), run each operation "
                "(a sleep of 1 % of its estimate) and report it `done` with a measured time within ±20 % of the "
                "estimate and the planned bytes, and sessions that send `request`, `tool_call_start`, "
                "`tool_call_end`, `turn_end` and `session_end` in that order, one event per request, over the "
                "models of the catalog (a session keeps its model 60 % of the turns). While it runs, the confirmed "
                "state is read every second (`/v1/srv`, `/v1/cluster`, `/v1/sessions`) and checked: no GPU, host "
                "or NVMe over its capacity, no location holding more of an object than its full size. At the end "
                "the reports answered `done` are replayed, in the order the service applied them, onto the seeded "
                "placement, checking the same invariants at every step (an operation that lands bytes an object "
                "already holds in full is double-applied), and the result must equal the confirmed placement. "
                "Then SIGTERM, a start on the same database, and the same SRV version and placement."
            ),
            "",
            *_load_rows(results.loads),
            "",
        ]
    if results.kill is not None:
        k = results.kill
        startups = [t.startup_seconds for t in k.trials if t.startup_seconds is not None]
        ok_restarts = len(startups)
        out += [
            "## SIGKILL under mixed load",
            "",
            (
                f"One database, {len(k.trials)} times: {k.config.events_per_second:g} events/s in batches of up to "
                f"{k.config.batch} from {k.config.sessions} sessions, one agent per node leasing, reporting "
                f"(5 % failed, 10 % sent twice) and a timed replan every {k.config.replan_interval_seconds:g} s; "
                f"SIGKILL after a random {k.config.min_load_seconds:g}–{k.config.max_load_seconds:g} s; "
                "`PRAGMA integrity_check`; a start on the same database. Then every event that was answered 200 "
                "is sent again and must answer `duplicate`, every report answered 200 must have its operation in "
                "its state under its lease and answer `duplicate` when sent again, the SRV version must not be "
                "older than any report's answer, and the operations done since the trial began, replayed onto "
                "the placement it began with, must give the restored placement."
            ),
            "",
            "| figure | value |",
            "|---|---|",
            f"| result | {_yes(k.ok)} |",
            f"| trials | {len(k.trials)} |",
            f"| events acknowledged / lost | {k.total('events_acked')} / {k.total('events_lost')} |",
            f"| reports acknowledged / lost | {k.total('reports_acked')} / {k.total('reports_lost')} |",
            f"| double-applied | {k.total('double_applied')} |",
            f"| SRV version older than acknowledged | {k.total('version_regressed')} |",
            f"| integrity_check ok | {sum(1 for t in k.trials if t.integrity == 'ok')} of {len(k.trials)} |",
            f"| restarts ok | {ok_restarts} of {len(k.trials)} |",
            (
                f"| restored placement = replay | {sum(1 for t in k.trials if not t.placement_differences)} "
                f"of {len(k.trials)} |"
            ),
            f"| 5xx answers before the kill | {k.total('errors_5xx')} |",
            "| startup seconds p50 / max | "
            + (f"{float(np.median(startups)):.1f} / {max(startups):.1f}" if startups else "-")
            + " |",
            "",
            "<details><summary>each trial</summary>",
            "",
            "| trial | load s | events acked | lost | reports acked | lost | double | integrity | startup s | ok |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *[
                f"| {t.trial} | {t.load_seconds:.1f} | {t.events_acked} | {t.events_lost} | {t.reports_acked} | "
                f"{t.reports_lost} | {t.double_applied} | {t.integrity} | "
                f"{'-' if t.startup_seconds is None else f'{t.startup_seconds:.1f}'} | {_yes(t.ok)} |"
                for t in k.trials
            ],
            "",
            "</details>",
            "",
        ]
    if results.faults:
        out += [
            "## Fault cases",
            "",
            (
                "The fault cases F2, F3, F5, F6 and F7 against a real server (an operator token, leases of a few "
                "seconds); each bad number is written into the JSON text as such. `tests/api/test_api_bounds.py`, "
                "`tests/service/test_calibration.py` and `tests/api/test_api_access_log.py` hold the in-process "
                "tests of the same cases."
            ),
            "",
            "| issue | case | expected | observed | result |",
            "|---|---|---|---|---|",
            *[
                f"| {c.issue} | {c.name} | {c.expected} | {c.observed} | "
                f"{'ok' if c.ok else ('open' if c.open else '**FAILED**')} |"
                for c in results.faults
            ],
            "",
        ]
    if results.fuzz:
        out += [
            "## Fuzzing",
            "",
            (
                "schemathesis against a fresh `statebudget serve --demo`, once with no tokens configured and once "
                "with operator and node tokens: the coverage, fuzzing and stateful phases (the stateful one "
                "follows the links schemathesis infers from the OpenAPI document), with every check, the "
                "conformance ones included (`planner_service/soak/fuzz.py` lists the answers a valid request may "
                "get and the one exemption). `tests/api/test_api_schemathesis.py` runs the same in process, bounded."
            ),
            "",
            "| run | requests: coverage / fuzzing / stateful | phases | failures | result |",
            "|---|---|---|---|---|",
            *[
                f"| {f.label} | "
                + " / ".join(str(f.requests.get(p, 0)) for p in PHASES)
                + f" | {_phases(f)} | {len(f.failures)} | "
                f"{_yes(f.ok)} |"
                for f in results.fuzz
            ],
            "",
        ]
    findings = _findings(results)
    out += ["## Findings", ""] + (findings or ["None: every check held."]) + [""]
    return "\n".join(out)


def summary(results: Results) -> list[str]:
    """One line per trial, for the terminal."""
    lines = []
    for r in results.loads:
        p50, p99 = r.tally.percentiles_ms("event")
        lines.append(
            f"{_yes(r.ok):>10}  load {r.config.name}: {r.seconds:.0f} s, events {r.events_acked}/{r.events_sent} "
            f"acknowledged, reports {r.reports_done}, double-applied "
            f"{len(r.double_applied) + len(r.resent_not_duplicate)}, capacity violations {r.capacity_violations}, "
            f"5xx {r.tally.status_5xx()}, restart {'ok' if r.restart_ok else 'FAILED'}, event p50/p99 "
            f"{_ms(p50)}/{_ms(p99)} ms"
        )
    if results.kill is not None:
        k = results.kill
        lines.append(
            f"{_yes(k.ok):>10}  SIGKILL: {len(k.trials)} trials, events lost {k.total('events_lost')} of "
            f"{k.total('events_acked')}, reports lost {k.total('reports_lost')} of {k.total('reports_acked')}, "
            f"double-applied {k.total('double_applied')}, restarts ok "
            f"{sum(1 for t in k.trials if t.startup_seconds is not None)}"
        )
    for c in results.faults:
        state = "ok" if c.ok else ("open" if c.open else "FAILED")
        lines.append(f"{state:>10}  {c.issue} {c.name}: {c.observed}")
    for f in results.fuzz:
        sent = sum(f.requests.values())
        lines.append(f"{_yes(f.ok):>10}  fuzzing {f.label}: {sent} requests, {len(f.failures)} failures")
    return lines
