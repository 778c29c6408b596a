"""Lease renewal without HTTP: a lease renewed in time keeps its operations past `lease_seconds`; one that
ran out is refused, saying how it ended; another node's lease is not the caller's to renew."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from planner_service.domain.scenario import load_scenario
from planner_service.metrics import Metrics
from planner_service.service.engine import ClusterService
from planner_service.service.errors import Conflict, Forbidden, NotFound, NotReady
from planner_service.service.inputs import ReportIn, RequestEvent
from planner_service.service.store import Batch, SqliteStore
from planner_service.settings import Settings

TINY = Path(__file__).parent / "tiny_scenario.json"
LEASE_SECONDS = 10.0


class Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


class CountingStore(SqliteStore):
    """Counts the batches written, and fails the next one when told to."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.writes = 0
        self.fail_next = False

    def write(self, batch: Batch) -> None:
        if self.fail_next:
            self.fail_next = False
            raise OSError("disk full")
        self.writes += 1
        super().write(batch)


def open_service(path: Path, clock: Clock) -> ClusterService:
    svc = ClusterService(
        CountingStore(path), Metrics(CollectorRegistry()), Settings(lease_seconds=LEASE_SECONDS), clock=clock
    )
    svc.start(lambda: load_scenario(TINY))
    return svc


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def service(tmp_path: Path, clock: Clock):
    svc = open_service(tmp_path / "r.db", clock)
    yield svc
    svc.close()


def busy(svc: ClusterService) -> dict[str, Any]:
    """beta (blocking) must replace alpha on n1's GPU: the first lease holds the drop of alpha."""
    svc.apply_events(
        [
            RequestEvent(id="e1", type="request", session="s1", model="beta", slo="blocking", input_tokens=1000),
            RequestEvent(id="e2", type="request", session="s2", model="alpha", input_tokens=1000),
        ]
    )
    svc.replan()
    lease = svc.lease("n1", 10)
    assert [o["action"] for o in lease["operations"]] == ["drop"]
    return lease


def record(svc: ClusterService, op_id: str) -> dict[str, Any]:
    """The operation as the queues' view shows it, in whichever state it is."""
    states = (None, "done", "failed", "superseded")
    return next(o for state in states for o in svc.operations_view(state=state) if o["id"] == op_id)


def test_an_operation_running_longer_than_its_lease_keeps_it_when_renewed(service, clock):
    lease = busy(service)
    op = lease["operations"][0]["id"]
    for _ in range(5):  # 5 x 7 s: 35 s, three and a half times the lease
        clock.t += 7.0
        service.tick()  # the planning loop's expiry runs in between
        renewed = service.renew("n1", lease["lease_id"], node_scope="n1")
        assert renewed["lease_id"] == lease["lease_id"] and renewed["node"] == "n1"
        assert renewed["operations"] == [op] and renewed["expires_in_seconds"] == LEASE_SECONDS
        held = record(service, op)
        assert held["state"] == "leased" and held["lease_id"] == lease["lease_id"]
        assert held["lease_expires_at"] == clock.t + LEASE_SECONDS and held["leases"] == 1
    assert renewed["expires_at"] == "1970-01-01T00:17:25Z"  # 1035 s + 10 s
    clock.t += 9.0
    assert service.lease("n1", 10)["operations"] == []  # still held: nothing to lease again
    out = service.report(op, ReportIn(lease_id=lease["lease_id"], status="done", measured_seconds=44.0))
    assert out["operation"]["state"] == "done" and not out["duplicate"]


def test_a_renewal_is_one_batch_and_survives_a_restart(tmp_path, clock):
    svc = open_service(tmp_path / "r.db", clock)
    lease = busy(svc)
    clock.t += 8.0
    writes = svc.live.store.writes
    svc.renew("n1", lease["lease_id"])
    assert svc.live.store.writes == writes + 1
    svc.close()
    clock.t += 8.0  # past the lease as first granted, within the renewed one
    again = open_service(tmp_path / "r.db", clock)
    try:
        op = lease["operations"][0]["id"]
        assert record(again, op)["lease_expires_at"] == 1_018.0
        again.tick()
        assert record(again, op)["state"] == "leased"
        assert again.renew("n1", lease["lease_id"])["operations"] == [op]
    finally:
        again.close()


