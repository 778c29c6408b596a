"""The gateway measured: the same policy with and without its affinity or its warm-ups, over seeds (`gateway.py`).

Each workload gives one trace per seed: a synthetic trace (`synth.py`) at a load level, or a window of a
public trace imported once (Azure LLM 2023, Alibaba GenAI 2026): seed s starts the window at the arrival
of a request drawn by `default_rng(s)` (so busy hours are drawn as often as they hold requests) and keeps
the records inside it, times counted from its start. Every policy replays every trace under every arm:

* `none`: the gateway routes only: to a model's one instance, or where a model has several (`replicas`,
  `replicas.py`) to the least loaded, as a load balancer without session state does;
* `affinity`: where a model has several instances, to the one holding the session's KV (with one instance
  per model it replays exactly as `none`: `gateway.py`);
* `warmups`: warm-ups by the rule the planner publishes, with the service's defaults (the `priced` target:
  those the objective values above the HBM price of their KV, best first, 2 per instance);
* `warmups-top`: the service's former rule, the session's most likely next model at least 0.5 likely
  (`DirectiveLimits.target = "top"`);
* `warmups-handoff`: the most likely model that holds none of the session's KV, at least 0.2 likely
  (`DirectiveLimits.target = "handoff"`);
* `eager-handoff`: an ablation, the `warmups-handoff` directives carried out without waiting for idle cards
  and without giving way: each warm-up takes its cards as a real prefill does (`GatewayMode.EAGER`).

The warm-up arms route as `affinity` does. Per policy and arm: the P95 of the hand-offs' and of the other
requests' (`stay`) switch latency, TTFT and completion P95, the history tokens prefilled again, GPU
memory-time, the warm-ups' counts and the routing's, each a mean with its 95 % Student t interval over the
seeds; and against the first arm on the same trace, paired per seed: the P95s' differences and the GPU
memory-time ratio, each with its interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from planner_service.domain.scenario import Scenario
from planner_service.domain.units import GIB
from planner_service.planner.gateway_directives import DirectiveLimits
from planner_service.sim.engine import simulate
from planner_service.sim.gateway import DEFAULT_LIMITS, GatewayMode
from planner_service.sim.intervals import t_interval
from planner_service.sim.metrics import summarize
from planner_service.sim.policies import create_policy
from planner_service.sim.slots import saturated
from planner_service.sim.synth import SynthParams, synth_trace
from planner_service.sim.trace import TraceRecord

TOP_TARGET = DirectiveLimits(max_warmups_per_instance=2, min_probability=0.5, target="top")
HANDOFF_TARGET = DirectiveLimits(max_warmups_per_instance=2, min_probability=0.2, target="handoff")
ARMS: dict[str, tuple[GatewayMode, DirectiveLimits]] = {
    "none": (GatewayMode.NONE, DEFAULT_LIMITS),
    "affinity": (GatewayMode.AFFINITY, DEFAULT_LIMITS),
    "warmups": (GatewayMode.WARMUPS, DEFAULT_LIMITS),
    "warmups-top": (GatewayMode.WARMUPS, TOP_TARGET),
    "warmups-handoff": (GatewayMode.WARMUPS, HANDOFF_TARGET),
    "eager-handoff": (GatewayMode.EAGER, HANDOFF_TARGET),
}
# (key, label): what each run reports, read by `_row`
METRICS = (
    ("handoff_p95_seconds", "hand-off P95 s"),
    ("completion_p95_seconds", "done P95 s"),
    ("gpu_gib_hours", "GPU GiB·h"),
    ("warmups_started", "warm-ups started"),
    ("warmups_used", "used"),
    ("warmups_cancelled", "cancelled"),
)
COUNTS = ("warmups_started", "warmups_completed", "warmups_used", "warmups_cancelled", "warmups_unused")
# what the routing among several instances of a model did (`replicas.py`)
ROUTING = ("routed", "routed_with_kv_holder", "routed_to_kv_holder")
# each a mean with its interval over the seeds, and (latencies) a difference paired against the first arm
MEANS = (
    "handoff_p95_seconds",
    "stay_p95_seconds",
    "ttft_p95_seconds",
    "completion_p95_seconds",
    "gpu_gib_hours",
    "reprefill_tokens",
    *COUNTS,
    *ROUTING,
)
PAIRED = ("handoff_p95", "stay_p95", "ttft_p95", "completion_p95")


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    trace: Callable[[int], list[TraceRecord]]  # seed -> records


def synthetic(scenario: Scenario, params: SynthParams, name: str) -> Workload:
    description = (
        f"synthetic, {params.sessions} sessions × {params.hours:g} h, every gap between turns × {params.gap_scale:g}"
    )
    return Workload(name, description, lambda seed: synth_trace(scenario, params, np.random.default_rng(seed)))


def window(records: Sequence[TraceRecord], seconds: float, name: str, source: str) -> Workload:
    """Seed s: the records in [t, t + seconds) for t the arrival of a request `default_rng(s)` draws among
    those at least `seconds` before the trace's end (any request where the trace is shorter)."""
    times = np.array([r.t for r in records], dtype=float)
    if not times.size:
        raise ValueError(f"{name}: the trace is empty")
    last = times[-1]

    def trace(seed: int) -> list[TraceRecord]:
        candidates = np.flatnonzero(times <= last - seconds)
        pool = candidates if candidates.size else np.arange(times.size)
        start = float(times[int(np.random.default_rng(seed).choice(pool))])
        lo, hi = int(np.searchsorted(times, start, "left")), int(np.searchsorted(times, start + seconds, "left"))
        return [r.model_copy(update={"t": r.t - start}) for r in records[lo:hi]]

    length = f"{seconds / 3600:g} h" if seconds >= 3600 else f"{seconds:g} s"
    return Workload(name, f"{source}, windows of {length}", trace)


