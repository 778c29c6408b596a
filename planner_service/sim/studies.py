"""The paper's measurements on a trace: H1 (pooling), H3 (first killer), Pareto (switch vs warm bytes).

H1 and H3 read the trace alone with the scenario's model sizes: a session is
*on* a model from each of its requests until its next request or its end,
and its KV for that model is its history (input + output of every earlier
turn) times the model's KV bytes per token. Pareto replays the trace under
the `statebudget` policy once per warm-memory price.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from planner_service.domain.scenario import Scenario
from planner_service.domain.state import Tier
from planner_service.domain.units import GIB
from planner_service.planner import costs, engine_costs
from planner_service.planner.residency import ResidencyIndex
from planner_service.sim.engine import base_problem, simulate
from planner_service.sim.metrics import summarize
from planner_service.sim.policies import create_policy
from planner_service.sim.trace import TraceEnd, TraceRecord, TraceRequest

PARETO_PRICES_SECONDS_PER_GIB = (0.0, 0.01, 0.02, 0.05, 0.2, 1.0)


@dataclass
class StudyResult:
    title: str
    columns: list[str]
    rows: list[list[str]]
    plot: Path
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def occupancy(
    scenario: Scenario, records: Sequence[TraceRecord]
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Step series at every trace event: (times, active model count, KV bytes per model)."""
    problem = base_problem(scenario)
    on: dict[str, tuple[str, int]] = {}  # session -> (model, KV bytes)
    history: dict[str, int] = defaultdict(int)
    models = sorted(problem.models)
    times, counts = [], []
    kv: dict[str, list[int]] = {m: [] for m in models}
    for rec in records:
        if isinstance(rec, TraceEnd):
            on.pop(rec.session, None)
        elif isinstance(rec, TraceRequest) and rec.model in problem.models:
            kvpt = problem.models[rec.model].kv_bytes_per_token
            history[rec.session] += rec.input_tokens + rec.output_tokens
            on[rec.session] = (rec.model, history[rec.session] * kvpt)
        per_model: dict[str, int] = defaultdict(int)
        for model, nbytes in on.values():
            per_model[model] += nbytes
        times.append(rec.t)
        counts.append(len(per_model))
        for m in models:
            kv[m].append(per_model.get(m, 0))
    return np.array(times), np.array(counts), {m: np.array(v) for m, v in kv.items()}


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _time_weights(times: np.ndarray) -> np.ndarray:
    if times.size < 2:
        return np.ones_like(times, dtype=float)
    dt = np.diff(times, append=times[-1])
    return dt if dt.sum() > 0 else np.ones_like(times, dtype=float)


