"""A request the SDK refuses before sending it (pydantic's `ValidationError`, naming the field) is a permanent
failure of that call for the agent: logged with the field, never retried, and the agent's other work goes on
(a bad registration ends it, since every later one would be the same)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import pytest
from clients_helpers import async_client, make_app, served
from pydantic import ValidationError
from test_agent_e2e import agent_config

from clients.agent.executors.base import GpuUsage, Telemetry
from clients.agent.executors.local import LocalExecutor
from clients.agent.operations import Operation, Outcome
from clients.agent.runner import Agent
from clients.sdk import AsyncStateBudgetClient

pytestmark = pytest.mark.anyio


class CountingClient:
    """The SDK client, counting the calls the agent makes (a refused body still counts as one call)."""

    def __init__(self, client: AsyncStateBudgetClient) -> None:
        self.client = client
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.client, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return method(*args, **kwargs)

        return call


class OverfullGpu(LocalExecutor):
    """Reports more HBM in use than its GPU has: `GpuTelemetryIn` refuses that GPU's reading."""

    def telemetry(self) -> Telemetry:
        return Telemetry(gpus=[GpuUsage("n1-g0", used_bytes=2 * 2**30, free_bytes=0, total_bytes=2**30)])


INSTANCE = {
    "id": "coder@bf16@n1-g0",
    "node": "n1",
    "kind": "vllm",
    "model": "coder",
    "precision": "bf16",
    "gpus": ["n1-g0"],
    "kv_pool_bytes_per_gpu": 0,
}


class InstanceTwice(LocalExecutor):
    """Reports one engine instance twice: a heartbeat `HeartbeatIn` refuses as a whole."""

    def telemetry(self) -> Telemetry:
        return Telemetry(instances=[{"instance": INSTANCE, "state": "running"}] * 2)


class NegativeBytes(LocalExecutor):
    """Carries out each move, then measures a negative byte count: a report `ReportIn` refuses."""

    async def execute(self, op: Operation) -> Outcome:
        done = await super().execute(op)
        return Outcome(done.measured_seconds, -1, done.details)


class UnknownEngineKind(LocalExecutor):
    """Declares an engine of a kind the API does not know: a registration `RegisterIn` refuses."""

    def engines(self) -> list[dict[str, Any]]:
        return [{"name": "e1", "kind": "tgi", "models": []}]


async def wait_for(condition, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.02)


async def test_one_gpus_bad_reading_leaves_that_gpu_out_of_the_heartbeat(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "statebudget.agent")
    async with served(make_app(tmp_path)) as http:
        sb = async_client(http)
        config = agent_config(tmp_path, "n1")
        agent = Agent(config, sb, OverfullGpu.from_config(config))
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        await wait_for(lambda: agent.stats["heartbeats"] >= 2)
        stop.set()
        await asyncio.wait_for(task, timeout=10)
        assert agent.stats["heartbeats_invalid"] == 0
        n1 = next(n for n in (await sb.get_cluster()).nodes if n.id == "n1")
        assert n1.last_heartbeat is not None  # the rest of the heartbeat reached the service
        assert n1.telemetry is not None and all(g.used_bytes is None for g in n1.telemetry.gpus)
    left_out = [r.getMessage() for r in caplog.records if "leaves out gpu n1-g0" in r.getMessage()]
    assert left_out and "used_bytes: 2147483648 is more than the GPU's total_bytes" in left_out[0]


async def test_an_invalid_heartbeat_is_logged_with_its_field_and_skipped(tmp_path, caplog):
    caplog.set_level(logging.ERROR, "statebudget.agent")
    async with served(make_app(tmp_path)) as http:
        sb = CountingClient(async_client(http))
        config = agent_config(tmp_path, "n1")
        agent = Agent(config, sb, InstanceTwice.from_config(config))  # type: ignore[arg-type] # a counting proxy
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        await wait_for(lambda: agent.stats["heartbeats_invalid"] >= 2)
        assert not task.done()  # the agent goes on: each heartbeat is built anew from the next telemetry
        stop.set()
        await asyncio.wait_for(task, timeout=10)
        assert agent.stats["heartbeats"] == 0
        assert sb.calls["heartbeat"] == agent.stats["heartbeats_invalid"]  # one call per heartbeat, no retries
        n1 = next(n for n in (await sb.client.get_cluster()).nodes if n.id == "n1")
        assert n1.last_heartbeat is None and n1.telemetry is None  # nothing reached the service
    refusals = [r.getMessage() for r in caplog.records if "heartbeat invalid" in r.getMessage()]
    assert refusals and "instances[1].instance.id: 'coder@bf16@n1-g0' is instances[0]" in refusals[0]


async def test_an_invalid_report_is_not_sent_nor_retried_and_its_lease_expires(tmp_path, caplog):
    caplog.set_level(logging.ERROR, "statebudget.agent")
    async with served(make_app(tmp_path)) as http:
        sb = CountingClient(async_client(http))
        config = agent_config(tmp_path, "n2", temporary_attempts=5)
        agent = Agent(config, sb, NegativeBytes.from_config(config))  # type: ignore[arg-type] # a counting proxy
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        await wait_for(lambda: agent.stats["unreported"] >= 1)
        stop.set()
        await asyncio.wait_for(task, timeout=10)
        assert agent.stats["done"] == 0 and not agent.reports
        assert sb.calls["report"] == agent.stats["unreported"]  # each report tried once, though 5 attempts were allowed
        leased = [o for o in await sb.client.list_operations(node="n2") if o.state == "leased"]
        assert len(leased) >= agent.stats["unreported"]  # still leased to n2: its lease expires and re-queues them
    refusals = [r.getMessage() for r in caplog.records if "the report is invalid" in r.getMessage()]
    assert refusals and "measured_bytes: Input should be greater than or equal to 0 (got -1)" in refusals[0]


async def test_an_invalid_registration_ends_the_agent_at_once(tmp_path, caplog):
    caplog.set_level(logging.ERROR, "statebudget.agent")
    async with served(make_app(tmp_path)) as http:
        sb = CountingClient(async_client(http))
        config = agent_config(tmp_path, "n1")
        agent = Agent(config, sb, UnknownEngineKind.from_config(config))  # type: ignore[arg-type] # a counting proxy
        with pytest.raises(ValidationError) as info:
            await asyncio.wait_for(agent.run(asyncio.Event()), timeout=10)
        assert info.value.errors()[0]["loc"] == ("engines", 0, "kind")
        assert sb.calls["register_node"] == 1 and sb.calls["lease"] == 0  # not retried, nothing leased
        n1 = next(n for n in (await sb.client.get_cluster()).nodes if n.id == "n1")
        assert n1.registered_at is None
    assert any("engines.0.kind: Input should be" in r.getMessage() for r in caplog.records)
