"""The node agent end to end against the in-process service, with the `local` executor moving real bytes."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from clients_helpers import NODE_TOKENS, OPERATOR_TOKEN, async_client, make_app, request_event, served

from clients.agent.cli import install_signal_handlers, remove_signal_handlers
from clients.agent.config import AgentConfig
from clients.agent.errors import PermanentError, TemporaryError
from clients.agent.executors.local import LocalExecutor
from clients.agent.operations import Kind, Location, Operation, Outcome, StateObject
from clients.agent.runner import Agent
from clients.sdk import NotFoundError
from planner_service.wire.state import PlacementEntry

pytestmark = pytest.mark.anyio
SCALE = 1e-6


def agent_config(tmp_path, node: str = "n1", **overrides: Any) -> AgentConfig:
    settings: dict[str, Any] = {
        "node_id": node,
        "executor": "local",
        "scale": SCALE,
        "nvme_dir": tmp_path / node / "nvme",
        "host_dir": tmp_path / node / "host",
        "lease_wait_seconds": 0.2,
        "heartbeat_seconds": 0.1,
        "retry_delay_seconds": 0.01,
        "max_parallel": 4,
        **overrides,
    }
    return AgentConfig.model_validate(settings)


def _key(obj: StateObject, loc: Location) -> tuple[str, str]:
    return obj.key(), loc.label()


def placed(placement: Sequence[PlacementEntry]) -> Counter:
    return Counter({_key(e.object, e.location): e.bytes for e in placement})


def apply(placement: Sequence[PlacementEntry], ops: Sequence[Operation]) -> Counter:
    """The confirmed placement after the operations, as the service's `apply_operation` defines it."""
    out = placed(placement)
    for op in ops:
        if op.dest is not None:
            out[_key(op.object, op.dest)] += op.bytes
        if op.source is not None and not op.keep_source:
            key = _key(op.object, op.source)
            out[key] -= op.bytes
            if out[key] <= 0:
                del out[key]
    return out


async def run_until_idle(agent: Agent, sb, node: str, timeout: float = 15.0, open_states=("queued", "leased")) -> None:
    """Run the agent until its node has no operation left in `open_states`, then stop it."""
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        async with asyncio.timeout(timeout):
            while True:
                await asyncio.sleep(0.05)
                assert not task.done(), task.exception() if task.done() else None
                ops = await sb.list_operations(node=node)
                if agent.stats["done"] + agent.stats["failed"] and not [o for o in ops if o.state in open_states]:
                    break
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)


async def test_demo_operations_are_carried_out_and_confirmed(tmp_path):
    app = make_app(tmp_path)  # the demo scenario: 4 nodes, 16 GPUs, 7 models
    async with served(app) as http:
        sb = async_client(http)
        before = await sb.get_srv()
        plan = await sb.get_plan()
        mine = [o for o in plan.operations if o.node == "n1"]
        assert len(mine) >= 3
        config = agent_config(tmp_path)
        executor = LocalExecutor.from_config(config)
        agent = Agent(config, sb, executor)
        await run_until_idle(agent, sb, "n1")

        assert agent.stats["done"] == len(mine) and agent.stats["failed"] == 0
        after = await sb.get_srv()
        assert after.version == before.version + len(mine)
        assert placed(after.placement) == apply(before.placement, mine)
        done = {o.id: o for o in await sb.list_operations(node="n1", state="done")}
        assert set(done) == {o.id for o in mine}
        for op in mine:  # reported what was measured, scaled back to planned bytes
            assert done[op.id].measured_bytes == pytest.approx(op.bytes, abs=1 / SCALE)  # rounding of the scaled copy
            assert (done[op.id].measured_seconds or 0) > 0

        # the bytes really are where the confirmed placement says, at 1 byte per million
        for entry in after.placement:
            loc = entry.location
            if (loc.gpu or "").startswith("n1-") or loc.node == "n1":
                key = entry.object.key()
                assert executor.store(loc).size(key) == pytest.approx(entry.bytes * SCALE, abs=3), (key, loc)
        assert any(p.name.startswith("experts__") for p in (tmp_path / "n1" / "nvme").iterdir())

        # registration and heartbeats reached the service
        node = next(n for n in (await sb.get_cluster()).nodes if n.id == "n1")
        assert node.registered_at and node.last_heartbeat and agent.stats["heartbeats"] >= 1
        assert node.telemetry is not None and node.telemetry.engines == {"local": "ready"}
        used = {g.id: g.used_bytes for g in node.telemetry.gpus}
        assert used and all(v is not None for v in used.values())
        # nothing was leased for other nodes
        assert all(o.node == "n1" for o in await sb.list_operations(state="done"))