def _weighted_cdf(values: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(values, kind="stable")
    v, w = values[order], weights[order]
    return v, np.cumsum(w) / w.sum()


def study_h1(scenario: Scenario, records: Sequence[TraceRecord], out_dir: Path) -> StudyResult:
    times, counts, kv = occupancy(scenario, records)
    if times.size == 0:
        raise ValueError("the trace has no requests on the scenario's models")
    weights = _time_weights(times)
    total_kv = sum(kv.values(), np.zeros(times.size, dtype=np.int64))
    per_model_peaks = {m: int(v.max()) for m, v in kv.items()}
    sum_of_peaks = sum(per_model_peaks.values())
    pooled_peak = int(total_kv.max())
    gain = sum_of_peaks / pooled_peak if pooled_peak else 1.0
    rows = []
    for q in (50, 90, 95, 99, 100):
        c_v, c_w = _weighted_cdf(counts.astype(float), weights)
        k_v, k_w = _weighted_cdf(total_kv.astype(float), weights)
        c = c_v[min(int(np.searchsorted(c_w, q / 100)), c_v.size - 1)]
        k = k_v[min(int(np.searchsorted(k_w, q / 100)), k_v.size - 1)]
        rows.append([f"P{q}", f"{c:.0f}", f"{k / GIB:.2f}"])
    notes = [
        (
            f"per-model KV pools must each hold their own peak: {sum_of_peaks / GIB:.1f} GiB in all; a pooled "
            f"allocation needs only the peak of the sum, {pooled_peak / GIB:.1f} GiB: pooling gains {gain:.2f}x "
            f"KV capacity ({(sum_of_peaks - pooled_peak) / GIB:.1f} GiB)"
        )
    ]
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    v, w = _weighted_cdf(counts.astype(float), weights)
    axes[0].step(v, w, where="post")
    axes[0].set_xlabel("concurrently active models")
    axes[0].set_ylabel("share of time")
    v, w = _weighted_cdf(total_kv / GIB, weights)
    axes[1].step(v, w, where="post", label="pooled (sum)")
    axes[1].axvline(sum_of_peaks / GIB, color="C3", linestyle="--", label="per-model pools (sum of peaks)")
    axes[1].set_xlabel("aggregate KV (GiB)")
    axes[1].legend()
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.suptitle("H1: active models and aggregate KV over the trace")
    path = _save(plt, fig, out_dir / "h1.png")
    data = {
        "active_models_quantiles": {r[0]: float(r[1]) for r in rows},
        "aggregate_kv_bytes_quantiles": {r[0]: float(r[2]) * GIB for r in rows},
        "per_model_peak_kv_bytes": per_model_peaks,
        "sum_of_peaks_bytes": sum_of_peaks,
        "pooled_peak_bytes": pooled_peak,
        "pooling_gain": round(gain, 4),
    }
    return StudyResult(
        "H1: concurrently active models and aggregate KV",
        ["quantile", "active models", "aggregate KV GiB"],
        rows,
        path,
        notes,
        data,
    )


def study_h3(scenario: Scenario, records: Sequence[TraceRecord], out_dir: Path) -> StudyResult:
    problem = base_problem(scenario)
    times, _, kv = occupancy(scenario, records)
    demand: dict[str, int] = defaultdict(int)
    for r in records:
        if isinstance(r, TraceRequest) and r.model in problem.models:
            demand[r.model] += 1
    order = sorted(problem.models, key=lambda m: (-demand[m], m))
    hbm = sum(g.capacity_bytes for g in problem.gpus.values())
    rows, data_rows = [], []
    weights_total = 0
    killer = None
    for k, model_id in enumerate(order, start=1):
        model = problem.models[model_id]
        weights_total += model.weights_bytes[model.preferred] + model.experts_bytes
        warm = order[:k]
        peak_kv = int(sum((kv[m] for m in warm), np.zeros(times.size, dtype=np.int64)).max()) if times.size else 0
        free = hbm - weights_total - peak_kv
        nxt = order[k] if k < len(order) else None
        cold = _cold_load_seconds(problem, nxt) if nxt else math.nan
        if killer is None and weights_total > hbm:
            killer = ("weights", k)
        elif killer is None and free < 0:
            killer = ("kv", k)
        rows.append(
            [
                str(k),
                model_id,
                f"{weights_total / GIB:.0f}",
                f"{peak_kv / GIB:.1f}",
                f"{free / GIB:.0f}",
                nxt or "-",
                f"{cold:.1f}" if nxt else "-",
            ]
        )
        data_rows.append(
            {
                "warm_models": k,
                "added": model_id,
                "weights_bytes": weights_total,
                "peak_kv_bytes": peak_kv,
                "free_bytes": free,
                "next_model": nxt,
                "next_cold_load_seconds": None if not nxt else round(cold, 3),
            }
        )
    notes = [f"cluster HBM {hbm / GIB:.0f} GiB (weights include routed experts)"]
    if killer:
        notes.append(f"first to run out: {killer[0]} when warm model {killer[1]} ({order[killer[1] - 1]}) is added")
    else:
        notes.append("every model fits warm with its peak KV")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ks = [r["warm_models"] for r in data_rows]
    w = np.array([r["weights_bytes"] for r in data_rows]) / GIB
    p = np.array([r["peak_kv_bytes"] for r in data_rows]) / GIB
    ax.bar(ks, w, label="weights + experts")
    ax.bar(ks, p, bottom=w, label="peak KV")
    ax.axhline(hbm / GIB, color="k", linestyle="--", label="cluster HBM")
    ax.set_xticks(ks, [f"{k}\n{m}" for k, m in zip(ks, order, strict=True)], fontsize=8)
    ax.set_ylabel("GiB")
    ax.set_title("H3: warm models added one by one")
    ax.legend()
    path = _save(plt, fig, out_dir / "h3.png")
    data = {"hbm_bytes": hbm, "rows": data_rows, "first_killer": killer[0] if killer else None}
    return StudyResult(
        "H3: which runs out first as warm models are added",
        ["warm", "added", "weights GiB", "peak KV GiB", "free GiB", "next model", "its cold load s"],
        rows,
        path,
        notes,
        data,
    )


def _cold_load_seconds(problem, model_id: str) -> float:
    """The fastest cold start of the model on one node's GPUs, its weights read from NVMe
    (engine_costs.bring_up_seconds from an empty placement: every engine stopped)."""
    model = problem.models[model_id]
    empty = ResidencyIndex.build(problem, {})
    best = math.inf
    for node in problem.nodes.values():
        group = costs.cold_group(problem, model, model.preferred, node)
        if group is None:
            continue
        best = min(best, engine_costs.bring_up_seconds(problem, empty, model, model.preferred, group, Tier.NVME, node))
    return best


def study_pareto(
    scenario: Scenario,
    records: Sequence[TraceRecord],
    out_dir: Path,
    prices: Sequence[float] = PARETO_PRICES_SECONDS_PER_GIB,
) -> StudyResult:
    rows, points = [], []
    for price in prices:
        constants = scenario.constants.model_copy(update={"gpu_price_seconds_per_gib": price})
        priced = scenario.model_copy(update={"constants": constants})
        summary = summarize(simulate(priced, records, create_policy("statebudget")))
        p95 = summary["switch_latency_seconds"]["all"]["p95"]
        h95 = summary["switch_latency_seconds"]["handoff"]["p95"]
        gib = summary["gpu_bytes"]["mean"] / GIB
        points.append(
            {
                "gpu_price_seconds_per_gib": price,
                "switch_p95_seconds": p95,
                "handoff_p95_seconds": h95,
                "gpu_bytes_mean": summary["gpu_bytes"]["mean"],
            }
        )
        rows.append([f"{price:g}", f"{gib:.0f}", f"{p95:.2f}", f"{h95:.2f}"])
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    xs = [p["gpu_bytes_mean"] / GIB for p in points]
    ax.plot(xs, [p["switch_p95_seconds"] for p in points], "o-", label="all requests")
    ax.plot(xs, [p["handoff_p95_seconds"] for p in points], "s--", label="hand-offs")
    for p, x in zip(points, xs, strict=True):
        ax.annotate(f"{p['gpu_price_seconds_per_gib']:g}", (x, p["switch_p95_seconds"]), fontsize=7)
    ax.set_xlabel("mean GPU bytes kept (GiB)")
    ax.set_ylabel("P95 switch latency (s)")
    ax.set_title("Pareto: switch latency vs warm memory (labels: price s/GiB)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = _save(plt, fig, out_dir / "pareto.png")
    return StudyResult(
        "Pareto: P95 switch latency against GPU bytes kept warm (statebudget, varying the warm-memory price)",
        ["price s/GiB", "mean GPU GiB", "P95 switch s", "P95 hand-off s"],
        rows,
        path,
        [],
        {"points": points},
    )


STUDIES = {"h1": study_h1, "h3": study_h3, "pareto": study_pareto}


def run_study(kind: str, scenario: Scenario, records: Sequence[TraceRecord], out_dir: Path) -> StudyResult:
    try:
        study = STUDIES[kind]
    except KeyError:
        raise ValueError(f"unknown study {kind!r}; choose one of: {', '.join(STUDIES)}") from None
    return study(scenario, records, out_dir)
