"""`static`: the best fixed placement for the trace's average demand, computed once (BOUTE-style).

The greedy planner is run once on the trace's overall model mix (pseudo
sessions whose next-model probabilities are that mix, none active, no KV);
the models it places stay there for the whole replay. Models left out are
loaded on demand into the room the fixed placement leaves, LRU within it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from types import MappingProxyType
from typing import TYPE_CHECKING

from planner_service.domain.scenario import Slo
from planner_service.domain.problem import Session
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.planner.greedy import plan_greedy
from planner_service.sim.policies.base import Policy, PolicyName
from planner_service.sim.trace import TraceRequest

if TYPE_CHECKING:
    from planner_service.sim.engine import Simulator

PSEUDO_SESSIONS = 10  # the team size the demand is spread over


def static_placement(sim: Simulator) -> dict[tuple[StateObject, Location], int]:
    """GPU entries (weights and experts) of the greedy's plan for the trace's average model mix."""
    counts = Counter(r.model for r in sim.records if isinstance(r, TraceRequest) and r.model in sim.problem.models)
    total = sum(counts.values())
    if not total:
        return {}
    mix = {m: n / total for m, n in sorted(counts.items())}
    top = max(sorted(mix), key=mix.get)
    sessions = {f"avg{i}": Session(f"avg{i}", f"avg{i}", Slo.INTERACTIVE, top, False, 0) for i in range(PSEUDO_SESSIONS)}
    problem = dataclasses.replace(
        sim.problem,
        sessions=MappingProxyType(sessions),
        next_model=MappingProxyType({s: mix for s in sessions}),
    )
    target = plan_greedy(problem)
    return {(o, l): b for (o, l), b in target.placement.items() if l.tier is Tier.GPU and o.kind is not Kind.KV}


def apply_placement(sim: Simulator, placement: dict[tuple[StateObject, Location], int]) -> set[str]:
    """Put a placement's weights (ready) and experts on the GPUs at t=0; returns the models placed."""
    models: set[str] = set()
    for (obj, loc), nbytes in sorted(placement.items()):
        if obj.kind is Kind.WEIGHTS:
            gpus = tuple(
                sim.problem.gpus[l.id] for (o, l) in sorted(placement) if o == obj and l.tier is Tier.GPU
            )
            if obj.model not in models:
                sim.place_now(obj.model, sim.problem.gpus[loc.id].node, obj.precision, gpus)
                models.add(obj.model)
    for (obj, loc), nbytes in sorted(placement.items()):
        if obj.kind is Kind.EXPERTS and sim.cluster.free(loc) >= nbytes:
            sim.cluster.add(obj, loc, nbytes)
    return models


class StaticPolicy(Policy):
    name = PolicyName.STATIC

    def __init__(self) -> None:
        self.fixed: set[str] = set()

    def setup(self, sim: Simulator) -> None:
        self.fixed = apply_placement(sim, static_placement(sim))

    def victim_key(self, sim: Simulator, obj: StateObject, loc: Location) -> tuple | None:
        if obj.kind is Kind.WEIGHTS and obj.model in self.fixed:
            return None  # the fixed placement never moves
        return super().victim_key(sim, obj, loc)

    def on_stuck(self, sim: Simulator, req) -> None:
        if req.model not in self.fixed:
            super().on_stuck(sim, req)
            return
        # a fixed model whose group cannot hold this KV: free the group's other KV and experts
        state = sim.models[req.model]
        for g in state.gpus:
            loc = Location.gpu(g.id)
            for obj in list(sim.cluster.objects_at(loc)):
                if obj.kind is not Kind.WEIGHTS:
                    sim.evict(obj, loc)
        shard = -(-sim.kv_footprint(req) // len(state.gpus))
        if any(sim.cluster.free(Location.gpu(g.id)) < shard for g in state.gpus):
            super().on_stuck(sim, req)  # even an empty group is too small: move the model where the KV fits


class SiloedPolicy(StaticPolicy):
    """Weights pinned by the static choice; KV tiered to host DRAM by LRU (LMCache); experts by LRU.

    Each kind of state is tiered on its own, with no joint budget across them.
    """

    name = PolicyName.SILOED
    kv_offload = True
