"""A replay of one trace under several policies: run, summarize, print, write JSON."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner_service.domain.problem import Problem
from planner_service.domain.scenario import Scenario, SloClassConstants
from planner_service.domain.units import GIB
from planner_service.sim.engine import SimResult, base_problem, simulate
from planner_service.sim.floor import handoff_reprefill_floor
from planner_service.sim.metrics import DEFAULT_TTFT_TARGETS, latency_summary, summarize
from planner_service.sim.policies import create_policy
from planner_service.sim.slots import saturated
from planner_service.sim.trace import TraceRecord, TraceRequest


@dataclass
class Replay:
    results: dict[str, SimResult]
    report: dict[str, Any]


def trace_summary(records: Sequence[TraceRecord], problem: Problem) -> dict[str, Any]:
    """The trace's size, and the re-prefill floor of its hand-offs on the scenario's cluster (`floor.py`)."""
    requests = [r for r in records if isinstance(r, TraceRequest)]
    return {
        "requests": len(requests),
        "sessions": len({r.session for r in requests}),
        "models": sorted({r.model for r in requests}),
        "duration_seconds": round(max((r.t for r in records), default=0.0), 3),
        "handoff_reprefill_floor_seconds": latency_summary(handoff_reprefill_floor(problem, records)),
    }


def scenario_summary(problem: Problem, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "gpus": len(problem.gpus),
        "hbm_bytes": int(sum(g.capacity_bytes for g in problem.gpus.values())),
        "models": sorted(problem.models),
    }


def replay(
    scenario: Scenario,
    records: Sequence[TraceRecord],
    policies: Sequence[str],
    *,
    scenario_name: str = "demo",
    seed: int = 0,
    targets: SloClassConstants = DEFAULT_TTFT_TARGETS,
    on_progress: Callable[[str, float], None] | None = None,
    expert_miss_decode: bool = True,
    gateway: str = "none",
    replicas: Mapping[str, int] | None = None,
) -> Replay:
    """Run every policy on the same trace; the report is what `statebudget replay --json` writes. `replicas`:
    model -> its engine instances (`replicas.py`)."""
    missing = sorted({r.model for r in records if isinstance(r, TraceRequest)} - {m.id for m in scenario.models})
    if missing:
        raise ValueError(f"the trace asks for models the scenario lacks: {', '.join(missing)}")
    results: dict[str, SimResult] = {}
    for name in policies:
        policy = create_policy(name)
        progress = (lambda t, n=name: on_progress(n, t)) if on_progress else None
        results[name] = simulate(
            scenario,
            records,
            policy,
            seed=seed,
            on_progress=progress,
            expert_miss_decode=expert_miss_decode,
            gateway=gateway,
            replicas=replicas,
        )
        if on_progress:
            on_progress(name, results[name].duration_seconds)
    problem = base_problem(scenario)
    trace_seconds = max((r.t for r in records), default=0.0)
    summaries = {}
    for name, result in results.items():
        # a run that overran the trace by more than 5 % is saturated: no ratio is quoted from it
        summaries[name] = {**summarize(result, targets), "saturated": saturated(result.duration_seconds, trace_seconds)}
    report = {
        "trace": trace_summary(records, problem),
        "scenario": scenario_summary(problem, scenario_name),
        "seed": seed,
        "expert_miss_decode": expert_miss_decode,
        "gateway": gateway,
        "replicas": dict(sorted((replicas or {}).items())),
        "ttft_targets_seconds": targets.model_dump(),
        "policies": summaries,
    }
    return Replay(results, report)


def comparison(report: dict[str, Any], policy: str = "statebudget") -> dict[str, float]:
    """The headline ratios against `static` and `lru`, the share of the static -> oracle gap closed, and how
    far the policy's hand-off P95 is above the trace's re-prefill floor (what no policy beats). A saturated
    run (`slots.saturated`) is left out of every ratio, the policy's own included."""
    pols = {name: m for name, m in report["policies"].items() if not m.get("saturated")}
    out: dict[str, float] = {}
    if policy not in pols:
        return out

    def p95(name: str) -> float:
        return pols[name]["switch_latency_seconds"]["handoff"]["p95"]

    for base in ("static", "lru"):
        if base in pols and p95(base) > 0:
            out[f"handoff_p95_vs_{base}"] = round(p95(policy) / p95(base), 4)
    if "static" in pols and pols["static"]["gpu_bytes"]["mean"]:
        out["gpu_bytes_mean_vs_static"] = round(
            pols[policy]["gpu_bytes"]["mean"] / pols["static"]["gpu_bytes"]["mean"], 4
        )
    if "static" in pols and "oracle" in pols:
        gap = p95("static") - p95("oracle")
        if gap > 0:
            out["static_oracle_gap_closed"] = round((p95("static") - p95(policy)) / gap, 4)
    floor = report["trace"].get("handoff_reprefill_floor_seconds", {}).get("p95", 0.0)
    if floor > 0:
        out["handoff_p95_vs_floor"] = round(p95(policy) / floor, 4)
    return out


def table_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, m in report["policies"].items():
        sw, ho = m["switch_latency_seconds"]["all"], m["switch_latency_seconds"]["handoff"]
        rows.append(
            [
                name,
                str(m["requests"]),
                str(m["failed_requests"]["all"]),
                f"{sw['p50']:.2f}",
                f"{sw['p95']:.2f}",
                f"{ho['p95']:.2f}",
                f"{ho['p99']:.2f}",
                f"{m['handoff_prefill_wait_seconds']['wait']['p95']:.2f}",
                f"{m['ttft_seconds']['p95']:.2f}",
                f"{m['completion_seconds']['p95']:.2f}",
                f"{m['slo_violation_rate']['all']:.1%}",
                f"{m['degraded_precision_rate']:.1%}",
                f"{m['gpu_bytes']['mean'] / GIB:.0f} / {m['gpu_bytes']['peak'] / GIB:.0f}",
                f"{m['warm_idle_gpu_bytes']['mean'] / GIB:.0f}",
                f"{m['bytes_moved'] / GIB:.0f}",
                str(m["operations"]),
                f"{m['planner_seconds']['p50'] * 1000:.1f} / {m['planner_seconds']['p99'] * 1000:.1f}",
                "yes" if m.get("saturated") else "no",
            ]
        )
    return rows


TABLE_COLUMNS = (
    "policy",
    "requests",
    "failed",
    "switch P50 s",
    "switch P95 s",
    "hand-off P95 s",
    "hand-off P99 s",
    "hand-off card wait P95 s",
    "TTFT P95 s",
    "done P95 s",
    "SLO miss",
    "degraded precision",
    "GPU GiB mean / peak",
    "warm idle GiB",
    "moved GiB",
    "ops",
    "planner ms P50 / P99",
    "saturated",
)


def write_json(path: Path, report: dict[str, Any]) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
