"""Replans solved in a worker process plan exactly what the service plans in its own thread."""

from __future__ import annotations

import ast
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from planner_service.domain.demo import demo_scenario
from planner_service.metrics import Metrics
from planner_service.service.engine import ClusterService
from planner_service.service.inputs import RequestEvent
from planner_service.service.solving import (
    COMPILED_MODULES,
    PlanRequest,
    PlanWorker,
    frozen_dataclasses,
    plan_from,
)
from planner_service.service.store import SqliteStore
from planner_service.settings import Settings


class Clock:
    t = 1_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def worker() -> Iterator[PlanWorker]:
    worker = PlanWorker()
    worker.start()
    yield worker
    worker.close()


def busy_demo(db: Path) -> ClusterService:
    """The demo after its first plan and requests of 40 sessions spread over every model."""
    service = ClusterService(SqliteStore(db), Metrics(CollectorRegistry()), Settings(), clock=Clock())
    service.start(demo_scenario)
    service.replan()
    models = service.live.model_ids()
    events = [
        RequestEvent(
            id=f"e{i}", type="request", session=f"s{i}", model=models[i % len(models)], input_tokens=500 + 37 * i
        )
        for i in range(40)
    ]
    service.apply_events(events)
    return service


def untimed(plan: dict[str, Any]) -> dict[str, Any]:
    """A plan's document without how long its solve took (the one field two runs of a solve may differ in)."""
    return {k: v for k, v in plan.items() if k != "solve_seconds"}


def request_of(service: ClusterService) -> PlanRequest:
    """What the service's next replan plans from, taken as it takes it."""
    with service.live.change():
        state, next_model, _ = service.planning.planning_snapshot(stand_ins=True)
        usage = service.planning._usage()
    return PlanRequest(state, next_model, usage, service.live.settings.solver, force=True)


def test_the_worker_plans_the_snapshot_as_the_service_does(tmp_path: Path, worker: PlanWorker) -> None:
    service = busy_demo(tmp_path / "a.db")
    request = request_of(service)
    here, there = plan_from(request), worker(request)
    assert here.plan is not None and there.plan is not None
    assert len(here.plan.operations) > 0
    assert untimed(there.plan.to_json()) == untimed(here.plan.to_json())
    assert (there.adopt, there.unplannable, there.warning) == (here.adopt, here.unplannable, here.warning)
    assert [solver for solver, _ in there.solves] == [solver for solver, _ in here.solves] == ["greedy"]
    service.close()


def test_a_service_planning_in_the_worker_installs_the_same_epoch(tmp_path: Path, worker: PlanWorker) -> None:
    in_thread, in_worker = busy_demo(tmp_path / "t.db"), busy_demo(tmp_path / "w.db")
    in_worker.planning.runner = worker
    assert in_thread.replan(force=True) == in_worker.replan(force=True) == {"epoch": 2, "changed": True}
    assert untimed(in_worker.plan_view()) == untimed(in_thread.plan_view())
    assert in_worker.operations_view() == in_thread.operations_view()
    in_thread.close()
    in_worker.close()


def test_a_worker_that_died_costs_one_replan_planned_here(tmp_path: Path) -> None:
    service = busy_demo(tmp_path / "k.db")
    request = request_of(service)
    expected = plan_from(request).plan
    assert expected is not None
    worker = PlanWorker()
    try:
        first = worker.start()
        os.kill(first, signal.SIGKILL)
        answered = worker(request)  # the pool finds its process gone: this one is planned here
        assert answered.plan is not None and untimed(answered.plan.to_json()) == untimed(expected.to_json())
        second = worker.start()  # and the next one has a new worker
        assert second != first
        again = worker(request)
        assert again.plan is not None and untimed(again.plan.to_json()) == untimed(expected.to_json())
    finally:
        worker.close()
    service.close()


