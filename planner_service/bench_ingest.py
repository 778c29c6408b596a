"""The in-process ingest benchmark behind `statebudget bench ingest` (figures, not a test).

It seeds a service on the demo scenario with a fresh SQLite database and a manual clock, then times the
service's own methods, with no HTTP in between:

- `batches` event batches of `batch` events over `sessions` sessions per round: each session's first request
  creates it, and each round's requests go to two of the catalog's models (the next two each round: sessions
  hand off), each followed by its turn end;
- after every `batches` batches (a round), a forced replan, then every operation of the plan leased by its
  node and reported done with its bytes, one report at a time, until no node has work. The reports carry no
  measured duration, so they feed no calibration sample: what is timed is the live state's own work.

It prints p50/p95/mean milliseconds (wall clock, and the mean CPU time) per event batch, per forced replan and
per report, how often the live problem was compiled (`Live.compile`), a digest of the confirmed placement the
rounds leave (equal digests: the same plans were made and carried out) and the load average, so that a change
of the live state can be measured before and after on the same machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from planner_service.domain.demo import demo_scenario
from planner_service.metrics import Metrics
from planner_service.service.engine import ClusterService
from planner_service.service.inputs import Event, ReportIn, RequestEvent, TurnEndEvent
from planner_service.service.store import SqliteStore
from planner_service.settings import Settings

SECONDS_PER_CALL = 0.05  # the manual clock's step between calls: the windows stay open, no lease expires


class ManualClock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def run(rounds: int = 10, batches: int = 20, batch: int = 20, sessions: int = 200) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        clock = ManualClock()
        service = ClusterService(
            SqliteStore(Path(tmp) / "bench.db"), Metrics(CollectorRegistry()), Settings(), clock=clock
        )
        service.start(demo_scenario)
        compiles = _count_compiles(service)
        models = sorted(m["id"] for m in service.models_view())
        events = _events(rounds, batches * batch, sessions, models)
        batch_ms: list[float] = []
        batch_cpu_ms: list[float] = []
        report_ms: list[float] = []
        report_cpu_ms: list[float] = []
        replan_ms: list[float] = []
        replan_cpu_ms: list[float] = []
        by_events = 0
        for r in range(rounds):
            for i in range(r * batches, (r + 1) * batches):
                clock.t += SECONDS_PER_CALL
                before = compiles[0]
                started, cpu = time.perf_counter(), time.process_time()
                service.apply_events(events[i * batch : (i + 1) * batch])
                batch_ms.append((time.perf_counter() - started) * 1000)
                batch_cpu_ms.append((time.process_time() - cpu) * 1000)
                by_events += compiles[0] - before
            started, cpu = time.perf_counter(), time.process_time()
            service.replan(force=True)
            replan_ms.append((time.perf_counter() - started) * 1000)
            replan_cpu_ms.append((time.process_time() - cpu) * 1000)
            wall, cpu_ms = _drain(service, clock)
            report_ms += wall
            report_cpu_ms += cpu_ms
        srv = service.srv_view()
        service.close()
    return {
        "sessions": sessions,
        "events_per_batch": batch,
        "event_batches": _summary(batch_ms, batch_cpu_ms),
        "reports": _summary(report_ms, report_cpu_ms),
        "replans": _summary(replan_ms, replan_cpu_ms),
        "compiles_during_event_batches": by_events,
        "compiles_in_all": compiles[0],
        # what the rounds left confirmed: equal digests, equal results (timings aside)
        "srv_version": srv["version"],
        "srv_digest": hashlib.sha256(json.dumps(srv["placement"], sort_keys=True).encode()).hexdigest()[:16],
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def _count_compiles(service: ClusterService) -> list[int]:
    """Counts `Live.compile` calls (a one-element list, updated in place)."""
    count = [0]
    original: Callable[..., Any] = service.live.compile

    def counted(*args: Any) -> Any:
        count[0] += 1
        return original(*args)

    service.live.compile = counted  # type: ignore[method-assign,assignment]  # a benchmark's probe on the instance
    return count


def _events(rounds: int, per_round: int, sessions: int, models: list[str]) -> list[Event]:
    """Each round's requests go to two of the catalog's models (the next two each round), so that every round's
    plan moves state; each request is followed by its turn end."""
    out: list[Event] = []
    k = 0
    for r in range(rounds):
        hot = (models[r % len(models)], models[(r + 1) % len(models)])
        for _ in range(per_round // 2):
            s = k % sessions
            out.append(RequestEvent(id=f"r{k}", type="request", session=f"s{s}", model=hot[s % 2], input_tokens=500))
            out.append(TurnEndEvent(id=f"t{k}", type="turn_end", session=f"s{s}", output_tokens=100))
            k += 1
    return out


def _drain(service: ClusterService, clock: ManualClock) -> tuple[list[float], list[float]]:
    """Lease and report done every operation, node by node, until no node has any; wall and CPU ms per report."""
    nodes = [n["id"] for n in service.cluster_view()["nodes"]]
    times: list[float] = []
    cpu_times: list[float] = []
    while True:
        leased = 0
        for node in nodes:
            lease = service.lease(node, 8)
            for op in lease["operations"]:
                leased += 1
                clock.t += SECONDS_PER_CALL
                body = ReportIn(lease_id=lease["lease_id"], status="done", measured_bytes=op["bytes"])
                started, cpu = time.perf_counter(), time.process_time()
                service.report(op["id"], body)
                times.append((time.perf_counter() - started) * 1000)
                cpu_times.append((time.process_time() - cpu) * 1000)
        if not leased:
            return times, cpu_times


def _summary(ms: list[float], cpu_ms: list[float]) -> dict[str, float]:
    """Wall-clock p50/p95/mean and the mean CPU time of the calls (the machine's other work inflates the wall
    clock; the CPU time is what the call itself used)."""
    if not ms:
        return {"count": 0}
    ordered = sorted(ms)
    return {
        "count": len(ms),
        "p50_ms": round(statistics.median(ordered), 3),
        "p95_ms": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 3),
        "mean_ms": round(statistics.fmean(ordered), 3),
        "cpu_mean_ms": round(statistics.fmean(cpu_ms), 3),
    }
