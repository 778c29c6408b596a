"""`clairvoyant`: the `statebudget` policy told each session's real next model (a reference, not a baseline).

Everything is `statebudget`'s (the planner, the online rules, the stand-ins
for the recent load) except the next-model predictions: a session's is the
model of its next request in the trace, certain, and nothing where the session
sends no more. What `statebudget` loses against it is what a better switch
predictor could still buy; the rest of the distance to the floor is placement.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING

from planner_service.sim.policies.base import PolicyName
from planner_service.sim.policies.statebudget import StatebudgetPolicy
from planner_service.sim.trace import TraceRequest

if TYPE_CHECKING:
    from planner_service.domain.problem import Session
    from planner_service.sim.state import SessionState, SimRequest
    from planner_service.sim.view import SimView


class ClairvoyantPolicy(StatebudgetPolicy):
    name = PolicyName.CLAIRVOYANT

    def place(self, sim: SimView) -> None:
        super().place(sim)
        self.upcoming: dict[str, list[str]] = {}  # session -> the models of its requests, in trace order
        for r in sim.records:
            if isinstance(r, TraceRequest):
                self.upcoming.setdefault(r.session, []).append(r.model)
        self.requests_seen: Counter[str] = Counter()

    def observe(self, sim: SimView, session: SessionState, req: SimRequest) -> None:
        super().observe(sim, session, req)
        self.requests_seen[req.session] += 1

    def next_models(self, sim: SimView, sessions: Mapping[str, Session]) -> dict[str, dict[str, float]]:
        """The trace's next model of each real session; stand-ins, which have no trace, keep the predictor's."""
        predicted = super().next_models(sim, sessions)
        for session_id in sessions:
            upcoming = self.upcoming.get(session_id)
            if upcoming is not None:
                seen = self.requests_seen[session_id]
                predicted[session_id] = {upcoming[seen]: 1.0} if seen < len(upcoming) else {}
        return predicted