def test_a_renewal_after_expiry_is_refused_because_the_operations_were_requeued(service, clock):
    lease = busy(service)
    op = lease["operations"][0]["id"]
    clock.t += LEASE_SECONDS  # the lease ends at its deadline
    with pytest.raises(
        Conflict,
        match=rf"lease {lease['lease_id']} no longer holds any operation: it expired at "
        rf"1970-01-01T00:16:50Z \({op} re-queued\)",
    ):
        service.renew("n1", lease["lease_id"])
    assert record(service, op)["state"] == "queued"
    second = service.lease("n1", 10)
    assert [o["id"] for o in second["operations"]] == [op] and second["lease_id"] != lease["lease_id"]
    with pytest.raises(Conflict, match="re-queued"):  # asking again answers the same
        service.renew("n1", lease["lease_id"])
    with pytest.raises(Conflict, match="held by another lease"):
        service.report(op, ReportIn(lease_id=lease["lease_id"], status="done"))
    assert service.renew("n1", second["lease_id"])["operations"] == [op]


def test_a_refused_renewal_commits_the_expiry_it_found(tmp_path, clock):
    svc = open_service(tmp_path / "r.db", clock)
    lease = busy(svc)
    clock.t += LEASE_SECONDS + 1
    with pytest.raises(Conflict):
        svc.renew("n1", lease["lease_id"])
    svc.close()
    again = open_service(tmp_path / "r.db", clock)
    try:
        op = record(again, lease["operations"][0]["id"])
        assert op["state"] == "queued" and op["lease_id"] is None
    finally:
        again.close()


def test_a_lease_in_flight_across_epochs_is_renewed_until_it_runs_out_superseded(service, clock):
    lease = busy(service)
    op = lease["operations"][0]["id"]
    service.replan(force=True)  # epoch 2 plans around the drop in flight
    clock.t += 6.0
    assert service.renew("n1", lease["lease_id"])["operations"] == [op]  # an older epoch's work is still held
    clock.t += LEASE_SECONDS + 1
    with pytest.raises(Conflict, match=rf"it expired at .*\({op} superseded by plan epoch 2\)"):
        service.renew("n1", lease["lease_id"])
    assert record(service, op)["state"] == "superseded"


def test_a_renewal_covers_only_the_operations_not_reported(service, clock):
    drop = busy(service)
    service.report(drop["operations"][0]["id"], ReportIn(lease_id=drop["lease_id"], status="done"))
    lease = service.lease("n1", 10)
    first, second = (o["id"] for o in lease["operations"])
    service.report(first, ReportIn(lease_id=lease["lease_id"], status="done"))
    clock.t += 5.0
    assert service.renew("n1", lease["lease_id"])["operations"] == [second]
    assert record(service, first)["lease_expires_at"] != clock.t + LEASE_SECONDS  # a reported one is left alone
    service.report(second, ReportIn(lease_id=lease["lease_id"], status="failed", error="engine gone"))
    with pytest.raises(Conflict, match=rf"every operation it held was reported \({first}, {second} reported\)"):
        service.renew("n1", lease["lease_id"])


def test_an_unknown_lease_is_refused(service):
    busy(service)
    with pytest.raises(Conflict, match="lease nope no longer holds any operation: the service does not know it"):
        service.renew("n1", "nope")


def test_another_nodes_lease_is_forbidden(service, clock):
    lease = busy(service)
    with pytest.raises(Forbidden, match=f"lease {lease['lease_id']} belongs to node 'n1', not to 'n2'"):
        service.renew("n2", lease["lease_id"], node_scope="n2")
    with pytest.raises(NotFound, match=f"node 'n2' holds no lease {lease['lease_id']} \\(it is a lease of node 'n1'"):
        service.renew("n2", lease["lease_id"])  # an operator naming the wrong node
    with pytest.raises(NotFound, match="unknown node 'n9'"):
        service.renew("n9", lease["lease_id"])
    clock.t += LEASE_SECONDS + 1  # an ended lease is still n1's: n2 learns nothing of it
    with pytest.raises(Forbidden, match="belongs to node 'n1'"):
        service.renew("n2", lease["lease_id"], node_scope="n2")
    held = record(service, lease["operations"][0]["id"])
    assert held["state"] == "queued"


def test_a_renewal_whose_write_fails_changes_nothing(service, clock):
    lease = busy(service)
    op = lease["operations"][0]["id"]
    before = record(service, op)
    clock.t += 5.0
    service.live.store.fail_next = True
    with pytest.raises(NotReady, match="a database write failed"):
        service.renew("n1", lease["lease_id"])
    assert record(service, op) == before
    assert service.renew("n1", lease["lease_id"])["expires_in_seconds"] == LEASE_SECONDS
