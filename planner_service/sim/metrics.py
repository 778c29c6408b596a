"""Per-policy metrics of a replay, as the `replay` JSON reports them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from planner_service.domain.scenario import CostConstants, Slo, SloClassConstants
from planner_service.sim.engine import SimRequest, SimResult
from planner_service.sim.state import SWITCH_PARTS

DEFAULT_TTFT_TARGETS = SloClassConstants(blocking=2.0, interactive=5.0, background=30.0)


def _quantiles(values: Sequence[float], keys: Sequence[str] = ("p50", "p95", "p99")) -> dict[str, float]:
    arr = np.asarray(values, dtype=float)
    out = {}
    for key in keys:
        out[key] = round(float(np.percentile(arr, float(key[1:]))), 6) if arr.size else 0.0
    return out


def latency_summary(values: Sequence[float]) -> dict[str, float]:
    """p50 / p95 / p99 / mean seconds (zeros for none)."""
    out = _quantiles(values)
    out["mean"] = round(float(np.mean(values)), 6) if len(values) else 0.0
    return out


def slo_violation_rates(requests: Sequence[SimRequest], targets: SloClassConstants) -> dict[str, float]:
    """Share of requests whose TTFT exceeds their class's target, per class and overall."""
    out: dict[str, float] = {}
    late_all = 0
    for slo in Slo:
        mine = [r for r in requests if r.slo is slo]
        late = sum(r.ttft_seconds > targets.of(slo) for r in mine)
        late_all += late
        out[slo.value] = round(late / len(mine), 6) if mine else 0.0
    out["all"] = round(late_all / len(requests), 6) if requests else 0.0
    return out


def completion_by_model(requests: Sequence[SimRequest]) -> dict[str, dict[str, float]]:
    """P50 / P95 seconds from each request's arrival until its last output token, per model."""
    by_model: dict[str, list[float]] = {}
    for r in requests:
        by_model.setdefault(r.model, []).append(r.done_at - r.admitted_at)
    return {model: _quantiles(seconds, ("p50", "p95")) for model, seconds in sorted(by_model.items())}


def switch_parts(requests: Sequence[SimRequest]) -> dict[str, Any]:
    """Where the requests' switch latency went (`SWITCH_PARTS`): each part's mean over all of them, and over
    the tail (those at or above the switch latency's P95), which is what sets the P95."""
    if not requests:
        return {"mean": dict.fromkeys(SWITCH_PARTS, 0.0), "tail": dict.fromkeys(SWITCH_PARTS, 0.0), "tail_count": 0}
    p95 = float(np.percentile([r.switch_seconds for r in requests], 95.0))
    tail = [r for r in requests if r.switch_seconds >= p95]

    def means(group: Sequence[SimRequest]) -> dict[str, float]:
        return {
            part: round(float(np.mean([(r.parts or {}).get(part, 0.0) for r in group])), 6) for part in SWITCH_PARTS
        }

    return {"mean": means(requests), "tail": means(tail), "tail_count": len(tail)}


def summarize(result: SimResult, targets: SloClassConstants = DEFAULT_TTFT_TARGETS) -> dict[str, Any]:
    """The replay's metrics; latencies are over the requests served (failed ones are counted apart)."""
    failed = [r for r in result.requests if r.state == "failed"]
    requests = [r for r in result.requests if r.state == "done"]
    switch = [r.switch_seconds for r in requests]
    handoffs = [r for r in requests if r.handoff]
    handoff = [r.switch_seconds for r in handoffs]
    duration = result.duration_seconds or 1.0
    return {
        "requests": len(result.requests),
        "handoffs": sum(r.handoff for r in result.requests),
        # requests the client gave up on before they started (`engine.REQUEST_TIMEOUT_SECONDS`), and those the
        # engine refused at once, longer than their model's maximum context (`too_long`, counted in `all` too)
        "failed_requests": {
            "all": len(failed),
            "handoff": sum(r.handoff for r in failed),
            "too_long": sum(r.too_long for r in failed),
        },
        # requests whose model refused the session's whole history: the agent compacted it and sent them again
        "compacted_requests": sum(r.compacted_tokens > 0 for r in result.requests),
        # `stay`: the requests that keep their session's model (a continuation turn)
        "switch_latency_seconds": {
            "all": latency_summary(switch),
            "handoff": latency_summary(handoff),
            "stay": latency_summary([r.switch_seconds for r in requests if not r.handoff]),
        },
        # history tokens prefilled again because no KV copy covered them (an engine's prefill cache lost)
        "reprefill_tokens": sum(r.reprefill_tokens for r in requests),
        # the hand-offs' switch latency split into its parts (`state.SWITCH_PARTS`)
        "handoff_switch_parts": switch_parts(handoffs),
        "ttft_seconds": _quantiles([r.ttft_seconds for r in requests]),
        # the part of the hand-offs' switch latency spent waiting for other prefills on their cards (the
        # compute models sharing a group contend for), and what the switch latency would be without it
        "handoff_prefill_wait_seconds": {
            "wait": latency_summary([r.prefill_queue_seconds for r in handoffs]),
            "switch_latency_without_wait": latency_summary(
                [r.switch_seconds - r.prefill_queue_seconds for r in handoffs]
            ),
        },
        # what the switch latency leaves out: decoding, where a MoE's experts off GPU slow every token
        "completion_seconds": _quantiles([r.done_at - r.admitted_at for r in requests]),
        "completion_seconds_by_model": completion_by_model(requests),
        "slo_violation_rate": slo_violation_rates(requests, targets),
        # what the latency and memory figures leave out: requests served below their model's preferred precision
        "degraded_precision_rate": round(sum(r.degraded for r in requests) / len(requests), 6) if requests else 0.0,
        "gpu_bytes": {"mean": int(result.gpu_byte_seconds / duration), "peak": int(result.peak_gpu_bytes)},
        "warm_idle_gpu_bytes": {"mean": int(result.warm_idle_byte_seconds / duration)},
        "bytes_moved": int(result.bytes_moved),
        "operations": int(result.operations),
        "planner_seconds": _quantiles(result.planner_seconds, ("p50", "p99")),
        "planner_calls": len(result.planner_seconds),
        "fallback_loads": int(result.fallback_loads),
        "deadlock_breaks": int(result.extra.get("deadlock_breaks", 0)),
        # cold starts, wakes by level, sleeps by level and stops of the simulated engines (sim/instances.py)
        "engine_transitions": dict(sorted(result.extra.get("engine_transitions", {}).items())),
        # the gateway's mode and its warm-ups: started, completed, used by a hand-off, cancelled (sim/gateway.py)
        "gateway": result.extra.get("gateway", {}),
        "capacity_or_bandwidth_violations": int(result.violations),
        "replay_wall_seconds": round(float(result.extra.get("wall_seconds", 0.0)), 3),
        "simulated_seconds": round(duration, 3),
    }


def ttft_targets(constants: CostConstants | None, overrides: Mapping[str, float] | None = None) -> SloClassConstants:
    """The TTFT targets: the defaults (2 / 5 / 30 s) with any per-class overrides."""
    data = DEFAULT_TTFT_TARGETS.model_dump()
    data.update(overrides or {})
    return SloClassConstants(**data)
