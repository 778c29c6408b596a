"""The agent renews the lease of operations it is still running, and gives up a lease the service handed on.

The agent's sleeps move the service's fake clock (`Timeline`), so a move that runs for minutes of service
time takes a fraction of a second here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from clients_helpers import async_client, make_app, served
from support import FakeClock

from clients.agent.config import AgentConfig
from clients.agent.executors.base import Telemetry
from clients.agent.operations import Operation, Outcome
from clients.agent.runner import Agent
from clients.sdk import ConnectionError as SdkConnectionError

pytestmark = pytest.mark.anyio
LEASE_SECONDS = 30.0  # clients_helpers.make_app's


class Timeline:
    """The agent's `sleep`: each sleep moves the service's clock on by its seconds (and `late_by` more)."""

    def __init__(self, clock: FakeClock, *, late_by: float = 0.0) -> None:
        self.clock, self.late_by = clock, late_by
        self.slept: list[float] = []

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0.01)  # the rest of the agent runs meanwhile
        self.slept.append(seconds)
        self.clock.advance(seconds + self.late_by)


class Slow:
    """An executor whose operations finish only when the test lets them."""

    capabilities = frozenset()

    def __init__(self) -> None:
        self.started: list[str] = []
        self.release = asyncio.Event()

    async def execute(self, op: Operation) -> Outcome:
        self.started.append(op.id)
        await self.release.wait()
        return Outcome(measured_seconds=120.0, measured_bytes=op.bytes)

    def telemetry(self) -> Telemetry:
        return Telemetry()

    def engines(self) -> list[dict[str, Any]]:
        return []

    async def aclose(self) -> None:
        return None


class Recorded:
    """The SDK client, with the order of its renewals and reports kept."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def renew_lease(self, node_id: str, lease_id: str) -> Any:
        self.calls.append(("renew", lease_id))
        return await self.inner.renew_lease(node_id, lease_id)

    async def report(self, op_id: str, **body: Any) -> Any:
        self.calls.append(("report", op_id))
        return await self.inner.report(op_id, **body)


def config(tmp_path, **overrides: Any) -> AgentConfig:
    settings: dict[str, Any] = {
        "node_id": "n1",
        "capabilities": [],
        "seed_from_srv": False,
        "lease_wait_seconds": 0.2,
        "heartbeat_seconds": 0.1,
        "retry_delay_seconds": 0.01,
        **overrides,
    }
    return AgentConfig.model_validate(settings)


async def until(condition, what: str, timeout: float = 10.0) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def test_the_agent_renews_a_long_operation_and_its_report_is_accepted(tmp_path):
    clock = FakeClock()
    async with served(make_app(tmp_path, clock=clock)) as http:
        sb = Recorded(async_client(http))
        timeline, executor = Timeline(clock), Slow()
        agent = Agent(config(tmp_path, node_id="n3", max_parallel=1), sb, executor, sleep=timeline.sleep)  # type: ignore[arg-type]  # the SDK client, wrapped
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        await until(lambda: executor.started, "the first operation to start")
        started_at = clock()
        await until(lambda: clock() - started_at > 3 * LEASE_SECONDS, "three lease lengths of renewals")
        (leased,) = await sb.list_operations(node="n3", state="leased")
        assert leased.id == executor.started[0] and leased.leases == 1  # never handed to another lease
        assert leased.lease_expires_at is not None and leased.lease_expires_at > clock()
        stop.set()  # lease nothing more; the running operation finishes and reports
        executor.release.set()
        await asyncio.wait_for(task, timeout=10)

        assert agent.stats["done"] == 1 and agent.stats["conflicts"] == 0 and agent.stats["renewals"] >= 9
        assert set(timeline.slept) == {LEASE_SECONDS / 3}  # every third of the registration's lease_seconds
        (done,) = await sb.list_operations(node="n3", state="done")
        assert done.id == leased.id and done.lease_id == leased.lease_id and done.measured_seconds == 120.0
        # renewing stopped with the work: nothing after the report
        assert sb.calls[-1] == ("report", done.id)
        assert {c for c in sb.calls[:-1]} == {("renew", leased.lease_id)}


async def test_a_refused_renewal_hands_the_lease_on_and_nothing_of_it_is_reported(tmp_path, caplog):
    clock = FakeClock()
    async with served(make_app(tmp_path, clock=clock)) as http:
        sb = Recorded(async_client(http))
        timeline, executor = Timeline(clock, late_by=LEASE_SECONDS), Slow()  # every renewal comes too late
        agent = Agent(
            config(tmp_path, node_id="n2", max_parallel=2, max_operations=2),  # two ready there
            sb,  # type: ignore[arg-type]  # the SDK client, wrapped
            executor,
            sleep=timeline.sleep,
        )
        stop = asyncio.Event()
        caplog.set_level(logging.INFO, logger="statebudget.agent")
        task = asyncio.create_task(agent.run(stop))
        await until(lambda: agent.stats["leases_handed_on"], "the renewal to be refused")
        stop.set()
        executor.release.set()
        await asyncio.wait_for(task, timeout=10)

        (renewal,) = [lease_id for call, lease_id in sb.calls if call == "renew"]
        assert not [c for c in sb.calls if c[0] == "report"] and agent.reports == []
        ops = [o for o in await sb.list_operations(node="n2") if o.id in executor.started]
        assert len(ops) == len(executor.started) == 2, executor.started
        assert all(o.state == "queued" and o.leases == 1 for o in ops)  # the service has them back
        # the lease held those two and the rest of their engine step's moves (leased together), none reported
        held = [o for o in await sb.list_operations(node="n2") if o.leases == 1]
        assert agent.stats["not_reported"] == len(held) >= len(executor.started)
        handed_on = [r for r in caplog.records if "was handed on" in r.getMessage()]
        assert len(handed_on) == 1 and handed_on[0].levelno == logging.WARNING
        message = handed_on[0].getMessage()
        assert f"lease {renewal} of node n2" in message and "re-queued" in message
        assert all(op_id in message for op_id in executor.started)


class Flaky(Recorded):
    """The first renewal never reaches the service."""

    async def renew_lease(self, node_id: str, lease_id: str) -> Any:
        if not any(call == "renew" for call, _ in self.calls):
            self.calls.append(("renew", lease_id))
            raise SdkConnectionError("connection reset", method="POST", url=f"/v1/nodes/{node_id}/leases")
        return await super().renew_lease(node_id, lease_id)


async def test_a_renewal_that_fails_in_transit_is_tried_again_at_the_next_third(tmp_path):
    clock = FakeClock()
    async with served(make_app(tmp_path, clock=clock)) as http:
        sb = Flaky(async_client(http))
        timeline, executor = Timeline(clock), Slow()
        agent = Agent(config(tmp_path, node_id="n3", max_parallel=1), sb, executor, sleep=timeline.sleep)  # type: ignore[arg-type]  # the SDK client, wrapped
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        await until(lambda: agent.stats["renewals"] >= 3, "renewals after the lost one")
        stop.set()
        executor.release.set()
        await asyncio.wait_for(task, timeout=10)
        assert agent.stats["renew_errors"] == 1 and agent.stats["done"] == 1 and agent.stats["leases_handed_on"] == 0
