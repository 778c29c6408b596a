"""Policies over many seeds: each metric's mean with its 95 % t-interval (`intervals.py`).

Every reported seed draws one synthetic trace (`synth.py`) and replays it under every policy. A policy
tuned on traces (`static-tuned`'s partition search) is tuned on its own training seeds, which must not
be reported seeds, and then replayed unchanged on the reported ones. A run that overran its trace by
more than 5 % (`slots.saturated`) is counted beside its policy's figures; the intervals include it, and
a comparison should quote no ratio from a policy with saturated runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from planner_service.domain.scenario import Scenario
from planner_service.domain.units import GIB
from planner_service.sim.engine import SimResult, simulate
from planner_service.sim.intervals import Interval, t_interval
from planner_service.sim.metrics import summarize
from planner_service.sim.policies import PolicyName, create_policy
from planner_service.sim.policies.static_tuned import TuneResult, tune_static
from planner_service.sim.slots import saturated
from planner_service.sim.state import SWITCH_PARTS
from planner_service.sim.synth import SynthParams, synth_trace
from planner_service.sim.trace import TraceRecord

# (key, column, how to read it from a replay's summary)
METRICS: tuple[tuple[str, str, Callable[[dict[str, Any]], float]], ...] = (
    ("handoff_p95_seconds", "hand-off P95 s", lambda s: s["switch_latency_seconds"]["handoff"]["p95"]),
    ("switch_p95_seconds", "switch P95 s", lambda s: s["switch_latency_seconds"]["all"]["p95"]),
    ("ttft_p95_seconds", "TTFT P95 s", lambda s: s["ttft_seconds"]["p95"]),
    ("completion_p95_seconds", "done P95 s", lambda s: s["completion_seconds"]["p95"]),
    ("gpu_gib_mean", "GPU GiB mean", lambda s: s["gpu_bytes"]["mean"] / GIB),
    ("moved_gib", "moved GiB", lambda s: s["bytes_moved"] / GIB),
    ("cold_starts", "cold starts", lambda s: float(s["engine_transitions"].get("cold_start", 0))),
    ("degraded_share", "degraded share", lambda s: s["degraded_precision_rate"]),
    ("failed_requests", "failed requests", lambda s: float(s["failed_requests"]["all"])),
)


@dataclass
class SeedStudy:
    policies: list[str]
    seeds: list[int]
    train_seeds: list[int]
    params: SynthParams
    intervals: dict[str, dict[str, Interval]]  # policy -> metric -> interval over seeds
    saturated_runs: dict[str, int]  # policy -> runs past the trace by more than 5 %
    runs: dict[str, list[dict[str, Any]]]  # policy -> per-seed metrics
    tuning: TuneResult | None = None
    notes: list[str] = field(default_factory=list)
    fit: dict[str, Any] | None = None  # the real trace the gaps and tokens were fitted to (`fit.py`), if any

    def to_json(self) -> dict[str, Any]:
        return {
            "policies": self.policies,
            "seeds": self.seeds,
            "train_seeds": self.train_seeds,
            "trace": {
                "sessions": self.params.sessions,
                "hours": self.params.hours,
                "users": self.params.users,
                "gap_scale": self.params.gap_scale,
                "handoff_rate": self.params.handoff_rate,
                "context": self.params.context,
                "fit": self.fit,
            },
            "interval": "95 % Student t over seeds",
            "metrics": {p: {k: v.to_json() for k, v in m.items()} for p, m in self.intervals.items()},
            "saturated_runs": self.saturated_runs,
            "runs": self.runs,
            "static_tuned_search": self.tuning.to_json() if self.tuning else None,
            "handoff_switch_parts": {p: parts_over_seeds(rows) for p, rows in self.runs.items()},
        }


def check_seeds(seeds: Sequence[int], train_seeds: Sequence[int]) -> None:
    if not seeds:
        raise ValueError("seeds: at least one reported seed is needed")
    if len(set(seeds)) != len(seeds):
        raise ValueError("seeds: each seed at most once")
    shared = sorted(set(seeds) & set(train_seeds))
    if shared:
        raise ValueError(f"train_seeds: {', '.join(map(str, shared))} also reported; training seeds stay apart")


def seed_study(
    scenario: Scenario,
    params: SynthParams,
    policies: Sequence[str],
    seeds: Sequence[int],
    train_seeds: Sequence[int] = (),
    *,
    tune_budget: int = 200,
    on_progress: Callable[[str], None] | None = None,
) -> SeedStudy:
    """Replay every policy on one synthetic trace per seed (module doc)."""
    check_seeds(seeds, train_seeds)
    names = policy_names(policies)
    tuning = tuned(
        scenario,
        names,
        lambda: [trace(scenario, params, s) for s in train_seeds],
        train_seeds,
        "train_seeds: static-tuned is tuned on training seeds; give at least one",
        tune_budget,
        on_progress,
    )
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    overran = dict.fromkeys(names, 0)
    for seed in seeds:
        records = trace(scenario, params, seed)
        for name in names:
            row, _ = replay_row(scenario, records, name, tuning, seed, {"seed": seed})
            overran[name] += int(row["saturated"])
            runs[name].append(row)
            if on_progress:
                on_progress(f"seed {seed} {name}: hand-off P95 {row['handoff_p95_seconds']:.2f} s")
    intervals = {n: {key: t_interval([r[key] for r in runs[n]]) for key, _, _ in METRICS} for n in names}
    return SeedStudy(names, list(seeds), list(train_seeds), params, intervals, overran, runs, tuning)


def policy_names(policies: Sequence[str]) -> list[str]:
    """The policies to replay, each once, in order; an unknown name is a ValueError naming the choices."""
    names = list(dict.fromkeys(policies))
    unknown = [n for n in names if n not in {str(p) for p in PolicyName}]
    if not names or unknown:
        raise ValueError(f"policies: unknown {', '.join(map(repr, unknown))}; choose of: {', '.join(PolicyName)}")
    return names


def tuned(
    scenario: Scenario,
    names: Sequence[str],
    training: Callable[[], list[list[TraceRecord]]],
    train: Sequence[int],
    missing: str,
    budget: int,
    on_progress: Callable[[str], None] | None,
) -> TuneResult | None:
    """`static-tuned`'s partition searched on the training traces (`training()`, numbered `train`) where it is
    among `names`; `missing` is the error where no training trace is given."""
    if PolicyName.STATIC_TUNED not in names:
        return None
    if not train:
        raise ValueError(missing)
    result = tune_static(scenario, training(), budget=budget, seed=min(train))
    if on_progress:
        on_progress(f"static-tuned: {result.replays} training replays over a space of {result.space_size}")
    return result


def replay_row(
    scenario: Scenario,
    records: Sequence[TraceRecord],
    name: str,
    tuning: TuneResult | None,
    seed: int,
    tag: dict[str, Any],
    options: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], SimResult]:
    """One policy's replay of one trace: its `METRICS`, `tag` (which trace), whether it saturated, and where
    its hand-offs' switch latency went; `static-tuned` runs the partition its search found, other policies
    their `options`."""
    if options is None:
        options = {"partition": tuning.partition} if name == PolicyName.STATIC_TUNED and tuning else {}
    result = simulate(scenario, records, create_policy(name, **options), seed=seed)
    summary = summarize(result)
    end = max((r.t for r in records), default=0.0)
    row: dict[str, Any] = {key: float(read(summary)) for key, _, read in METRICS}
    row.update(tag, saturated=saturated(result.duration_seconds, end))
    row.update(simulated_seconds=result.duration_seconds, trace_seconds=end)
    row["handoff_switch_parts"] = summary["handoff_switch_parts"]
    return row, result


def parts_over_seeds(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Where the hand-offs' switch latency went (`state.SWITCH_PARTS`), each part's seconds averaged over the
    seeds: `mean` over all hand-offs, `tail` over those at or above each seed's hand-off P95."""
    out: dict[str, dict[str, float]] = {}
    for which in ("mean", "tail"):
        out[which] = {
            part: round(float(np.mean([r["handoff_switch_parts"][which][part] for r in rows])), 6) if rows else 0.0
            for part in SWITCH_PARTS
        }
    return out


