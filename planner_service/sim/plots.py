"""PNG figures of a replay (matplotlib, Agg backend, imported only when a plot is drawn)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from planner_service.domain.units import GIB
from planner_service.sim.engine import SimResult


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_with_legend(plt, fig, ax, path: Path) -> Path:
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def switch_latency_cdf(results: dict[str, SimResult], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, result in results.items():
        values = np.sort([max(r.switch_seconds, 1e-3) for r in result.requests if r.state == "done"])
        if values.size:
            ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("switch latency (s, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_title("Switch latency CDF per policy")
    return _save_with_legend(plt, fig, ax, path)


def gpu_memory_over_time(results: dict[str, SimResult], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, result in results.items():
        points = result.timeline
        if len(points) > 4000:  # thin for drawing; the step shape is kept at this resolution
            step = len(points) // 4000 + 1
            points = points[::step] + [points[-1]]
        t = np.array([p[0] for p in points] + [result.duration_seconds]) / 3600
        b = np.array([p[1] for p in points] + [points[-1][1]]) / GIB
        ax.step(t, b, where="post", label=name, linewidth=0.9)
    ax.set_xlabel("time (h)")
    ax.set_ylabel("GPU bytes held (GiB)")
    ax.set_title("GPU memory over time per policy")
    return _save_with_legend(plt, fig, ax, path)


def comparison_bars(report: dict[str, Any], path: Path) -> Path:
    plt = _pyplot()
    names = list(report["policies"])
    floor = report.get("trace", {}).get("handoff_reprefill_floor_seconds", {}).get("p95")
    metrics = [  # (title, value, log scale: latencies of policies far apart stay readable, a floor to draw)
        ("hand-off switch P95 (s)", lambda m: m["switch_latency_seconds"]["handoff"]["p95"], True, floor),
        ("switch P50 (s)", lambda m: m["switch_latency_seconds"]["all"]["p50"], True, None),
        ("TTFT P95 (s)", lambda m: m["ttft_seconds"]["p95"], True, None),
        ("mean GPU GiB", lambda m: m["gpu_bytes"]["mean"] / GIB, False, None),
    ]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 4))
    for ax, (title, get, log, line) in zip(axes, metrics, strict=True):
        values = [get(report["policies"][n]) for n in names]
        ax.bar(range(len(names)), values, color=[f"C{i}" for i in range(len(names))])
        if log and any(v > 0 for v in values):
            ax.set_yscale("log")
        if line:
            ax.axhline(line, color="black", linestyle="--", linewidth=1, label="re-prefill floor")
            ax.legend(loc="upper left", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right")
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def replay_plots(results: dict[str, SimResult], report: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        switch_latency_cdf(results, out_dir / "switch_latency_cdf.png"),
        gpu_memory_over_time(results, out_dir / "gpu_memory.png"),
        comparison_bars(report, out_dir / "comparison.png"),
    ]
