"""The async SDK against the in-process app (httpx.ASGITransport, lifespan run in the test's loop)."""

from __future__ import annotations

import asyncio

import pytest
from clients_helpers import NODE_TOKENS, OPERATOR_TOKEN, async_client, make_app, served
from support import CallLog

from clients.sdk import ConflictError, PermissionDeniedError, events
from planner_service.wire.enums import Action, Capability, EngineStatus, HealthStatus, OperationState, ReportStatus

pytestmark = pytest.mark.anyio


async def test_every_method_async(tmp_path):
    app = make_app(tmp_path, tiny=True)
    async with served(app) as http:
        sb = async_client(http)
        assert (await sb.livez()).status is HealthStatus.OK
        assert (await sb.readyz()).epoch == 1
        assert "statebudget_" in await sb.metrics()
        cluster = await sb.get_cluster()
        assert len(cluster.nodes) == 2
        nodes = [
            {
                "id": n.id,
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
        assert len((await sb.put_cluster({"nodes": nodes})).nodes) == 2
        assert {m.id for m in await sb.list_models()} == {"alpha", "beta"}
        assert await sb.put_model(
            "gamma", {"precisions": ["bf16"], "weights_bytes": {"bf16": 1024**3}, "kv_bytes_per_token": 1024}
        ) == next(m for m in await sb.list_models() if m.id == "gamma")
        assert await sb.delete_model("gamma") is None
        out = await sb.post_events(events.request("e1", session="s1", model="beta", slo="blocking", input_tokens=1000))
        assert out.applied == 1
        assert (await sb.get_session("s1")).model == "beta"
        assert len(await sb.list_sessions()) == 1
        before = await sb.get_srv()
        plan = await sb.replan()
        assert (await sb.get_plan()).epoch == plan.epoch
        whatif = await sb.whatif([{"type": "remove_gpu", "gpu": "n2-g0"}])
        assert whatif.based_on_epoch == plan.epoch and whatif.baseline_predicted is not None
        assert (await sb.pareto()).frontier
        assert (await sb.explain(model="alpha")).model == "alpha"
        reg = await sb.register_node("n1", capabilities=[Capability.WEIGHTS_OFFLOAD, Capability.KV_OFFLOAD])
        assert set(reg.capabilities) == {Capability.WEIGHTS_OFFLOAD, Capability.KV_OFFLOAD}
        await sb.heartbeat("n1", gpus=[{"id": "n1-g0", "used_bytes": 5}], engines={"vllm-alpha": EngineStatus.AWAKE})
        node = next(n for n in (await sb.get_cluster()).nodes if n.id == "n1")
        assert node.telemetry is not None and node.telemetry.engines == {"vllm-alpha": "awake"}
        lease = await sb.lease("n1", max_operations=5)
        assert [o.action for o in lease.operations] == [Action.DROP]
        op = lease.operations[0]
        assert lease.lease_id is not None and op.epoch == plan.epoch
        out = await sb.report(op.id, lease_id=lease.lease_id, status=ReportStatus.FAILED, error="engine refused")
        assert out.operation.state is OperationState.FAILED and out.operation.error == "engine refused"
        assert (await sb.get_srv()).version == before.version  # a failure confirms nothing
        assert [o.id for o in await sb.list_operations(state=OperationState.FAILED)] == [op.id]
        await sb.aclose()


async def test_long_poll_wakes_when_work_becomes_ready(tmp_path):
    app = make_app(tmp_path, tiny=True, max_wait_seconds=60.0)
    async with served(app) as http:
        sb = async_client(http)
        await sb.post_events(
            events.request("e1", session="s1", model="beta", slo="blocking", input_tokens=1000),
            events.request("e2", session="s2", model="alpha", input_tokens=1000),
        )
        await sb.replan()
        first = await sb.lease("n1")
        assert [o.action for o in first.operations] == [Action.DROP]
        assert first.lease_id is not None
        leases = CallLog(app.state.service, "lease")
        waiting = asyncio.create_task(sb.lease("n1", wait_seconds=60))
        # the wait runs in a thread, not in this event loop, which serves the long-poll meanwhile
        await asyncio.to_thread(leases.wait_for, lambda calls: len(calls) == 1, what="the long-poll's first look")
        assert leases.calls[0][1]["operations"] == [] and not waiting.done()  # nothing is ready: it waits
        await sb.report(first.operations[0].id, lease_id=first.lease_id, status=ReportStatus.DONE)
        second = await asyncio.wait_for(waiting, timeout=20)  # well before its 60 s deadline: the report woke it
        assert [o.action for o in second.operations] == [Action.PROMOTE, Action.PROMOTE]
        assert len(leases.calls) == 2  # one look before waiting, one when woken


async def test_node_tokens_async(tmp_path):
    app = make_app(tmp_path, auth=True)
    async with served(app) as http:
        node1, node2 = async_client(http, NODE_TOKENS["n1"]), async_client(http, NODE_TOKENS["n2"])
        lease = await node1.lease("n1", max_operations=1)
        op, lease_id = lease.operations[0], lease.lease_id
        assert lease_id is not None
        with pytest.raises(PermissionDeniedError, match="belongs to node 'n1'"):
            await node2.report(op.id, lease_id=lease_id, status=ReportStatus.DONE)
        with pytest.raises(ConflictError):
            await node1.report(op.id, lease_id="foreign", status=ReportStatus.DONE)
        assert (await node1.report(op.id, lease_id=lease_id, status=ReportStatus.DONE)).duplicate is False
        assert (await async_client(http, OPERATOR_TOKEN).get_srv()).version == 2