def _row(summary: dict[str, Any], result_seconds: float, trace_seconds: float, gpu_byte_seconds: float) -> dict:
    gateway = summary["gateway"]
    parts = summary["handoff_switch_parts"]
    return {
        "handoff_p95_seconds": summary["switch_latency_seconds"]["handoff"]["p95"],
        "stay_p95_seconds": summary["switch_latency_seconds"]["stay"]["p95"],
        "ttft_p95_seconds": summary["ttft_seconds"]["p95"],
        "completion_p95_seconds": summary["completion_seconds"]["p95"],
        "reprefill_tokens": summary["reprefill_tokens"],
        "gpu_gib_hours": gpu_byte_seconds / GIB / 3600.0,
        "handoffs": summary["handoffs"],
        "failed_requests": summary["failed_requests"]["all"],
        "saturated": saturated(result_seconds, trace_seconds),
        **{key: gateway[key] for key in COUNTS},
        **{key: gateway.get(key, 0) for key in ROUTING},
        "warmup_prefill_seconds": gateway["warmup_prefill_seconds"],
        "cancelled_prefill_seconds": gateway["cancelled_prefill_seconds"],
        "cancelled_by": gateway["cancelled_by"],
        "handoff_parts_tail": parts["tail"],
        "handoff_parts_mean": parts["mean"],
    }


def _interval(values: Sequence[float]) -> dict[str, Any]:
    finite = [v for v in values if math.isfinite(v)]
    return t_interval(finite).to_json() if finite else {"mean": None, "half_width": None, "n": 0}