async def test_dependencies_wait_for_the_room_they_need(tmp_path):
    app = make_app(tmp_path, tiny=True)
    async with served(app) as http:
        sb = async_client(http)
        await sb.post_events(
            request_event("e1", "s1", "beta", slo="blocking", input_tokens=1000),
            request_event("e2", "s2", "alpha", input_tokens=1000),
        )
        await sb.replan()
        plan = [o for o in (await sb.get_plan()).operations if o.node == "n1"]
        drop = next(o for o in plan if o.action == "drop")
        assert all(drop.id in o.depends_on for o in plan if o.action == "promote")
        before = await sb.get_srv()
        config = agent_config(tmp_path)
        executor = LocalExecutor.from_config(config)
        agent = Agent(config, sb, executor)
        await run_until_idle(agent, sb, "n1")
        assert agent.reports[0]["op"] == drop.id
        after = await sb.get_srv()
        assert placed(after.placement) == apply(before.placement, plan)
        gpu = executor.gpu("n1-g0")
        assert gpu.keys() == sorted(["weights__beta__bf16", "kv__beta__s1"])
        assert gpu.size("weights__beta__bf16") == round(12884901888 * SCALE)


class Scripted:
    """Wraps an executor: fails chosen operations, permanently or a few times temporarily."""

    def __init__(self, inner, *, permanent: set[Kind] = frozenset(), temporary_failures: int = 0):
        self.inner, self.permanent, self.temporary_left = inner, permanent, temporary_failures
        self.capabilities = inner.capabilities
        self.calls: list[str] = []

    async def execute(self, op: Operation) -> Outcome:
        self.calls.append(op.id)
        if op.object.kind in self.permanent:
            raise PermanentError(f"engine cannot move {op.object.label()}")
        if self.temporary_left > 0:
            self.temporary_left -= 1
            raise TemporaryError("engine busy")
        return await self.inner.execute(op)

    def telemetry(self):
        return self.inner.telemetry()

    def engines(self):
        return self.inner.engines()

    async def aclose(self):
        await self.inner.aclose()


async def test_a_failing_operation_is_reported_failed_with_its_reason(tmp_path):
    app = make_app(tmp_path)
    async with served(app) as http:
        sb = async_client(http)
        # n3: where the demo's first plan moves KV (s02's, promoted beside the planner it serves there)
        mine = [o for o in (await sb.get_plan()).operations if o.node == "n3"]
        before = await sb.get_srv()
        config = agent_config(tmp_path, "n3")
        executor = Scripted(LocalExecutor.from_config(config), permanent={Kind.KV})
        agent = Agent(config, sb, executor)
        await run_until_idle(agent, sb, "n3")
        kv_ops = {o.id for o in mine if o.object.kind is Kind.KV}
        assert kv_ops and agent.stats["failed"] == len(kv_ops) and agent.stats["done"] == len(mine) - len(kv_ops)
        failed = await sb.list_operations(node="n3", state="failed")
        assert {o.id for o in failed} == kv_ops
        assert all("engine cannot move kv(" in (o.error or "") for o in failed)
        assert executor.calls.count(next(iter(kv_ops))) == 1  # permanent: tried once
        assert (await sb.get_srv()).version == before.version + len(mine) - len(kv_ops)


