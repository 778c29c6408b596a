"""Read a placement the way planners need it: who serves each model, where copies are complete.

A model is *served* on a node when its weights at one precision are complete
on that node's GPUs (tensor-parallel shards add up to the full size). A copy
is *complete* on a tier of a node when that tier alone holds the full object.

Building the index copies only GPU, host DRAM and KV entries: a location
holds at most one copy of an object, so the bytes of an object on a node's
NVMe are one lookup in the placement itself. Placements are dominated by
checkpoints on NVMe, which the index therefore never copies.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from types import MappingProxyType
from typing import Final

from planner_service.domain.problem import Gpu, Problem
from planner_service.domain.state import Kind, Location, Placement, StateObject, Tier

_GPU = Tier.GPU  # bound once: on Python 3.11 an `Enum.MEMBER` lookup costs about ten global reads
_BELOW_GPU = (Tier.HOST, Tier.NVME)  # fastest first


class Unknown(Enum):
    """A memo's "not looked up yet", where None is an answer (`UNKNOWN`, its one member)."""

    TOKEN = "unknown"


UNKNOWN: Final = Unknown.TOKEN


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
    # (object, node) -> bytes on the node's GPUs, summed over them
    gpu_bytes: dict[tuple[StateObject, str], int] = field(default_factory=lambda: defaultdict(int))
    # the GPU, host DRAM and KV entries of the placement
    on_gpus: dict[tuple[StateObject, Location], int] = field(default_factory=dict)
    on_host: dict[tuple[StateObject, Location], int] = field(default_factory=dict)
    kv_entries: dict[tuple[StateObject, Location], int] = field(default_factory=dict)
    # model -> sessions with KV for it anywhere (most sessions have none for most models)
    kv_sessions: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    # (object, node) -> `complete_source`, remembered (the placement must not change while the index is used)
    _sources: dict[tuple[StateObject, str], Tier | None] = field(default_factory=dict, init=False, repr=False)
    _locations: dict[tuple[Tier, str], Location] = field(default_factory=dict, init=False, repr=False)
    _below_locations: dict[str, tuple[Location, ...]] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def build(cls, problem: Problem, placement: Mapping[tuple[StateObject, Location], int]) -> ResidencyIndex:
        index = cls(problem, placement)
        nvme_tier, gpu_tier, kv_kind, weights_kind = Tier.NVME, Tier.GPU, Kind.KV, Kind.WEIGHTS
        gpus, gpu_bytes, on_gpus, on_host = problem.gpus, index.gpu_bytes, index.on_gpus, index.on_host
        kv_entries, kv_sessions = index.kv_entries, index.kv_sessions
        gpu_holders: dict[tuple[StateObject, str], list[Gpu]] = defaultdict(list)
        for key, nbytes in placement.items():
            obj, loc = key
            tier, kind = loc.tier, obj.kind
            if (tier is nvme_tier and kind is not kv_kind) or nbytes <= 0:
                continue  # checkpoints on NVMe: most of a placement
            if kind is kv_kind:
                kv_entries[key] = nbytes
                assert obj.session is not None  # a KV object
                kv_sessions[obj.model].add(obj.session)
            if tier is gpu_tier:
                gpu = gpus[loc.id]
                on_gpus[key] = nbytes
                gpu_bytes[(obj, gpu.node)] += nbytes
                if kind is weights_kind:
                    gpu_holders[(obj, gpu.node)].append(gpu)
            elif tier is not nvme_tier:
                on_host[key] = nbytes
        index.serving = _serving(problem, gpu_holders, index.gpu_bytes)
        return index

    @classmethod
    def below_gpu(cls, problem: Problem, placement: Mapping[tuple[StateObject, Location], int]) -> ResidencyIndex:
        """An index that answers only for host DRAM and NVMe (`on`, `complete`, `complete_source`).

        Those are lookups in the placement itself, so nothing is copied: for a
        placement read once, such as where a cold load would come from.
        """
        return cls(problem, placement)

    @staticmethod
    def serving_in(problem: Problem, placement: Mapping[tuple[StateObject, Location], int]) -> dict[str, Serving]:
        """`build(problem, placement).serving` alone: only the weights on GPUs are read."""
        gpu_tier, weights_kind = Tier.GPU, Kind.WEIGHTS
        holders: dict[tuple[StateObject, str], list[Gpu]] = defaultdict(list)
        gpu_bytes: dict[tuple[StateObject, str], int] = defaultdict(int)
        for (obj, loc), nbytes in placement.items():
            if loc.tier is gpu_tier and obj.kind is weights_kind and nbytes > 0:
                gpu = problem.gpus[loc.id]
                holders[(obj, gpu.node)].append(gpu)
                gpu_bytes[(obj, gpu.node)] += nbytes
        return _serving(problem, holders, gpu_bytes)

    def on(self, obj: StateObject, node: str, tier: Tier) -> int:
        """Bytes of `obj` on one tier of a node (GPU bytes summed over the node's GPUs)."""
        if tier is _GPU:
            return self.gpu_bytes.get((obj, node), 0)
        nbytes = self.placement.get((obj, self._location(tier, node)), 0)
        return max(0, nbytes)

    def _location(self, tier: Tier, node: str) -> Location:
        """A node's host DRAM or NVMe location (made once per index)."""
        loc = self._locations.get((tier, node))
        if loc is None:
            loc = self._locations[(tier, node)] = Location(tier, node)
        return loc

    def complete(self, obj: StateObject, node: str, tier: Tier) -> bool:
        return self.on(obj, node, tier) >= self.problem.size_of(obj) > 0

    def complete_source(self, obj: StateObject, node: str) -> Tier | None:
        """The fastest tier below GPU that holds a complete copy on the node."""
        key = (obj, node)
        tier = self._sources.get(key, UNKNOWN)
        if tier is UNKNOWN:
            tier = self._sources[key] = self._fastest_complete_below(obj, node)
        return tier

    def _fastest_complete_below(self, obj: StateObject, node: str) -> Tier | None:
        size = self.problem.size_of(obj)
        if size > 0:
            for loc in self._below(node):
                if self.placement.get((obj, loc), 0) >= size:
                    return loc.tier
        return None

    def _below(self, node: str) -> tuple[Location, ...]:
        """The node's host DRAM and NVMe locations, fastest first (made once per index)."""
        locs = self._below_locations.get(node)
        if locs is None:
            locs = self._below_locations[node] = tuple(self._location(tier, node) for tier in _BELOW_GPU)
        return locs

    def free(self, loc: Location) -> int:
        return self.problem.capacity_of(loc) - self.used.get(loc, 0)

    @cached_property
    def used(self) -> dict[Location, int]:
        """Bytes held per location (a pass over the whole placement, made on first use)."""
        used: dict[Location, int] = defaultdict(int)
        for (_, loc), nbytes in self.placement.items():
            if nbytes > 0:
                used[loc] += nbytes
        return used

    @cached_property
    def by_tier(self) -> dict[tuple[StateObject, str, Tier], int]:
        """(object, node, tier) -> bytes there, for every entry (a pass over the whole placement, made on first use)."""
        out: dict[tuple[StateObject, str, Tier], int] = defaultdict(int)
        for (obj, loc), nbytes in self.placement.items():
            if nbytes > 0:
                out[(obj, self.problem.node_of(loc), loc.tier)] += nbytes
        return out


def copy_placement(placement: Mapping[tuple[StateObject, Location], int]) -> Placement:
    """A dict copy of a placement: a dict, or a read-only view of one, copies without hashing its keys again."""
    if isinstance(placement, dict | MappingProxyType):
        return placement.copy()
    return dict(placement)


def _serving(
    problem: Problem,
    holders: Mapping[tuple[StateObject, str], list[Gpu]],
    gpu_bytes: Mapping[tuple[StateObject, str], int],
) -> dict[str, Serving]:
    """Who serves each model: the node whose GPUs hold its weights complete, preferred precision first."""
    serving: dict[str, Serving] = {}
    for (obj, node), gpus in sorted(holders.items(), key=lambda kv: _serving_order(problem, kv[0])):
        if obj.model not in serving and gpu_bytes[(obj, node)] >= problem.size_of(obj):
            assert obj.precision is not None  # a weights object
            serving[obj.model] = Serving(node, obj.precision, tuple(sorted(gpus, key=lambda g: g.id)))
    return serving


def _serving_order(problem: Problem, key: tuple[StateObject, str]) -> tuple[int, str]:
    obj, node = key
    # the preferred precision wins when a model is complete on GPU at two
    return (problem.models[obj.model].precisions.index(obj.precision), node)