def run_workload(
    scenario: Scenario,
    workload: Workload,
    policies: Sequence[str],
    seeds: Sequence[int],
    arms: Sequence[str] = tuple(ARMS),
    on_progress: Callable[[str], None] | None = None,
    replicas: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {p: {a: [] for a in arms} for p in policies}
    for seed in seeds:
        records = workload.trace(seed)
        end = max((r.t for r in records), default=0.0)
        for policy in policies:
            for arm in arms:
                mode, limits = ARMS[arm]
                result = simulate(
                    scenario,
                    records,
                    create_policy(policy),
                    seed=seed,
                    gateway=mode,
                    gateway_limits=limits,
                    replicas=replicas,
                )
                row = _row(summarize(result), result.duration_seconds, end, result.gpu_byte_seconds)
                row["seed"] = seed
                runs[policy][arm].append(row)
                if on_progress:
                    on_progress(
                        f"{workload.name} seed {seed} {policy} {arm}: hand-off P95 {row['handoff_p95_seconds']:.2f} s, "
                        f"warm-ups {row['warmups_started']} started / {row['warmups_used']} used"
                    )
    metrics: dict[str, dict[str, dict[str, Any]]] = {}
    paired: dict[str, dict[str, dict[str, Any]]] = {}
    parts: dict[str, dict[str, dict[str, float]]] = {}
    for policy in policies:
        metrics[policy], paired[policy], parts[policy] = {}, {}, {}
        base = runs[policy][arms[0]]
        for arm in arms:
            rows = runs[policy][arm]
            metrics[policy][arm] = {key: _interval([float(r[key]) for r in rows]) for key in MEANS}
            metrics[policy][arm]["saturated_runs"] = sum(r["saturated"] for r in rows)
            metrics[policy][arm]["failed_requests"] = sum(r["failed_requests"] for r in rows)
            parts[policy][arm] = {
                f"{which}_{part}": round(float(np.mean([r[f"handoff_parts_{which}"][part] for r in rows])), 4)
                for which in ("tail", "mean")
                for part in rows[0][f"handoff_parts_{which}"]
            }
            if arm == arms[0]:
                continue
            paired[policy][arm] = {
                **{
                    f"{key}_diff_seconds": _interval(
                        [r[f"{key}_seconds"] - b[f"{key}_seconds"] for r, b in zip(rows, base, strict=True)]
                    )
                    for key in PAIRED
                },
                "gpu_memory_time_ratio": _interval(
                    [
                        r["gpu_gib_hours"] / b["gpu_gib_hours"]
                        for r, b in zip(rows, base, strict=True)
                        if b["gpu_gib_hours"]
                    ]
                ),
            }
    return {
        "name": workload.name,
        "description": workload.description,
        "seeds": list(seeds),
        "metrics": metrics,
        "paired": paired,
        "handoff_parts": parts,
        "runs": runs,
    }


def gateway_study(
    scenario: Scenario,
    workloads: Sequence[Workload],
    policies: Sequence[str],
    seeds: Sequence[int],
    on_progress: Callable[[str], None] | None = None,
    arms: Sequence[str] = tuple(ARMS),
    replicas: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """Every workload (module doc) under `arms`, the first the one the others are paired against, with
    `replicas` instances of the models it names (`replicas.py`); the JSON `make evidence` renders as a section."""
    if len(seeds) < 2 or len(set(seeds)) != len(seeds):
        raise ValueError("seeds: at least two distinct seeds (an interval needs two runs)")
    unknown = [a for a in arms if a not in ARMS]
    if unknown or len(arms) < 2 or len(set(arms)) != len(arms):
        raise ValueError(f"arms: at least two distinct of {', '.join(ARMS)}, got {', '.join(arms) or 'none'}")
    return {
        "kind": "gateway",
        "policies": list(policies),
        "arms": {
            name: {
                "gateway": str(mode),
                "target": limits.target,
                "min_probability": limits.min_probability,
                "max_warmups_per_instance": limits.max_warmups_per_instance,
            }
            for name, (mode, limits) in ARMS.items()
            if name in arms
        },
        "replicas": dict(sorted((replicas or {}).items())),
        "interval": "95 % Student t over seeds",
        "workloads": [
            run_workload(scenario, w, policies, seeds, arms, on_progress=on_progress, replicas=replicas)
            for w in workloads
        ],
    }
