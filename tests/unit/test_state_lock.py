"""The state lock: one holder, urgent waiters first, arrival order within an urgency, no starvation."""

from __future__ import annotations

import threading
import time

import pytest

from planner_service.service.state_lock import StateLock, Urgency


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _queue_waiters(lock: StateLock, urgencies: list[tuple[str, Urgency]], order: list[str]) -> list[threading.Thread]:
    """Start one thread per (name, urgency) while the caller holds `lock`, each queued before the next starts."""
    threads = []
    for name, urgency in urgencies:

        def take(name: str = name, urgency: Urgency = urgency) -> None:
            lock.acquire(urgency)
            order.append(name)
            lock.release()

        thread = threading.Thread(target=take)
        thread.start()
        deadline = time.monotonic() + 5
        while len(lock._waiters) < len(threads) + 1:  # the thread is queued: the next may come
            assert time.monotonic() < deadline, "a waiter never queued"
            time.sleep(0.001)
        threads.append(thread)
    return threads


def test_urgent_waiters_go_before_routine_ones_and_each_urgency_goes_by_arrival():
    lock = StateLock(clock=Clock())
    order: list[str] = []
    lock.acquire()
    threads = _queue_waiters(
        lock,
        [
            ("report-1", Urgency.ROUTINE),
            ("lease-1", Urgency.URGENT),
            ("report-2", Urgency.ROUTINE),
            ("events-1", Urgency.URGENT),
        ],
        order,
    )
    lock.release()
    for thread in threads:
        thread.join(5)
    assert order == ["lease-1", "events-1", "report-1", "report-2"]


def test_a_waiter_that_waited_max_wait_goes_next_whatever_its_urgency():
    clock = Clock()
    lock = StateLock(max_wait=0.25, clock=clock)
    order: list[str] = []
    lock.acquire()
    threads = _queue_waiters(lock, [("report", Urgency.ROUTINE)], order)
    clock.now = 0.3  # the report has waited longer than max_wait when the urgent ones come
    threads += _queue_waiters(lock, [("lease", Urgency.URGENT)], order)
    lock.release()
    for thread in threads:
        thread.join(5)
    assert order == ["report", "lease"]


def test_the_lock_is_reentrant_and_only_its_holder_may_release_it():
    lock = StateLock()
    with lock:
        with lock:
            assert lock.held()
        assert lock.held()
        outsider: list[BaseException] = []

        def release() -> None:
            try:
                lock.release()
            except RuntimeError as error:
                outsider.append(error)

        thread = threading.Thread(target=release)
        thread.start()
        thread.join(5)
        assert outsider and "does not hold" in str(outsider[0])
    assert not lock.held()
    with pytest.raises(RuntimeError):
        lock.release()


def test_one_holder_at_a_time_under_contention():
    lock = StateLock()
    inside = 0
    most_inside = 0
    total = 0

    def work(urgency: Urgency) -> None:
        nonlocal inside, most_inside, total
        for _ in range(300):
            lock.acquire(urgency)
            inside += 1
            most_inside = max(most_inside, inside)
            value = total
            time.sleep(0)  # let another thread run while holding it
            total = value + 1
            inside -= 1
            lock.release()

    threads = [threading.Thread(target=work, args=(Urgency(i % 2),)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert most_inside == 1
    assert total == 8 * 300