def trace(scenario: Scenario, params: SynthParams, seed: int) -> list[TraceRecord]:
    return synth_trace(scenario, params, np.random.default_rng(seed))


class Labelled(Protocol):
    def label(self, digits: int = 2) -> str: ...


class Tabled(Protocol):
    """What `table` reads of a study: a seed study, or a window study of a real trace (`windows.py`)."""

    @property
    def policies(self) -> list[str]: ...
    @property
    def seeds(self) -> list[int]: ...
    @property
    def intervals(self) -> Mapping[str, Mapping[str, Labelled]]: ...
    @property
    def saturated_runs(self) -> dict[str, int]: ...


def table(study: Tabled) -> tuple[list[str], list[list[str]]]:
    """Columns and rows: a policy per row, each metric's mean ± 95 % half width, and its saturated runs."""
    columns = ["policy", *(label for _, label, _ in METRICS), "saturated runs"]
    rows = [
        [
            name,
            *(study.intervals[name][key].label(3 if key == "degraded_share" else 2) for key, _, _ in METRICS),
            f"{study.saturated_runs[name]} / {len(study.seeds)}",
        ]
        for name in study.policies
    ]
    return columns, rows


def plot(study: SeedStudy, out_dir: Path) -> Path:
    """Hand-off P95 per policy, mean and 95 % interval over the seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    means = [study.intervals[p]["handoff_p95_seconds"].mean for p in study.policies]
    halves = [study.intervals[p]["handoff_p95_seconds"].half_width for p in study.policies]
    ax.bar(study.policies, means, yerr=[h if np.isfinite(h) else 0.0 for h in halves], capsize=4)
    ax.set_ylabel("hand-off switch P95 (s)")
    ax.set_title(f"{len(study.seeds)} seeds, 95 % t-intervals")
    ax.grid(True, axis="y", alpha=0.3)
    fig.autofmt_xdate(rotation=20)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "seeds.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_label(params: SynthParams) -> str:
    rate = f", hand-offs {params.handoff_rate:.0%}" if params.handoff_rate is not None else ""
    return f"{params.sessions} sessions, gap x{params.gap_scale:g}{rate}"


def load_plot(studies: Sequence[SeedStudy], out_dir: Path) -> Path:
    """Hand-off P95 per policy against the load levels (in the order run), a hollow marker where any of the
    level's runs of that policy is saturated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    x = np.arange(len(studies))
    for name in studies[0].policies:
        means = [s.intervals[name]["handoff_p95_seconds"].mean for s in studies]
        (line,) = ax.plot(x, means, label=name)
        for i, study in enumerate(studies):
            full = study.saturated_runs[name] == 0
            ax.plot(x[i], means[i], "o", color=line.get_color(), fillstyle="full" if full else "none")
    ax.set_xticks(x, [load_label(s.params) for s in studies], rotation=15)
    ax.set_ylabel("hand-off switch P95 (s)")
    ax.set_title("hollow: a run of that policy at that load saturated")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "load.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
