"""Memory is never ahead of the database: random sequences of events, replans, leases, renewals, reports,
heartbeats (some reconciling the placement) and ticks, with an exception injected at random points inside
the changes (a failed write, a record that cannot be written, a calibration, placement or reconcile step
that raises), and after every step the
service's views equal those of a service restored from its database alone."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from planner_service.domain.scenario import load_scenario
from planner_service.metrics import Metrics
from planner_service.service import calibration, confirmed, reconcile, records
from planner_service.service.engine import ClusterService
from planner_service.service.errors import ServiceError
from planner_service.service.inputs import (
    EngineInstanceIn,
    EngineInstanceStateIn,
    GpuTelemetryIn,
    HeartbeatIn,
    ReportIn,
    RequestEvent,
    SessionEndEvent,
    ToolCallStartEvent,
    TurnEndEvent,
)
from planner_service.service.store import Batch, SqliteStore
from planner_service.settings import Settings
from planner_service.wire.enums import EngineKind, EngineState

TINY = Path(__file__).parents[1] / "service" / "tiny_scenario.json"
MODELS = ["alpha", "beta"]
NODES = ["n1", "n2"]


class Injected(RuntimeError):
    """The fault this test injects."""


class Faults:
    """Raises `Injected` at a patched point with probability `rate` while armed."""

    def __init__(self, rng: np.random.Generator, rate: float) -> None:
        self.rng, self.rate, self.armed = rng, rate, False

    def maybe(self) -> None:
        if self.armed and self.rng.random() < self.rate:
            raise Injected("injected fault")

    def wrap(self, function: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.maybe()
            return function(*args, **kwargs)

        return wrapped


class FaultyStore(SqliteStore):
    faults: Faults | None = None

    def write(self, batch: Batch) -> None:
        if self.faults is not None and batch:
            self.faults.maybe()
        super().write(batch)


class Clock:
    t = 1_000.0

    def __call__(self) -> float:
        return self.t


def views(svc: ClusterService) -> dict[str, Any]:
    plan = None
    with contextlib.suppress(ServiceError):
        plan = svc.plan_view()
    return {
        "srv": svc.srv_view(),
        "sessions": svc.sessions_view(),
        "operations": svc.operations_view(),
        "done": svc.operations_view(state="done"),
        "failed": svc.operations_view(state="failed"),
        "plan": plan,
        "cluster": svc.cluster_view(),
        "status": svc.status(),
    }


def restored(path: Path, clock: Clock) -> dict[str, Any]:
    fresh = ClusterService(SqliteStore(path), Metrics(CollectorRegistry()), Settings(), clock=clock)
    fresh.start(lambda: load_scenario(TINY))
    try:
        return views(fresh)
    finally:
        fresh.close()


def step(svc: ClusterService, rng: np.random.Generator, clock: Clock, n: int) -> str:
    """One random action of a router, a node agent, an operator or the clock; returns its kind."""
    kind = rng.choice(["event", "event", "replan", "lease", "renew", "report", "report", "heartbeat", "tick"])
    session = f"s{rng.integers(4)}"
    if kind == "event":
        which = rng.choice(["request", "turn_end", "tool_call_start", "session_end"])
        event: Any
        if which == "request" or session not in {s["id"] for s in svc.sessions_view()}:
            model = str(rng.choice(MODELS))
            event = RequestEvent(id=f"e{n}", type="request", session=session, model=model, input_tokens=500)
        elif which == "turn_end":
            event = TurnEndEvent(id=f"e{n}", type="turn_end", session=session, output_tokens=100)
        elif which == "tool_call_start":
            event = ToolCallStartEvent(id=f"e{n}", type="tool_call_start", session=session)
        else:
            event = SessionEndEvent(id=f"e{n}", type="session_end", session=session)
        svc.apply_events([event])
    elif kind == "replan":
        svc.replan(force=bool(rng.integers(2)))
    elif kind == "lease":
        svc.lease(str(rng.choice(NODES)), int(rng.integers(1, 4)))
    elif kind == "renew":  # a lease still held, or one that ran out or was reported (refused)
        leases = [(o["node"], o["lease_id"]) for o in svc.operations_view(state=None) if o["lease_id"]]
        leases += [(o["node"], o["lease_id"]) for o in svc.operations_view(state="done")[-3:]]
        if leases:
            node, lease_id = leases[int(rng.integers(len(leases)))]
            svc.renew(node, lease_id, node_scope=node)
    elif kind == "report":
        leased = svc.operations_view(state="leased")
        if leased:
            op = leased[int(rng.integers(len(leased)))]
            done = rng.random() < 0.8
            seconds = float(op["bytes"]) / 5e9 if op["bytes"] else 0.1
            svc.report(
                op["id"],
                ReportIn(
                    lease_id=op["lease_id"],
                    status="done" if done else "failed",
                    measured_seconds=seconds,
                    measured_bytes=op["bytes"],
                    error=None if done else "engine refused",
                ),
            )
    elif kind == "heartbeat":  # now and then measuring an empty GPU, or its engine stopped (a reconcile)
        node = str(rng.choice(NODES))
        used = int(rng.choice([0, 12 << 30])) if rng.random() < 0.5 else None
        gpu = GpuTelemetryIn(id=f"{node}-g0", used_bytes=used, h2d_bytes_per_s=float(rng.uniform(1e10, 3e10)))
        instances = []
        if rng.random() < 0.3:
            model, gpus = str(rng.choice(MODELS)), [f"{node}-g0"]
            instance = EngineInstanceIn(
                id=EngineInstanceIn.instance_id(model, "bf16", gpus),
                node=node,
                kind=EngineKind.VLLM,
                model=model,
                precision="bf16",
                gpus=gpus,
                kv_pool_bytes_per_gpu=1 << 30,
            )
            state = EngineState.STOPPED if rng.random() < 0.5 else EngineState.RUNNING
            instances = [EngineInstanceStateIn(instance=instance, state=state)]
        svc.heartbeat(
            node,
            HeartbeatIn(gpus=[gpu], instances=instances, nvme_read_bytes_per_s=float(rng.uniform(3e9, 8e9))),
        )
    else:
        clock.t += float(rng.choice([1.0, 20.0, 120.0]))
        svc.tick()
    return str(kind)


@given(seed=st.integers(0, 2**32 - 1))
@settings(max_examples=6, deadline=None, derandomize=True)
def test_memory_equals_a_reload_of_the_database_after_every_step(seed: int, tmp_path_factory: Any) -> None:
    path = tmp_path_factory.mktemp("memory") / "m.db"
    rng = np.random.default_rng(seed)
    clock = Clock()
    faults = Faults(rng, rate=0.08)
    store = FaultyStore(path)
    store.faults = faults
    svc = ClusterService(store, Metrics(CollectorRegistry()), Settings(lease_seconds=60), clock=clock)
    svc.start(lambda: load_scenario(TINY))
    patches = pytest.MonkeyPatch()
    for owner, name in [
        (records.SessionState, "to_json"),
        (records.OpRecord, "to_json"),
        (calibration, "fold"),
        (confirmed, "apply_operation"),
        (reconcile, "shortfalls"),
    ]:
        patches.setattr(owner, name, faults.wrap(getattr(owner, name)))
    injected = 0
    try:
        for n in range(40):
            faults.armed = True
            kind = "?"
            try:
                kind = step(svc, rng, clock, n)
            except (Injected, ServiceError) as error:
                injected += isinstance(error, Injected) or "database write failed" in str(error)
            finally:
                faults.armed = False
            assert svc.broken is None, kind  # the database stayed readable: a reload always recovers
            assert views(svc) == restored(path, clock), kind
    finally:
        patches.undo()
        svc.close()
    assert injected > 0  # the walk did meet faults