async def test_temporary_errors_are_retried(tmp_path):
    app = make_app(tmp_path, tiny=True)
    async with served(app) as http:
        sb = async_client(http)
        config = agent_config(tmp_path, temporary_attempts=3, max_parallel=1)
        await sb.post_events(request_event("e1", "s1", "beta", slo="blocking", input_tokens=1000))
        await sb.replan()
        executor = Scripted(LocalExecutor.from_config(config), temporary_failures=2)
        agent = Agent(config, sb, executor)
        await run_until_idle(agent, sb, "n1")
        assert agent.stats["failed"] == 0 and agent.stats["done"] >= 1
        assert len(executor.calls) == agent.stats["done"] + 2


async def test_temporary_errors_give_up_after_the_attempts(tmp_path):
    app = make_app(tmp_path, tiny=True)
    async with served(app) as http:
        sb = async_client(http)
        await sb.post_events(request_event("e1", "s1", "beta", slo="blocking", input_tokens=1000))
        await sb.replan()
        config = agent_config(tmp_path, temporary_attempts=3)
        stubborn = Scripted(LocalExecutor.from_config(config), temporary_failures=100)
        agent = Agent(config, sb, stubborn)
        await run_until_idle(agent, sb, "n1", open_states=("leased",))
        failed = await sb.list_operations(node="n1", state="failed")
        assert [o.action for o in failed] == ["drop"] and len(stubborn.calls) == 3
        assert "gave up after 3 attempt(s): engine busy" in (failed[0].error or "")
        # its dependents never ran: they are not leased while the drop is not done
        assert {o.state for o in await sb.list_operations(node="n1")} == {"queued"}


class Slow:
    """An executor whose operations finish only when the test lets them."""

    capabilities = frozenset()

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.ran: list[str] = []

    async def execute(self, op: Operation) -> Outcome:
        self.ran.append(op.id)
        self.started.set()
        await self.release.wait()
        return Outcome(measured_seconds=0.5, measured_bytes=op.bytes)

    def telemetry(self):
        from clients.agent.executors.base import Telemetry

        return Telemetry()

    def engines(self):
        return []

    async def aclose(self):
        return None


async def test_stop_finishes_running_work_and_leases_no_more(tmp_path):
    app = make_app(tmp_path)
    async with served(app) as http:
        sb = async_client(http)
        # n3: its first lease is one move (n1's holds an engine step's eight, leased together)
        mine = [o for o in (await sb.get_plan()).operations if o.node == "n3"]
        executor = Slow()
        agent = Agent(agent_config(tmp_path, "n3", max_parallel=1, capabilities=[]), sb, executor)
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        await asyncio.wait_for(executor.started.wait(), timeout=5)
        stop.set()
        await asyncio.sleep(0.1)
        assert not task.done()  # it waits for the operation in flight
        executor.release.set()
        await asyncio.wait_for(task, timeout=5)
        assert executor.ran == [mine[0].id] and agent.stats["done"] == 1
        states = Counter(o.state for o in await sb.list_operations(node="n3"))
        assert states["queued"] == len(mine) - 1 and states["leased"] == 0  # nothing leased after the stop


async def test_sigterm_stops_the_agent(tmp_path):
    app = make_app(tmp_path)
    async with served(app) as http:
        sb = async_client(http)
        executor = Slow()
        executor.release.set()
        agent = Agent(agent_config(tmp_path, capabilities=[]), sb, executor)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        install_signal_handlers(loop, stop)
        try:
            task = asyncio.create_task(agent.run(stop))
            await asyncio.wait_for(executor.started.wait(), timeout=5)
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(task, timeout=5)
        finally:
            remove_signal_handlers(loop)
        assert stop.is_set() and agent.stats["done"] >= 1


class VllmCoder(Slow):
    """A node whose only engine is a vLLM server for the coder (its operations wait for the test)."""

    def engines(self):
        return [{"name": "vllm-coder", "kind": "vllm", "models": ["coder"], "url": "http://127.0.0.1:9"}]


