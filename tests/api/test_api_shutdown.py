"""Shutting down: a draining service answers lease long-polls at once, leasing nothing; signals start the drain."""

from __future__ import annotations

import asyncio
import signal
import time

from planner_service.api.app import drain_on_exit_signals
from planner_service.api.deps import QueueSignal

EMPTY_LEASE = {"lease_id": None, "expires_at": None, "expires_in_seconds": None, "operations": []}


def test_a_draining_service_answers_long_polls_at_once_and_leases_nothing(tiny):
    queued = len(tiny.get("/v1/operations", params={"state": "queued"}).json())
    assert queued > 0
    tiny.client.portal.call(tiny.client.app.state.signal.drain)
    started = time.monotonic()
    answer = tiny.lease("n1", wait=30)
    assert time.monotonic() - started < 5  # not the 30 s it asked to wait
    assert answer.status_code == 200 and answer.json() == EMPTY_LEASE
    assert len(tiny.get("/v1/operations", params={"state": "queued"}).json()) == queued


def test_drain_wakes_a_waiting_poll():
    async def scenario() -> bool:
        queues = QueueSignal()
        waiting = [asyncio.ensure_future(queues.event(node).wait()) for node in ("n1", "n2")]
        await asyncio.sleep(0)
        queues.drain()
        await asyncio.wait_for(asyncio.gather(*waiting), timeout=1)  # every node's long-polls
        return queues.draining

    assert asyncio.run(scenario())


def test_a_change_wakes_only_the_long_polls_of_its_node():
    async def scenario() -> tuple[bool, bool, bool]:
        queues = QueueSignal()
        n1, n2 = queues.event("n1"), queues.event("n2")
        queues.bump({"n1"})
        woken = n1.is_set(), n2.is_set()
        queues.bump()  # None: every node
        return (*woken, n2.is_set())

    assert asyncio.run(scenario()) == (True, False, True)


def test_any_change_wakes_the_route_tables_long_polls():
    async def scenario() -> tuple[bool, bool, bool, bool]:
        queues = QueueSignal()
        first = queues.any_change()
        queues.bump({"n1"})  # one node's queue: a report, say
        second = queues.any_change()
        fresh = second is not first and not second.is_set()
        queues.bump()
        return first.is_set(), fresh, second.is_set(), queues.any_change().is_set()

    assert asyncio.run(scenario()) == (True, True, True, False)


def test_an_exit_signal_drains_then_reaches_the_servers_own_handler():
    seen: list[int] = []

    def server_handler(sig: int, frame: object) -> None:  # stands in for uvicorn's
        seen.append(sig)

    before = signal.signal(signal.SIGTERM, server_handler)
    loop = asyncio.new_event_loop()
    try:
        queues = QueueSignal()
        with drain_on_exit_signals(loop, queues):
            signal.raise_signal(signal.SIGTERM)
            loop.run_until_complete(asyncio.sleep(0.01))  # runs the drain the handler scheduled
            assert queues.draining and seen == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is server_handler  # put back as it was
        signal.raise_signal(signal.SIGTERM)
        assert seen == [signal.SIGTERM, signal.SIGTERM]
    finally:
        loop.close()
        signal.signal(signal.SIGTERM, before)
