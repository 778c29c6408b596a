"""Policies on windows of a real trace: each metric with its 95 % bootstrap interval over sessions.

A real trace is replayed as it is, so there are no seeds to draw again: the trace is cut into
consecutive windows of `hours` (window k holds the sessions whose first request falls in
[k * hours, (k + 1) * hours), whole, their times moved so that the window starts at 0). A policy tuned
on traces (`static-tuned`'s partition search) is tuned on the training windows, which must not be
reported ones, and replayed unchanged on the reported windows.

Intervals. The request metrics (hand-off, switch, TTFT and completion P95, the degraded share and the
failed requests) are read from the requests of every reported window together, and their 95 % interval
is the percentile bootstrap over sessions (Efron and Tibshirani, An Introduction to the Bootstrap,
1993, ch. 13): `BOOTSTRAP_RESAMPLES` times, as many sessions as were replayed are drawn with
replacement and the metric is read from their requests; the interval runs from the 2.5th to the
97.5th percentile of those values. A session is resampled with all its turns, since a session's turns
are not independent of each other (its history sets their prefill). The cluster metrics (mean GPU GiB,
GiB moved, cold starts) belong to a whole replay, not to sessions: they are the mean over the reported
windows with its 95 % t-interval (`intervals.py`; none with a single window).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from planner_service.domain.scenario import Scenario
from planner_service.sim.engine import SimRequest
from planner_service.sim.intervals import Interval, t_interval
from planner_service.sim.policies.static_tuned import TuneResult
from planner_service.sim.seeds import METRICS, check_seeds, parts_over_seeds, policy_names, replay_row, tuned
from planner_service.sim.trace import TraceEnd, TraceRecord, TraceRequest

BOOTSTRAP_RESAMPLES = 1000
HOUR_SECONDS = 3600.0
# the request metrics, bootstrapped over sessions; the rest of METRICS are per replay
REQUEST_METRICS = (
    "handoff_p95_seconds",
    "switch_p95_seconds",
    "ttft_p95_seconds",
    "completion_p95_seconds",
    "degraded_share",
    "failed_requests",
)
INTERVAL_NOTE = (
    f"request metrics: 95 % percentile bootstrap over sessions ({BOOTSTRAP_RESAMPLES:,} resamples); "
    "GPU GiB, moved GiB, cold starts: mean over the reported windows with its 95 % Student t half width"
)


@dataclass(frozen=True)
class BootstrapInterval:
    """A statistic of the data as replayed with its 95 % percentile-bootstrap interval (not symmetric)."""

    mean: float  # the statistic itself (named as Interval's field, so that tables read either)
    low: float
    high: float
    n: int  # sessions resampled

    @property
    def half_width(self) -> float:
        return max(self.high - self.mean, self.mean - self.low)

    def to_json(self) -> dict[str, float | int | str | None]:
        return {
            "mean": self.mean,
            "low": self.low,
            "high": self.high,
            "half_width": None,
            "n": self.n,
            "method": "bootstrap",
        }

    def label(self, digits: int = 2) -> str:
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def windows(records: Sequence[TraceRecord], hours: float) -> list[list[TraceRecord]]:
    """The trace cut into windows of `hours` by each session's first record (module doc), each from t = 0."""
    if not hours > 0:
        raise ValueError("hours: a window must be longer than 0 h")
    length = hours * HOUR_SECONDS
    home: dict[str, int] = {}
    for r in records:
        if r.session not in home:
            parent = r.parent if isinstance(r, TraceRequest) else None
            home[r.session] = home[parent] if parent in home else int(r.t // length)
    count = max(home.values(), default=-1) + 1
    out: list[list[TraceRecord]] = [[] for _ in range(count)]
    for r in records:
        k = home[r.session]
        out[k].append(r.model_copy(update={"t": round(max(0.0, r.t - k * length), 3)}))
    for window in out:
        window.sort(key=lambda r: (r.t, isinstance(r, TraceEnd)))
    return out


class _Requests:
    """The replayed requests as arrays, grouped by session (a session's requests contiguous)."""

    def __init__(self, sessions: Sequence[Sequence[SimRequest]]) -> None:
        flat = [r for s in sessions for r in s]
        self.lengths = np.array([len(s) for s in sessions], dtype=np.int64)
        self.starts = np.concatenate(([0], np.cumsum(self.lengths)[:-1])).astype(np.int64)
        self.done = np.array([r.state == "done" for r in flat], dtype=bool)
        self.failed = np.array([r.state == "failed" for r in flat], dtype=bool)
        self.handoff = np.array([r.handoff for r in flat], dtype=bool)
        self.degraded = np.array([r.degraded for r in flat], dtype=bool)
        self.switch = np.array([r.switch_seconds for r in flat], dtype=float)
        self.ttft = np.array([r.ttft_seconds for r in flat], dtype=float)
        self.completion = np.array([r.done_at - r.admitted_at for r in flat], dtype=float)

    def pick(self, sessions: np.ndarray) -> np.ndarray:
        """The indices of the requests of these sessions (repeats kept)."""
        counts = self.lengths[sessions]
        total = int(counts.sum())
        offsets = np.repeat(self.starts[sessions] - (np.cumsum(counts) - counts), counts)
        return offsets + np.arange(total, dtype=np.int64)

    def metrics(self, index: np.ndarray) -> dict[str, float]:
        """The request metrics as `summarize` reads them (latencies over the requests served)."""
        done = index[self.done[index]]

        def p95(values: np.ndarray) -> float:
            return float(np.percentile(values, 95.0)) if values.size else 0.0

        return {
            "handoff_p95_seconds": p95(self.switch[done[self.handoff[done]]]),
            "switch_p95_seconds": p95(self.switch[done]),
            "ttft_p95_seconds": p95(self.ttft[done]),
            "completion_p95_seconds": p95(self.completion[done]),
            "degraded_share": float(self.degraded[done].mean()) if done.size else 0.0,
            "failed_requests": float(self.failed[index].sum()),
        }


def bootstrap(
    sessions: Sequence[Sequence[SimRequest]], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> dict[str, BootstrapInterval]:
    """Each request metric over every session's requests, with its 95 % percentile bootstrap over sessions."""
    if not sessions:
        raise ValueError("sessions: nothing replayed to resample")
    data = _Requests(sessions)
    point = data.metrics(np.arange(int(data.lengths.sum()), dtype=np.int64))
    rng = np.random.default_rng(seed)
    drawn: dict[str, list[float]] = {key: [] for key in REQUEST_METRICS}
    for _ in range(resamples):
        values = data.metrics(data.pick(rng.integers(len(sessions), size=len(sessions))))
        for key in REQUEST_METRICS:
            drawn[key].append(values[key])
    out = {}
    for key in REQUEST_METRICS:
        low, high = np.percentile(drawn[key], [2.5, 97.5])
        out[key] = BootstrapInterval(point[key], float(low), float(high), len(sessions))
    return out


def _root(session: str, parents: dict[str, str]) -> str:
    while session in parents:
        session = parents[session]
    return session


@dataclass
class WindowStudy:
    source: str
    hours: float
    policies: list[str]
    windows: list[int]
    train_windows: list[int]
    intervals: dict[str, dict[str, Interval | BootstrapInterval]]
    saturated_runs: dict[str, int]
    runs: dict[str, list[dict[str, Any]]]  # policy -> per-window metrics
    sessions: int  # sessions (with their sub-agents) replayed over the reported windows
    tuning: TuneResult | None = None

    @property
    def seeds(self) -> list[int]:  # what `seeds.table` reads
        return self.windows

    def to_json(self) -> dict[str, Any]:
        return {
            "policies": self.policies,
            "seeds": self.windows,
            "train_seeds": self.train_windows,
            "trace": {"source": self.source, "hours": self.hours, "sessions": self.sessions},
            "interval": INTERVAL_NOTE,
            "metrics": {p: {k: v.to_json() for k, v in m.items()} for p, m in self.intervals.items()},
            "saturated_runs": self.saturated_runs,
            "runs": self.runs,
            "static_tuned_search": self.tuning.to_json() if self.tuning else None,
            "handoff_switch_parts": {p: parts_over_seeds(rows) for p, rows in self.runs.items()},
        }


def window_study(
    scenario: Scenario,
    records: Sequence[TraceRecord],
    source: str,
    hours: float,
    policies: Sequence[str],
    reported: Sequence[int],
    train: Sequence[int] = (),
    *,
    tune_budget: int = 200,
    resamples: int = BOOTSTRAP_RESAMPLES,
    on_progress: Callable[[str], None] | None = None,
) -> WindowStudy:
    """Replay every policy on each reported window of a real trace (module doc)."""
    try:
        check_seeds(reported, train)
    except ValueError as error:
        raise ValueError(str(error).replace("train_seeds", "train windows").replace("seeds", "windows")) from None
    parts = windows(records, hours)
    missing = sorted(k for k in [*reported, *train] if not 0 <= k < len(parts) or not parts[k])
    if missing:
        raise ValueError(
            f"windows: {', '.join(map(str, missing))} hold no session; the trace has windows 0 to "
            f"{len(parts) - 1} of {hours:g} h"
        )
    names = policy_names(policies)
    tuning = tuned(
        scenario,
        names,
        lambda: [parts[k] for k in train],
        train,
        "train windows: static-tuned is tuned on training windows; give at least one",
        tune_budget,
        on_progress,
    )
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    by_session: dict[str, list[list[SimRequest]]] = {n: [] for n in names}
    overran = dict.fromkeys(names, 0)
    sessions = 0
    for k in reported:
        window = parts[k]
        parents = {r.session: r.parent for r in window if isinstance(r, TraceRequest) and r.parent}
        sessions += len({_root(r.session, parents) for r in window})
        for name in names:
            row, result = replay_row(scenario, window, name, tuning, k, {"window": k})
            overran[name] += int(row["saturated"])
            runs[name].append(row)
            grouped: dict[str, list[SimRequest]] = {}
            for req in result.requests:
                grouped.setdefault(_root(req.session, parents), []).append(req)
            by_session[name].extend(grouped.values())
            if on_progress:
                on_progress(f"window {k} {name}: hand-off P95 {row['handoff_p95_seconds']:.2f} s")
    intervals: dict[str, dict[str, Interval | BootstrapInterval]] = {}
    for name in names:
        boot = bootstrap(by_session[name], resamples)
        intervals[name] = {
            key: boot[key] if key in boot else t_interval([r[key] for r in runs[name]]) for key, _, _ in METRICS
        }
    return WindowStudy(source, hours, names, list(reported), list(train), intervals, overran, runs, sessions, tuning)


# the public traces by name: their folders under ../shared/traces (never copied into the repository)
SOURCES = {"azure": "azure_llm_2023", "mooncake": "mooncake_fast25", "alibaba": "alibaba_genai_2026"}


def load_trace(source: str, scenario: Scenario, traces_dir: Path) -> list[TraceRecord]:
    """A public trace by name, imported from its folder under `traces_dir` (Azure and Mooncake with hand-offs
    along the scenario's chain, since their sessions never change model; Alibaba's change model on their
    own), or a StateBudget trace file."""
    from planner_service.sim.importers import ImportOptions, default_registry
    from planner_service.sim.trace import read_trace

    if source in SOURCES:
        folder = traces_dir / SOURCES[source]
        if not folder.exists():
            raise ValueError(f"--trace {source}: {folder} is absent (--traces-dir names the public traces' folder)")
        options = ImportOptions(handoffs=source != "alibaba")
        return list(default_registry().get(source).records(folder, scenario, options))
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"--trace: {source} is neither a trace file nor one of: {', '.join(SOURCES)}")
    return read_trace(path)
