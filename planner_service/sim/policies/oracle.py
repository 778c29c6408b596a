"""`oracle`: sees the future trace. Bélády eviction and perfect prefetch, within the same bandwidths.

Eviction takes, on a GPU, the object whose next use is furthest in the
future (never used again first). Prefetch: when a session's turn ends, the
model of its next turn is loaded right away (evicting only objects needed
later than that turn), and the session's KV is kept in host DRAM
(write-through) so it restores instead of re-prefilling. A reference point
to approach, not a proven optimum (it ignores contention between prefetches,
for instance).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import TYPE_CHECKING

from planner_service.domain.state import Kind, Location, StateObject
from planner_service.sim.policies.base import Policy, PolicyName
from planner_service.sim.trace import TraceRequest

if TYPE_CHECKING:
    from planner_service.sim.engine import Simulator, SimRequest

NEVER = float("inf")


class OraclePolicy(Policy):
    name = PolicyName.ORACLE
    kv_offload = True

    def __init__(self) -> None:
        self.model_times: dict[str, list[float]] = defaultdict(list)
        self.kv_times: dict[tuple[str, str], list[float]] = defaultdict(list)
        self.next_turn: dict[int, int] = {}  # record index -> the session's next request record index
        self.requests: list[TraceRequest] = []
        self.horizon: float | None = None  # while prefetching: keep what is needed before this time

    def setup(self, sim: Simulator) -> None:
        last: dict[str, int] = {}
        for rec in sim.records:
            if not isinstance(rec, TraceRequest):
                continue
            i = len(self.requests)
            self.requests.append(rec)
            self.model_times[rec.model].append(rec.t)
            self.kv_times[(rec.model, rec.session)].append(rec.t)
            if rec.session in last:
                self.next_turn[last[rec.session]] = i
            last[rec.session] = i
        later = set(self.next_turn.values())
        for i in range(len(self.requests)):
            if i not in later:  # each session's first turn, in time order
                self._prefetch(sim, self.requests[i])

    def _next_use(self, times: list[float], now: float) -> float:
        i = bisect.bisect_left(times, now)
        return times[i] if i < len(times) else NEVER

    def next_use(self, sim: Simulator, obj: StateObject) -> float:
        if obj.kind is Kind.KV:
            return self._next_use(self.kv_times.get((obj.model, obj.session), []), sim.now)
        return self._next_use(self.model_times.get(obj.model, []), sim.now)

    def victim_key(self, sim: Simulator, obj: StateObject, loc: Location) -> tuple | None:
        use = self.next_use(sim, obj)
        if self.horizon is not None and use <= self.horizon:
            return None
        return (-use, obj.kind is Kind.WEIGHTS, obj)

    def _prefetch(self, sim: Simulator, rec: TraceRequest) -> None:
        if rec.model in sim.models:
            return
        self.horizon = rec.t
        try:
            sim.load_model(rec.model)
        finally:
            self.horizon = None

    def on_done(self, sim: Simulator, req: SimRequest) -> None:
        nxt = self.next_turn.get(req.index)
        if nxt is not None:
            self._prefetch(sim, self.requests[nxt])
