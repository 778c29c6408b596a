"""Which long-polls a queue change wakes: a report, an expiry or an install names the nodes whose queues it
changed, and a lease looks only at its own node's operations."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from support import TINY_SCENARIO as TINY
from support import FakeClock

from planner_service.domain.scenario import load_scenario
from planner_service.domain.state import Location, StateObject
from planner_service.metrics import Metrics
from planner_service.planner.operations import Action, Operation
from planner_service.service.calibration import Estimate, Link
from planner_service.service.engine import ClusterService
from planner_service.service.inputs import ReportIn, RequestEvent
from planner_service.service.records import OpenOps, OpRecord
from planner_service.service.store import SqliteStore
from planner_service.settings import Settings

LEASE_SECONDS = 10.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_000.0)


@pytest.fixture
def woken(tmp_path: Path, clock: FakeClock):
    """The service and every notification's nodes, in order (None: every node)."""
    svc = ClusterService(
        SqliteStore(tmp_path / "w.db"), Metrics(CollectorRegistry()), Settings(lease_seconds=LEASE_SECONDS), clock=clock
    )
    svc.start(lambda: load_scenario(TINY))
    seen: list[frozenset[str] | None] = []
    svc.add_listener(seen.append)
    yield svc, seen
    svc.close()


def test_an_install_wakes_the_nodes_it_queued_work_for_and_a_report_its_own_node(woken, clock):
    svc, seen = woken
    svc.apply_events(
        [RequestEvent(id="e1", type="request", session="s1", model="beta", slo="blocking", input_tokens=1000)]
    )
    svc.replan()
    queued = {o["node"] for o in svc.operations_view(state="queued")}
    assert queued and seen == [frozenset(queued)]
    lease = svc.lease("n1", 10)
    assert len(seen) == 1  # a lease takes work away: no other long-poll can find more
    op = lease["operations"][0]["id"]
    svc.report(op, ReportIn(lease_id=lease["lease_id"], status="done", measured_seconds=1.0))
    assert seen[-1] == frozenset({"n1"})


def test_an_expiry_wakes_only_the_node_whose_lease_ran_out(woken, clock):
    svc, seen = woken
    svc.apply_events(
        [RequestEvent(id="e1", type="request", session="s1", model="beta", slo="blocking", input_tokens=1000)]
    )
    svc.replan()
    svc.lease("n1", 10)
    seen.clear()
    clock.t += LEASE_SECONDS / 2
    svc.tick()
    assert seen == []  # before the deadline nothing expired, and nothing was scanned for it
    clock.t += LEASE_SECONDS
    svc.tick()
    assert seen == [frozenset({"n1"})]
    assert {o["node"] for o in svc.operations_view(state="queued")} >= {"n1"}


def op(op_id: str, node: str) -> OpRecord:
    move = Operation(
        op_id, Action.DROP, StateObject.weights("m", "bf16"), Location.host(node), None, bytes=1, keep_source=False
    )
    move.node = node
    return OpRecord(move, epoch=1, seq=0)


def test_open_operations_are_indexed_by_node():
    ops = {r.op.id: r for r in (op("a", "n1"), op("b", "n2"), op("c", "n1"))}
    open_ops = OpenOps(ops, ops)
    assert set(open_ops.of_node("n1")) == {"a", "c"} and set(open_ops.of_node("n2")) == {"b"}
    del ops["a"]  # a pruned record is still discarded by id
    open_ops.discard("a")
    open_ops.discard("b")
    open_ops.discard("b")
    assert set(open_ops) == {"c"} and len(open_ops) == 1 and "c" in open_ops
    assert set(open_ops.of_node("n2")) == set() and set(open_ops.of_node("n1")) == {"c"}


def test_the_live_problem_is_compiled_again_only_when_what_it_is_made_of_changed(woken, clock):
    svc, _ = woken
    live = svc.live
    compiled = []
    original = live.compile
    live.compile = lambda scenario: compiled.append(1) or original(scenario)
    live.refresh_live()
    assert compiled == []  # nothing changed since the start
    svc.apply_events([RequestEvent(id="e1", type="request", session="s1", model="beta", input_tokens=1000)])
    live.refresh_live()
    assert "s1" in live.sizes.sessions and compiled == []  # a new session: the catalog stays as compiled
    assert live.sizes.sessions["s1"].context_tokens == 1000
    link = Link("nodes", "n1", "nvme_read_bytes_per_s")
    live.calibration.put(link, Estimate(value=1e9, samples=1, last_measured=1e9))
    live.refresh_live()
    assert len(compiled) == 1 and live.sizes.nodes["n1"].nvme_read_bytes_per_s == 1e9
    live.calibration.put(link, Estimate(value=1e9, samples=1, last_measured=9e10, outliers=1))  # a refused sample
    live.refresh_live()
    assert len(compiled) == 1
    assert "s1" in live.sizes.sessions
    node = live.node("n1")
    host = live.sizes.nodes["n1"].host_bytes
    live.replace_node(node.model_copy(update={"host_dram_bytes": host // 2}))
    live.refresh_live()
    assert len(compiled) == 2 and live.sizes.nodes["n1"].host_bytes == host // 2
    live.refresh_live()
    assert len(compiled) == 2
