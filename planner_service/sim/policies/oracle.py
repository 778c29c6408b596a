"""`oracle`: sees the future trace. Bélády eviction and perfect prefetch, within the same bandwidths.

It starts from the same fixed placement as `static` and `statebudget` (the
greedy's plan for the trace's average mix), then uses what no online policy
can know:

* **Bélády eviction.** On a GPU, the object whose next use is furthest in
  the future goes first (never used again before all others).
* **Perfect prefetch.** When a session's turn ends, the model of its next
  turn is loaded right away, evicting only objects needed later than that
  turn; the session's KV is kept in host DRAM (write-through) so it restores
  instead of re-prefilling.
* **Sized for the coming load.** An on-demand load leaves room next to the
  weights for the KV of every request of that model arriving within the
  planner's horizon (`constants.horizon_seconds`), so a busy model gets a
  group wide enough to batch its sessions (when one exists).

A reference point to approach, not a proven optimum (it ignores contention
between prefetches, for instance).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import TYPE_CHECKING

from planner_service.domain.state import Kind, Location, StateObject
from planner_service.sim.policies.base import Policy, PolicyName
from planner_service.sim.policies.static import apply_placement, static_placement
from planner_service.sim.trace import TraceRequest

if TYPE_CHECKING:
    from planner_service.sim.state import SimRequest
    from planner_service.sim.view import SimView

NEVER = float("inf")


class OraclePolicy(Policy):
    name = PolicyName.ORACLE

    def __init__(self) -> None:
        self.model_times: dict[str, list[float]] = defaultdict(list)
        self.model_kv: dict[str, list[int]] = defaultdict(list)  # prefix sums of KV footprints, by arrival
        self.kv_times: dict[tuple[str, str], list[float]] = defaultdict(list)
        self.next_turn: dict[int, int] = {}  # record index -> the session's next request record index
        self.requests: list[TraceRequest] = []
        self.horizon: float | None = None  # while prefetching: keep what is needed before this time

    def place(self, sim: SimView) -> None:
        apply_placement(sim, self.act, static_placement(sim))
        last: dict[str, int] = {}
        history: dict[str, int] = defaultdict(int)
        for rec in sim.records:
            if not isinstance(rec, TraceRequest):
                continue
            i = len(self.requests)
            self.requests.append(rec)
            self.model_times[rec.model].append(rec.t)
            kv = (history[rec.session] + rec.input_tokens + rec.output_tokens) * sim.problem.models[
                rec.model
            ].kv_bytes_per_token
            sums = self.model_kv[rec.model]
            sums.append((sums[-1] if sums else 0) + kv)
            history[rec.session] += rec.input_tokens + rec.output_tokens
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

    def next_use(self, sim: SimView, obj: StateObject) -> float:
        if obj.kind is Kind.KV and obj.session is not None:  # (KV always names its session)
            return self._next_use(self.kv_times.get((obj.model, obj.session), []), sim.now)
        return self._next_use(self.model_times.get(obj.model, []), sim.now)

    def victim_key(self, sim: SimView, obj: StateObject, loc: Location) -> tuple | None:
        use = self.next_use(sim, obj)
        if self.horizon is not None and use <= self.horizon:
            return None
        return (-use, obj.kind is Kind.WEIGHTS, obj)

    def kv_reserve(self, sim: SimView, model: str) -> int:
        """The KV of the model's requests arriving within the horizon (trace times), at least the waiting one's."""
        times, sums = self.model_times.get(model, []), self.model_kv.get(model, [])
        lo = bisect.bisect_left(times, sim.now)
        hi = bisect.bisect_right(times, sim.now + sim.c.horizon_seconds)
        coming = (sums[hi - 1] - (sums[lo - 1] if lo else 0)) if hi > lo else 0
        return max(coming, super().kv_reserve(sim, model))

    def _prefetch(self, sim: SimView, rec: TraceRequest) -> None:
        if rec.model in sim.models:
            return
        self.horizon = rec.t
        try:
            self.act.load_model(rec.model)
        finally:
            self.horizon = None

    def on_done(self, sim: SimView, req: SimRequest) -> None:
        nxt = self.next_turn.get(req.index)
        if nxt is not None:
            self._prefetch(sim, self.requests[nxt])
