"""The state lock: one holder at a time, its waiters served by urgency first and by arrival within it.

Under load the lock is a queue, and its bursts come from node agents: fifty agents woken by a plan lease at
once and report their operations done fifty milliseconds later, and each report holds the lock for a few
milliseconds. Served by arrival, every event batch and lease behind such a burst waits for all of it.
Requests someone waits on to go on (an agent's lease and its renewal, a router's event batch, the gateway's
route table, the status) are `URGENT` and go before the `ROUTINE` ones (done reports, replans, edits, the
operators' reads), whose answer only acknowledges what happened or can wait; the urgent ones hold the lock
for a millisecond or two at most. No waiter starves: one that has waited `max_wait` goes next whatever its
urgency.

Reentrant, like `threading.RLock`: a thread holding it may take it again. A release hands the lock straight to
the waiter chosen, waking that thread alone.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self


class Urgency(enum.IntEnum):
    URGENT = 0  # a caller waits on the answer to go on: a lease, an event batch, the route table
    ROUTINE = 1  # the answer acknowledges what happened: a done report, a replan, an edit


@dataclass(order=True)
class _Waiter:
    urgency: Urgency
    seq: int
    since: float = field(compare=False)
    thread: int = field(compare=False)
    wakeup: threading.Lock = field(compare=False, default_factory=threading.Lock)


class StateLock:
    """A reentrant lock whose waiters go by (`Urgency`, arrival), and by arrival alone once one has waited
    `max_wait` seconds."""

    def __init__(self, max_wait: float = 0.25, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_wait = max_wait
        self._clock = clock
        self._guard = threading.Lock()  # guards the fields below, held only for a few statements
        self._owner: int | None = None
        self._depth = 0
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()

    def acquire(self, urgency: Urgency = Urgency.ROUTINE) -> None:
        me = threading.get_ident()
        with self._guard:
            if self._owner == me:
                self._depth += 1
                return
            if self._owner is None and not self._waiters:
                self._owner, self._depth = me, 1
                return
            waiter = _Waiter(urgency, next(self._seq), self._clock(), me)
            waiter.wakeup.acquire()
            self._waiters.append(waiter)
        waiter.wakeup.acquire()  # released by the holder that hands the lock over: this thread owns it now

    def release(self) -> None:
        with self._guard:
            if self._owner != threading.get_ident():
                raise RuntimeError("release of a state lock this thread does not hold")
            self._depth -= 1
            if self._depth:
                return
            if not self._waiters:
                self._owner = None
                return
            chosen = self._next()
            self._waiters.remove(chosen)
            self._owner, self._depth = chosen.thread, 1
        chosen.wakeup.release()

    def _next(self) -> _Waiter:
        oldest = min(self._waiters, key=lambda w: w.seq)
        if self._clock() - oldest.since >= self.max_wait:
            return oldest
        return min(self._waiters)

    def held(self) -> bool:
        """Whether this thread holds the lock."""
        return self._owner == threading.get_ident()

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.release()
