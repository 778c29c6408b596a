"""State objects, where they live, and placements.

A placement maps (state object, location) to the bytes of that object held
there. A location holds at most one copy of an object, so the map is enough.
Objects and locations are small named tuples: hashable, cheap, and they sort
deterministically, which keeps plans reproducible.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from planner_service.wire.enums import Kind as Kind  # noqa: PLC0414 -- re-exported: it was defined here
from planner_service.wire.enums import Tier as Tier  # noqa: PLC0414 -- re-exported: it was defined here

# Faster tiers first: promote moves towards 0, demote away from it.
TIER_RANK = {Tier.GPU: 0, Tier.HOST: 1, Tier.NVME: 2}

# The named constructors below run in planners' inner loops, so they build the tuple directly: the
# generated `__new__` is a Python call of its own, and on Python 3.11 an `Enum.MEMBER` lookup costs
# about ten global reads (together two to five times as long as making the tuple).
_tuple_new = tuple.__new__
_WEIGHTS, _EXPERTS, _KV = Kind.WEIGHTS, Kind.EXPERTS, Kind.KV
_GPU, _HOST, _NVME = Tier.GPU, Tier.HOST, Tier.NVME


class StateObject(NamedTuple):
    """`weights(model, precision)`, `experts(model)` or `kv(model, session)`."""

    kind: Kind
    model: str
    precision: str | None = None
    session: str | None = None

    @classmethod
    def weights(cls, model: str, precision: str) -> StateObject:
        return _tuple_new(cls, (_WEIGHTS, model, precision, None))

    @classmethod
    def experts(cls, model: str) -> StateObject:
        return _tuple_new(cls, (_EXPERTS, model, None, None))

    @classmethod
    def kv(cls, model: str, session: str) -> StateObject:
        return _tuple_new(cls, (_KV, model, None, session))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.value, "model": self.model}
        if self.kind is Kind.WEIGHTS:
            out["precision"] = self.precision
        elif self.kind is Kind.KV:
            out["session"] = self.session
        return out

    def label(self) -> str:
        if self.kind is Kind.WEIGHTS:
            return f"weights({self.model}, {self.precision})"
        if self.kind is Kind.KV:
            return f"kv({self.model}, {self.session})"
        return f"experts({self.model})"


class Location(NamedTuple):
    """A GPU (`id` is the GPU id) or a node's host DRAM / NVMe (`id` is the node id)."""

    tier: Tier
    id: str

    @classmethod
    def gpu(cls, gpu_id: str) -> Location:
        return _tuple_new(cls, (_GPU, gpu_id))

    @classmethod
    def host(cls, node_id: str) -> Location:
        return _tuple_new(cls, (_HOST, node_id))

    @classmethod
    def nvme(cls, node_id: str) -> Location:
        return _tuple_new(cls, (_NVME, node_id))

    def to_json(self) -> dict[str, str]:
        key = "gpu" if self.tier is Tier.GPU else "node"
        return {"tier": self.tier.value, key: self.id}

    def label(self) -> str:
        return f"{self.tier.value}:{self.id}"


Placement = dict[tuple[StateObject, Location], int]


def object_from_json(data: Mapping[str, Any]) -> StateObject:
    kind = Kind(data["kind"])
    if kind is Kind.WEIGHTS:
        return StateObject.weights(data["model"], data["precision"])
    if kind is Kind.KV:
        return StateObject.kv(data["model"], data["session"])
    return StateObject.experts(data["model"])


def location_from_json(data: Mapping[str, Any]) -> Location:
    tier = Tier(data["tier"])
    return Location(tier, data["gpu"] if tier is Tier.GPU else data["node"])


def entry_json(obj: StateObject, loc: Location, nbytes: int) -> dict[str, Any]:
    """One placement entry as the API and the store write it."""
    return {"object": obj.to_json(), "location": loc.to_json(), "bytes": int(nbytes)}


def placement_to_json(placement: Mapping[tuple[StateObject, Location], int]) -> list[dict[str, Any]]:
    """Entries sorted by object then location, so equal placements serialize equally."""
    return [entry_json(obj, loc, nbytes) for (obj, loc), nbytes in sorted(placement.items()) if nbytes > 0]


def placement_from_entries(entries: Iterable[tuple[StateObject, Location, int]]) -> Placement:
    placement: Placement = {}
    for obj, loc, nbytes in entries:
        if nbytes > 0:
            placement[(obj, loc)] = placement.get((obj, loc), 0) + int(nbytes)
    return placement