async def test_the_agent_declares_the_gpus_its_engines_were_launched_on(tmp_path):
    async with served(make_app(tmp_path)) as http:
        sb = async_client(http)
        config = agent_config(
            tmp_path,
            node="n2",
            capabilities=[],
            engines={"coder": "http://127.0.0.1:9"},
            engine_gpus={"coder": ["n2-g3", "n2-g2"]},
        )
        executor = VllmCoder()
        executor.release.set()
        stop = asyncio.Event()
        task = asyncio.create_task(Agent(config, sb, executor).run(stop))
        try:
            async with asyncio.timeout(10):
                while not (node := (await sb.get_cluster()).nodes[1]).registered_at:
                    await asyncio.sleep(0.05)
        finally:
            stop.set()
            await asyncio.wait_for(task, timeout=10)
        # and the URL the gateway routes the model's requests to
        assert [e.model_dump() for e in node.engines or []] == [
            {"model": "coder", "gpus": ["n2-g2", "n2-g3"], "url": "http://127.0.0.1:9"}
        ]


async def test_with_a_node_token_state_is_materialized_on_first_use(tmp_path):
    app = make_app(tmp_path, auth=True)
    async with served(app) as http:
        operator, node1 = async_client(http, OPERATOR_TOKEN), async_client(http, NODE_TOKENS["n1"])
        mine = [o for o in (await operator.get_plan()).operations if o.node == "n1"]
        config = agent_config(tmp_path, token=NODE_TOKENS["n1"])
        agent = Agent(config, node1, LocalExecutor.from_config(config))  # cannot read /v1/srv: no seeding
        await run_until_idle(agent, operator, "n1")
        assert agent.stats["done"] == len(mine) and agent.stats["failed"] == 0


async def test_an_unknown_node_stops_the_agent_with_the_service_error(tmp_path):
    async with served(make_app(tmp_path)) as http:
        sb = async_client(http)
        config = agent_config(tmp_path, node="nx")
        with pytest.raises(NotFoundError, match="unknown node 'nx'"):
            await Agent(config, sb, LocalExecutor.from_config(config)).run(asyncio.Event())


def test_heartbeats_send_each_measured_rate_once(tmp_path):
    config = agent_config(tmp_path, gpus=[{"id": "n1-g0", "hbm_bytes": 10**10}])
    executor = LocalExecutor.from_config(config)
    agent = Agent(config, None, executor)  # type: ignore[arg-type]  # no service needed to build a heartbeat
    promote = Operation.model_validate(
        {
            "id": "1",
            "action": "promote",
            "object": {"kind": "experts", "model": "m"},
            "from": {"tier": "host", "node": "n1"},
            "to": {"tier": "gpu", "gpu": "n1-g0"},
            "bytes": 10**9,
            "keep_source": True,
            "node": "n1",
            "priority": "prefetch",
            "depends_on": [],
            "estimated_seconds": 0.5,
            "reason": "",
        }
    )
    agent.meter.observe(promote, Outcome(measured_seconds=0.5, measured_bytes=10**9))
    agent.meter.observe(replace_source(promote, "nvme"), Outcome(measured_seconds=1.0, measured_bytes=10**9))
    body = agent.heartbeat_body()
    assert body["gpus"] == [{"id": "n1-g0", "used_bytes": 0, "free_bytes": 10**10, "h2d_bytes_per_s": 2e9}]
    assert body["nvme_read_bytes_per_s"] == 1e9
    again = agent.heartbeat_body()
    assert (
        again["gpus"] == [{"id": "n1-g0", "used_bytes": 0, "free_bytes": 10**10}]
        and "nvme_read_bytes_per_s" not in again
    )


def replace_source(op: Operation, tier: str) -> Operation:
    return op.model_copy(update={"source": Location.model_validate({"tier": tier, "node": "n1"})})
