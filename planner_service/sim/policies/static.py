"""`static`: the best fixed placement for the trace's average demand, computed once (BOUTE-style).

The greedy planner is run once on the trace's average demand: ten pseudo
sessions spread over the models by their share of the requests, each active
with the mean context its model's requests arrive with (so the groups it
picks leave room for the KV of that demand); the models it places stay there
for the whole replay. Models left out are
loaded on demand into the room the fixed placement leaves, LRU within it.
Every turn's KV is written through to host DRAM, as for every baseline.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from types import MappingProxyType
from typing import TYPE_CHECKING

from planner_service.domain.problem import Session
from planner_service.domain.scenario import Slo
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.planner.greedy import plan_greedy
from planner_service.planner.online import apportion
from planner_service.sim.policies.base import Policy, PolicyName
from planner_service.sim.trace import TraceRequest

if TYPE_CHECKING:
    from planner_service.sim.executor import Executor
    from planner_service.sim.view import SimView

PSEUDO_SESSIONS = 10  # the team size the demand is spread over


def average_demand(sim: SimView) -> list[Session]:
    """`PSEUDO_SESSIONS` active sessions spread over the trace's models by request share (largest
    remainder), each with the mean history its model's requests arrive with: the average demand,
    KV included, that a fixed placement has to carry."""
    counts: Counter[str] = Counter()
    context: Counter[str] = Counter()
    history: dict[str, int] = {}
    for r in sim.records:
        if isinstance(r, TraceRequest) and r.model in sim.problem.models:
            counts[r.model] += 1
            context[r.model] += history.get(r.session, 0) + r.input_tokens + r.output_tokens
            history[r.session] = history.get(r.session, 0) + r.input_tokens + r.output_tokens
    if not counts:
        return []
    seats = apportion(counts, PSEUDO_SESSIONS)
    sessions = []
    for m in sorted(seats):
        for k in range(seats[m]):
            sid = f"avg-{m}-{k}"
            sessions.append(Session(sid, sid, Slo.INTERACTIVE, m, True, context[m] // counts[m]))
    return sessions


def static_placement(sim: SimView) -> dict[tuple[StateObject, Location], int]:
    """GPU entries (weights and experts) of the greedy's plan for the trace's average demand."""
    sessions = {s.id: s for s in average_demand(sim)}
    if not sessions:
        return {}
    problem = dataclasses.replace(
        sim.problem,
        sessions=MappingProxyType(sessions),
        next_model=MappingProxyType({sid: {s.model: 1.0} for sid, s in sessions.items()}),
    )
    target = plan_greedy(problem)
    return {(o, l): b for (o, l), b in target.placement.items() if l.tier is Tier.GPU and o.kind is not Kind.KV}


def apply_placement(sim: SimView, act: Executor, placement: dict[tuple[StateObject, Location], int]) -> set[str]:
    """Put a placement's weights (ready) and experts on the GPUs at t=0; returns the models placed."""
    models: set[str] = set()
    for obj, loc in sorted(placement):
        if obj.kind is Kind.WEIGHTS and obj.precision is not None:  # (weights always name their precision)
            gpus = tuple(sim.problem.gpus[l.id] for (o, l) in sorted(placement) if o == obj and l.tier is Tier.GPU)
            if obj.model not in models:
                act.place_now(obj.model, sim.problem.gpus[loc.id].node, obj.precision, gpus)
                models.add(obj.model)
    for (obj, loc), nbytes in sorted(placement.items()):
        if obj.kind is Kind.EXPERTS:
            act.add_experts(obj, loc, nbytes)
    return models


class StaticPolicy(Policy):
    name = PolicyName.STATIC

    def __init__(self) -> None:
        self.fixed: set[str] = set()

    def place(self, sim: SimView) -> None:
        self.fixed = apply_placement(sim, self.act, static_placement(sim))

    def victim_key(self, sim: SimView, obj: StateObject, loc: Location) -> tuple | None:
        if obj.kind is Kind.WEIGHTS and obj.model in self.fixed:
            return None  # the fixed placement never moves
        return super().victim_key(sim, obj, loc)

    def on_stuck(self, sim: SimView, req) -> None:
        if req.model not in self.fixed:
            super().on_stuck(sim, req)
            return
        # a fixed model whose group cannot hold this KV: free the group's other KV and experts
        state = sim.models[req.model]
        for g in state.gpus:
            loc = Location.gpu(g.id)
            for obj in list(sim.cluster.objects_at(loc)):
                if obj.kind is not Kind.WEIGHTS:
                    self.act.evict(obj, loc)
        shard = -(-sim.kv_footprint(req) // len(state.gpus))
        if any(sim.cluster.free(Location.gpu(g.id)) < shard for g in state.gpus):
            super().on_stuck(sim, req)  # even an empty group is too small: move the model where the KV fits


class StaticNoKvPolicy(StaticPolicy):
    """Ablation: `static` without KV write-through (a turn's KV lives only in its engine's GPU pool)."""

    name = PolicyName.STATIC_NOKV
    kv_offload = False
