"""Read a placement the way planners need it: who serves each model, where copies are complete.

A model is *served* on a node when its weights at one precision are complete
on that node's GPUs (tensor-parallel shards add up to the full size). A copy
is *complete* on a tier of a node when that tier alone holds the full object.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from planner_service.domain.problem import Gpu, Problem
from planner_service.domain.state import Kind, Location, StateObject, Tier


@dataclass(frozen=True, slots=True)
class Serving:
    node: str
    precision: str
    gpus: tuple[Gpu, ...]


@dataclass
class ResidencyIndex:
    problem: Problem
    placement: Mapping[tuple[StateObject, Location], int]
    serving: dict[str, Serving] = field(default_factory=dict)
    used: dict[Location, int] = field(default_factory=lambda: defaultdict(int))
    # (object, node, tier) -> bytes on that tier of that node (GPU bytes summed over the node's GPUs)
    by_tier: dict[tuple[StateObject, str, Tier], int] = field(default_factory=lambda: defaultdict(int))
    # model -> sessions with KV for it anywhere (most sessions have none for most models)
    kv_sessions: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))

    @classmethod
    def build(cls, problem: Problem, placement: Mapping[tuple[StateObject, Location], int]) -> ResidencyIndex:
        index = cls(problem, placement)
        gpu_holders: dict[tuple[StateObject, str], list[Gpu]] = defaultdict(list)
        for (obj, loc), nbytes in placement.items():
            if nbytes <= 0:
                continue
            node = problem.node_of(loc)
            index.used[loc] += nbytes
            index.by_tier[(obj, node, loc.tier)] += nbytes
            if obj.kind is Kind.KV:
                index.kv_sessions[obj.model].add(obj.session)
            elif loc.tier is Tier.GPU and obj.kind is Kind.WEIGHTS:
                gpu_holders[(obj, node)].append(problem.gpus[loc.id])
        for (obj, node), gpus in sorted(gpu_holders.items(), key=lambda kv: _serving_order(problem, kv[0])):
            if obj.model in index.serving:
                continue
            if index.by_tier[(obj, node, Tier.GPU)] >= problem.size_of(obj):
                index.serving[obj.model] = Serving(node, obj.precision, tuple(sorted(gpus, key=lambda g: g.id)))
        return index

    def complete(self, obj: StateObject, node: str, tier: Tier) -> bool:
        return self.by_tier.get((obj, node, tier), 0) >= self.problem.size_of(obj) > 0

    def complete_source(self, obj: StateObject, node: str) -> Tier | None:
        """The fastest tier below GPU that holds a complete copy on the node."""
        for tier in (Tier.HOST, Tier.NVME):
            if self.complete(obj, node, tier):
                return tier
        return None

    def on(self, obj: StateObject, node: str, tier: Tier) -> int:
        return self.by_tier.get((obj, node, tier), 0)

    def free(self, loc: Location) -> int:
        return self.problem.capacity_of(loc) - self.used.get(loc, 0)


def _serving_order(problem: Problem, key: tuple[StateObject, str]) -> tuple[int, str]:
    obj, node = key
    # the preferred precision wins when a model is complete on GPU at two
    return (problem.models[obj.model].precisions.index(obj.precision), node)
