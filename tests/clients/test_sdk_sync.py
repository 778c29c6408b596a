"""The sync SDK against the in-process app: every endpoint method, through starlette's TestClient."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn
from clients_helpers import FAST_RETRY, make_app

from clients.sdk import ConnectionError, NotFoundError, StateBudgetClient, events
from planner_service.wire.cluster import ClusterOut, ModelOut
from planner_service.wire.enums import (
    CalibrationScope,
    Capability,
    EventStatus,
    HealthStatus,
    OperationState,
    PlanStatus,
    ReportStatus,
    Slo,
    SolverName,
)
from planner_service.wire.health import Health

# the SDK passes a per-call timeout on long polls; starlette's TestClient warns that it ignores it
pytestmark = pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument")


def test_every_method(sync_client):
    sb, _, _ = sync_client(tiny=True)
    assert sb.livez() == Health(status=HealthStatus.OK)
    assert sb.readyz().status is HealthStatus.OK
    assert "statebudget_" in sb.metrics()

    cluster = sb.get_cluster()
    assert isinstance(cluster, ClusterOut) and [n.id for n in cluster.nodes] == ["n1", "n2"]
    topology = {
        "nodes": [
            {
                "id": n.id,
                "host_dram_bytes": n.host_dram_bytes,
                "nvme_bytes": n.nvme_bytes,
                "gpus": [
                    {
                        "id": g.id,
                        "hbm_bytes": g.capacity_bytes,
                        "hbm_bytes_per_s": 1e12,
                        "bf16_flops": 1e14,
                        "h2d_bytes_per_s": 2e10,
                    }
                    for g in n.gpus
                ],
            }
            for n in cluster.nodes
        ]
    }
    assert [n.id for n in sb.put_cluster(topology).nodes] == ["n1", "n2"]

    assert {m.id for m in sb.list_models()} == {"alpha", "beta"}
    gamma = {"precisions": ["bf16"], "weights_bytes": {"bf16": 2 * 1024**3}, "kv_bytes_per_token": 65536}
    created = sb.put_model("gamma", gamma, nvme_nodes=["n1"])
    assert isinstance(created, ModelOut) and created.id == "gamma" and created.resolved.kv_bytes_per_token == 65536
    assert "gamma" in {m.id for m in sb.list_models()}
    assert sb.delete_model("gamma") is None
    assert "gamma" not in {m.id for m in sb.list_models()}

    out = sb.post_events(
        events.request("e1", session="s1", model="beta", slo=Slo.BLOCKING, input_tokens=1000, user="ann"),
        events.tool_call_start("e2", session="s1", tool="pytest"),
        events.tool_call_end("e3", session="s1", tool="pytest"),
        events.turn_end("e4", session="s1", output_tokens=50),
    )
    assert out.applied == 4 and out.duplicates == 0
    again = sb.post_events(events.turn_end("e4", session="s1"))
    assert again.duplicates == 1 and again.results[0].status is EventStatus.DUPLICATE
    assert [s.id for s in sb.list_sessions()] == ["s1"]
    session = sb.get_session("s1")
    assert session.model == "beta" and session.tool_calls == 1 and session.user == "ann"
    assert session.slo is Slo.BLOCKING

    srv = sb.get_srv()
    assert srv.version >= 1 and srv.placement
    assert sb.get_engines() == []  # no node serves through vLLM or SGLang here
    epoch = sb.get_plan().epoch
    routes = sb.get_routes()
    assert routes.epoch == epoch and {m.model for m in routes.models} <= {"alpha", "beta"}
    replanned = sb.replan()
    assert replanned.epoch == epoch + 1 and replanned.changed is True and replanned.operations
    assert replanned.status in (PlanStatus.OK, PlanStatus.PARTIAL)
    whatif = sb.whatif([{"type": "add_sessions", "model": "alpha", "count": 2}], solver=SolverName.SEARCH)
    assert whatif.solver == "search" and whatif.plan.search is not None and whatif.predicted.gpu_bytes > 0
    pareto = sb.pareto()
    assert pareto.points and pareto.frontier
    assert sb.explain(model="beta").objects
    assert sb.explain(session="s1").session_model == "beta"

    reg = sb.register_node(
        "n1", capabilities=[Capability.WEIGHTS_OFFLOAD], gpus=[{"id": "n1-g0"}], agent_version="test"
    )
    assert reg.node == "n1" and reg.capabilities == [Capability.WEIGHTS_OFFLOAD]
    hb = sb.heartbeat(
        "n1",
        gpus=[{"id": "n1-g0", "used_bytes": 1, "free_bytes": 2, "h2d_bytes_per_s": 1e10}],
        nvme_read_bytes_per_s=2e9,
    )
    assert hb.node == "n1" and hb.calibration["nvme_read_bytes_per_s"].samples == 1
    (n1,) = sb.get_calibration(node="n1").nodes
    assert n1.calibrated["nvme_read_bytes_per_s"].samples == 1
    reset = sb.reset_calibration(CalibrationScope.NODES, "n1", "nvme_read_bytes_per_s")
    assert reset.forgotten == 1 and "nvme_read_bytes_per_s" not in reset.nodes[0].calibrated

    lease = sb.lease("n1", max_operations=10)
    assert lease.operations and lease.lease_id
    op = lease.operations[0]
    renewed = sb.renew_lease("n1", lease.lease_id)
    assert renewed.lease_id == lease.lease_id and renewed.operations == [o.id for o in lease.operations]
    done = sb.report(
        op.id, lease_id=lease.lease_id, status=ReportStatus.DONE, measured_seconds=1.0, measured_bytes=op.bytes
    )
    assert done.operation.state is OperationState.DONE and done.srv_version == srv.version + 1
    assert sb.get_srv().version == srv.version + 1
    assert {o.id for o in sb.list_operations(node="n1", state=OperationState.DONE)} == {op.id}
    assert all(o.node == "n2" for o in sb.list_operations(node="n2"))

    assert sb.post_events(events.session_end("e5", session="s1")).applied == 1
    assert all(s.ended for s in sb.list_sessions() if s.id == "s1")  # ended (or purged: it holds no KV)


def test_unknown_session_is_not_found(sync_client):
    sb, _, _ = sync_client()
    with pytest.raises(NotFoundError) as info:
        sb.get_session("nobody")
    assert info.value.status == 404 and "nobody" in info.value.detail


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sync_client_over_real_http(tmp_path):
    """The SDK's own httpx.Client against uvicorn in a thread on 127.0.0.1."""
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(tmp_path), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        with StateBudgetClient(f"http://127.0.0.1:{port}", retry=FAST_RETRY) as sb:
            assert sb.readyz().status is HealthStatus.OK
            assert sb.get_srv().version == 1 and sb.readyz().epoch == 1  # seeded, planned once
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    with StateBudgetClient(f"http://127.0.0.1:{port}", retry=FAST_RETRY, timeout_seconds=1) as sb:
        with pytest.raises(ConnectionError) as info:
            sb.livez()
        assert "GET /livez" in str(info.value)
