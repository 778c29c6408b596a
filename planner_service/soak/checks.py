"""The physical invariants of a confirmed state, and a replay of reported operations to compare it with.

A confirmed placement must fit: every location holds at most its capacity (a GPU's usable HBM, a node's host
DRAM and NVMe), and no location holds more of an object than its full size (weights and experts from the
model catalog; a session's KV from its context, which only grows while the session lives). The replay applies
the `done` operations the service answered for, in the order it applied them, onto the seeded placement,
checking both invariants at every step: a move applied twice while its first effect stands lands bytes an
object already holds in full, which is what the replay counts as double-applied.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from planner_service.wire.cluster import ClusterOut, ModelOut
from planner_service.wire.enums import Kind, Tier
from planner_service.wire.operations import Operation
from planner_service.wire.sessions import SessionOut
from planner_service.wire.state import Location, PlacementEntry, StateObject

Key = tuple[str, str]  # (the object's key, the location's label)


def key_of(obj: StateObject, loc: Location) -> Key:
    return obj.key(), loc.label()


@dataclass
class Placement:
    """Bytes per (object, location), with the typed object and location behind each key."""

    held: dict[Key, int] = field(default_factory=dict)
    objects: dict[Key, tuple[StateObject, Location]] = field(default_factory=dict)

    @classmethod
    def of(cls, entries: Iterable[PlacementEntry]) -> Placement:
        p = cls()
        for e in entries:
            k = key_of(e.object, e.location)
            p.held[k] = p.held.get(k, 0) + e.bytes
            p.objects[k] = (e.object, e.location)
        return p

    def copy(self) -> Placement:
        return Placement(dict(self.held), dict(self.objects))

    def add(self, obj: StateObject, loc: Location, nbytes: int) -> None:
        k = key_of(obj, loc)
        self.held[k] = self.held.get(k, 0) + nbytes
        self.objects[k] = (obj, loc)

    def take(self, obj: StateObject, loc: Location, nbytes: int) -> int:
        """Remove `nbytes`; what was held before."""
        k = key_of(obj, loc)
        before = self.held.get(k, 0)
        if before - nbytes > 0:
            self.held[k] = before - nbytes
        else:
            self.held.pop(k, None)
            self.objects.pop(k, None)
        return before

    def used(self) -> dict[str, int]:
        """Bytes held per location label."""
        out: dict[str, int] = defaultdict(int)
        for (_, loc), n in self.held.items():
            out[loc] += n
        return dict(out)

    def differences(self, other: Placement, limit: int = 10) -> list[str]:
        """Where two placements differ (at most `limit` lines)."""
        lines = []
        for k in sorted(set(self.held) | set(other.held)):
            a, b = self.held.get(k, 0), other.held.get(k, 0)
            if a != b:
                lines.append(f"{k[0]} at {k[1]}: {a} B here, {b} B there")
        return lines[:limit] + ([f"... {len(lines) - limit} more"] if len(lines) > limit else [])


@dataclass(frozen=True)
class Limits:
    """What the cluster and the catalog allow: capacity per location label, full size per object."""

    capacity: Mapping[str, int]
    weights_bytes: Mapping[tuple[str, str], int]  # (model, precision) -> bytes
    experts_bytes: Mapping[str, int]
    kv_bytes_per_token: Mapping[str, int]
    context_tokens: Mapping[str, int]  # session -> its context now (an upper bound on any of its KV)

    @classmethod
    def of(cls, cluster: ClusterOut, models: list[ModelOut], sessions: list[SessionOut]) -> Limits:
        capacity: dict[str, int] = {}
        for node in cluster.nodes:
            capacity[Location.at(Tier.HOST, node.id).label()] = node.host_dram_bytes
            capacity[Location.at(Tier.NVME, node.id).label()] = node.nvme_bytes
            for gpu in node.gpus:
                capacity[Location.at(Tier.GPU, gpu.id).label()] = gpu.capacity_bytes
        return cls(
            capacity=capacity,
            weights_bytes={(m.id, p): n for m in models for p, n in m.resolved.weights_bytes.items()},
            experts_bytes={m.id: m.resolved.experts_bytes for m in models},
            kv_bytes_per_token={m.id: m.resolved.kv_bytes_per_token for m in models},
            context_tokens={s.id: s.context_tokens for s in sessions},
        )

    def full_size(self, obj: StateObject) -> int | None:
        """The object's full size; None where it is not known (a model or session the service forgot)."""
        if obj.kind is Kind.WEIGHTS:
            return self.weights_bytes.get((obj.model, obj.precision or ""))
        if obj.kind is Kind.EXPERTS:
            return self.experts_bytes.get(obj.model)
        tokens, per_token = self.context_tokens.get(obj.session or ""), self.kv_bytes_per_token.get(obj.model)
        return None if tokens is None or per_token is None else tokens * per_token


def violations(p: Placement, limits: Limits, *, keys: Iterable[Key] | None = None) -> list[str]:
    """Every broken invariant of a placement: locations over capacity, objects over their full size (only at
    `keys` and their locations, where given)."""
    out = []
    wanted = None if keys is None else set(keys)
    locations = None if wanted is None else {loc for _, loc in wanted}
    for loc, used in sorted(p.used().items()):
        cap = limits.capacity.get(loc)
        if (locations is None or loc in locations) and cap is not None and used > cap:
            out.append(f"{loc} holds {used} B, over its capacity {cap} B")
    for k, n in sorted(p.held.items()):
        if wanted is not None and k not in wanted:
            continue
        obj, _ = p.objects[k]
        size = limits.full_size(obj)
        if size is not None and n > size:
            out.append(f"{k[1]} holds {n} B of {obj.label()}, over its full size {size} B")
    return out


def gpu_view_violations(cluster: ClusterOut) -> list[str]:
    """GPUs whose confirmed use (as `GET /v1/cluster` computes it) is over their usable capacity."""
    return [
        f"gpu:{g.id} used {g.used_bytes} B of {g.capacity_bytes} B"
        for node in cluster.nodes
        for g in node.gpus
        if g.used_bytes > g.capacity_bytes
    ]


@dataclass
class ReplayResult:
    placement: Placement
    applied: int = 0
    violations: list[str] = field(default_factory=list)  # invariants broken at some step
    double_applied: list[str] = field(default_factory=list)  # operations landing bytes already held in full
    source_short: list[str] = field(default_factory=list)  # operations giving bytes their source did not hold


def replay(seed: Placement, operations: Iterable[Operation], limits: Limits) -> ReplayResult:
    """Apply done operations in order (a promotion with `keep_source` copies, `from: null` is prefill, `to:
    null` drops), checking the invariants at the locations each one touches."""
    result = ReplayResult(seed.copy())
    p = result.placement
    for op in operations:
        touched = []
        if op.dest is not None:
            before = p.held.get(key_of(op.object, op.dest), 0)
            size = limits.full_size(op.object)
            if op.object.kind is not Kind.KV and size is not None and before >= size and op.bytes > 0:
                result.double_applied.append(f"{op.id}: {op.dest.label()} already held all {size} B of it")
            p.add(op.object, op.dest, op.bytes)
            touched.append(key_of(op.object, op.dest))
        if op.source is not None and not op.keep_source:
            held = p.take(op.object, op.source, op.bytes)
            if held < op.bytes:
                result.source_short.append(f"{op.id}: {op.source.label()} held {held} B, gave {op.bytes} B")
        result.applied += 1
        result.violations += [f"after {op.id}: {v}" for v in violations(p, limits, keys=touched)]
    return result