def test_an_unplannable_snapshot_says_why_instead_of_raising(tmp_path: Path, worker: PlanWorker) -> None:
    service = busy_demo(tmp_path / "u.db")
    request = request_of(service)
    (obj, loc), nbytes = next(iter(request.state.residency.items()))
    overfull = {**request.state.residency, (obj, loc): nbytes * 10**6}
    bad = PlanRequest(
        type(request.state)(request.state.catalog, request.state.scenario, request.state.sessions, overfull),
        request.next_model,
        request.usage,
        request.solver,
        force=True,
    )
    result = worker(bad)
    assert result.plan is None and result.unplannable is not None and obj.model in result.unplannable
    service.close()


def test_the_worker_exits_when_the_service_is_killed() -> None:
    """A SIGKILLed service cannot close its worker: the worker notices and exits instead of waiting forever."""
    script = "from planner_service.service.solving import PlanWorker; import time; print(PlanWorker().start(), flush=True); time.sleep(600)"
    service = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert service.stdout is not None
        pid = int(service.stdout.readline())
        service.kill()
        service.wait()
        deadline = time.monotonic() + 30
        while alive(pid):
            assert time.monotonic() < deadline, f"the worker {pid} outlived the service"
            time.sleep(0.1)
    finally:
        if service.poll() is None:
            service.kill()
            service.wait()


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie left for init to reap does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_snapshot_the_worker_cannot_take_is_planned_here_from_then_on(tmp_path: Path) -> None:
    class Local(dict[str, Any]):  # next-model predictions in a class pickle cannot name
        pass

    service = busy_demo(tmp_path / "p.db")
    request = request_of(service)
    unsendable = PlanRequest(request.state, Local(request.next_model), request.usage, request.solver, force=True)
    expected = plan_from(request).plan
    assert expected is not None
    worker = PlanWorker()
    try:
        worker.start()
        answered = worker(unsendable)
        assert answered.plan is not None and untimed(answered.plan.to_json()) == untimed(expected.to_json())
        assert worker._executor() is None  # closed: the replans after it plan in the service
        again = worker(request)
        assert again.plan is not None and untimed(again.plan.to_json()) == untimed(expected.to_json())
    finally:
        worker.close()
    service.close()


def _refuse_to_load() -> None:
    raise dataclasses.FrozenInstanceError("cannot assign to field 'id'")


class FrozenOnLoad(dict[str, Any]):
    """Pickles, but refuses to load, as a compiled frozen dataclass that no reducer in `solving.py` covers would."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _refuse_to_load, ()


def test_a_build_whose_snapshot_does_not_load_plans_here_without_killing_a_worker(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    service = busy_demo(tmp_path / "p.db")
    request = request_of(service)
    frozen = PlanRequest(request.state, FrozenOnLoad(request.next_model), request.usage, request.solver, force=True)
    expected = plan_from(request).plan
    assert expected is not None
    worker = PlanWorker()
    try:
        worker.start()
        answered = worker(frozen)
        assert answered.plan is not None and untimed(answered.plan.to_json()) == untimed(expected.to_json())
        assert worker._executor() is None  # closed: the replans after it plan in the service
    finally:
        worker.close()
    assert "does not pickle in this build" in caplog.text and "died" not in caplog.text
    service.close()


def test_the_compiled_modules_frozen_dataclasses_cross_by_their_constructor(tmp_path: Path) -> None:
    """The deployed build compiles setup.py's COMPILED modules with mypyc, whose frozen dataclasses refuse the
    attribute writes pickle restores an object with: each crosses by its constructor instead, in every build
    (tests/deploy/test_compiled_build.py sends the compiled ones across)."""
    setup = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    (compiled,) = [
        ast.literal_eval(node.value)
        for node in ast.parse(setup).body
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["COMPILED"]
    ]
    assert [m.__name__ for m in COMPILED_MODULES] == [p[:-3].replace("/", ".") for p in compiled]
    classes = frozen_dataclasses()
    assert len(classes) >= 10
    assert all(cls in ForkingPickler._extra_reducers for cls in classes)  # type: ignore[attr-defined]
    request = request_of(busy_demo(tmp_path / "p.db"))
    assert ForkingPickler.loads(ForkingPickler.dumps(request)) == request
