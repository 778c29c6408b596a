"""Simulated memory and bandwidth: where every byte is, and the transfers moving it.

Memory. Every location (a GPU, a node's host DRAM, a node's NVMe) has a
capacity. `used[loc]` counts the bytes placed there plus the bytes reserved by
transfers still running towards it, so a transfer only starts when its
destination has room for all of its bytes, and `used[loc] <= capacity[loc]`
holds at every instant (checked on every change; `violations` counts breaks
and must stay 0).

Bandwidth. Links are shared resources: each GPU's host->device and
device->host PCIe direction, each node's NVMe read and write. A transfer runs
over one or two links (NVMe -> GPU uses the drive's read side and the GPU's
h2d link; the stages are pipelined through pinned host buffers). Processor
sharing: a transfer's rate is the smallest fair share along its path,

    rate = min over links l on the path of  bandwidth_l / (transfers on l)

so the rates on one link add up to at most its bandwidth. Rates are
recomputed whenever a transfer starts or ends; the finish times follow.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from planner_service.domain.problem import Problem
from planner_service.domain.state import Kind, Location, StateObject, Tier

LinkKey = tuple[str, str]  # ("h2d" | "d2h", gpu) or ("nvme_read" | "nvme_write", node)
DONE_BYTES = 1.0  # a transfer with less than a byte left is finished (float rounding)


@dataclass(eq=False)
class Transfer:
    id: int
    obj: StateObject
    source: Location | None
    dest: Location
    bytes: int
    links: tuple[LinkKey, ...]
    keep_source: bool
    on_done: Callable[[Transfer], None]
    preallocated: bool = False  # the destination bytes were placed before the copy (KV restore)
    remaining: float = 0.0
    rate_bytes_per_s: float = 0.0
    started_at: float = 0.0

    def __post_init__(self) -> None:
        self.remaining = float(self.bytes)


@dataclass
class LinkStats:
    bandwidth_bytes_per_s: float
    active: set[int] = field(default_factory=set)
    peak_rate_bytes_per_s: float = 0.0


class SimCluster:
    """Bytes per (object, location), capacities, and the transfers in flight."""

    def __init__(self, problem: Problem) -> None:
        self.p = problem
        self.capacity: dict[Location, int] = {}
        for gpu in problem.gpus.values():
            self.capacity[Location.gpu(gpu.id)] = gpu.capacity_bytes
        for node in problem.nodes.values():
            self.capacity[Location.host(node.id)] = node.host_bytes
            self.capacity[Location.nvme(node.id)] = node.nvme_bytes
        self.placed: dict[tuple[StateObject, Location], int] = {}
        self.at: dict[Location, set[StateObject]] = defaultdict(set)  # what each location holds
        self.used: dict[Location, int] = defaultdict(int)  # placed + reserved by running transfers
        self.links: dict[LinkKey, LinkStats] = {}
        for gpu in problem.gpus.values():
            self.links[("h2d", gpu.id)] = LinkStats(gpu.h2d_bytes_per_s)
            self.links[("d2h", gpu.id)] = LinkStats(gpu.d2h_bytes_per_s)
        for node in problem.nodes.values():
            self.links[("nvme_read", node.id)] = LinkStats(node.nvme_read_bytes_per_s)
            self.links[("nvme_write", node.id)] = LinkStats(node.nvme_write_bytes_per_s)
        self.transfers: dict[int, Transfer] = {}
        self._ids = itertools.count(1)
        self._clock = 0.0
        self.violations = 0  # capacity or bandwidth breaks; must stay 0
        self.bytes_moved = 0
        self.gpu_bytes = 0  # used bytes over all GPUs (placed + reserved)
        self.peak_gpu_bytes = 0
        self.model_gpu_bytes: dict[str, int] = defaultdict(int)  # placed weights + experts on GPU per model
        self.on_change: Callable[[], None] | None = None  # the engine samples memory here

    # -- memory ------------------------------------------------------------

    def free(self, loc: Location) -> int:
        return self.capacity[loc] - self.used[loc]

    def bytes_of(self, obj: StateObject, loc: Location) -> int:
        return self.placed.get((obj, loc), 0)

    def _use(self, loc: Location, delta: int) -> None:
        self.used[loc] += delta
        if loc.tier is Tier.GPU:
            self.gpu_bytes += delta
            self.peak_gpu_bytes = max(self.peak_gpu_bytes, self.gpu_bytes)
        if self.used[loc] > self.capacity[loc] or self.used[loc] < 0:
            self.violations += 1
        if self.on_change is not None:
            self.on_change()

    def add(self, obj: StateObject, loc: Location, nbytes: int, reserved: bool = False) -> None:
        """Place bytes (already counted in `used` when a transfer reserved them)."""
        if nbytes <= 0:
            return
        self.placed[(obj, loc)] = self.placed.get((obj, loc), 0) + nbytes
        self.at[loc].add(obj)
        if loc.tier is Tier.GPU and obj.kind is not Kind.KV:
            self.model_gpu_bytes[obj.model] += nbytes
        if not reserved:
            self._use(loc, nbytes)
        elif self.on_change is not None:
            self.on_change()

    def remove(self, obj: StateObject, loc: Location, nbytes: int | None = None) -> int:
        """Drop `nbytes` (default all) of an object at a location; returns the bytes freed."""
        have = self.placed.get((obj, loc), 0)
        take = have if nbytes is None else min(have, nbytes)
        if take <= 0:
            return 0
        if take == have:
            del self.placed[(obj, loc)]
            self.at[loc].discard(obj)
        else:
            self.placed[(obj, loc)] = have - take
        if loc.tier is Tier.GPU and obj.kind is not Kind.KV:
            self.model_gpu_bytes[obj.model] -= take
        self._use(loc, -take)
        return take

    def hold(self, model: str, loc: Location, nbytes: int) -> None:
        """Bytes a model's engine holds at `loc` that are no state object (a sleeping engine's CUDA context)."""
        self.model_gpu_bytes[model] += nbytes
        self._use(loc, nbytes)

    def release(self, model: str, loc: Location, nbytes: int) -> None:
        self.model_gpu_bytes[model] -= nbytes
        self._use(loc, -nbytes)

    def objects_at(self, loc: Location) -> Iterator[StateObject]:
        return iter(sorted(self.at[loc]))

    def node_bytes(self, obj: StateObject, node: str, tier: Tier) -> int:
        if tier is Tier.GPU:
            return sum(self.placed.get((obj, Location.gpu(g)), 0) for g in self.p.nodes[node].gpus)
        return self.placed.get((obj, Location(tier, node)), 0)

    def complete_below(self, obj: StateObject, node: str) -> Tier | None:
        """Fastest tier under GPU holding a complete copy of a weights/experts object on the node."""
        size = self.full_size(obj)
        for tier in (Tier.HOST, Tier.NVME):
            if size > 0 and self.placed.get((obj, Location(tier, node)), 0) >= size:
                return tier
        return None

    def full_size(self, obj: StateObject) -> int:
        model = self.p.models[obj.model]
        if obj.kind is Kind.WEIGHTS and obj.precision is not None:  # (weights always name their precision)
            return model.weights_bytes[obj.precision]
        if obj.kind is Kind.EXPERTS:
            return model.experts_bytes
        raise ValueError("KV has no fixed size")

    # -- bandwidth ---------------------------------------------------------

    def path(self, source: Location | None, dest: Location) -> tuple[LinkKey, ...]:
        """The links a copy from `source` to `dest` crosses (both on one node)."""
        if source is None:
            raise ValueError("a copy needs a source")
        links: list[LinkKey] = []
        if source.tier is Tier.NVME:
            links.append(("nvme_read", source.id))
        if source.tier is Tier.GPU:
            links.append(("d2h", source.id))
        if dest.tier is Tier.GPU:
            links.append(("h2d", dest.id))
        if dest.tier is Tier.NVME:
            links.append(("nvme_write", dest.id))
        return tuple(links)

    def can_start(self, dest: Location, nbytes: int) -> bool:
        return self.free(dest) >= nbytes

    def start(
        self,
        now: float,
        obj: StateObject,
        source: Location,
        dest: Location,
        nbytes: int,
        keep_source: bool,
        on_done: Callable[[Transfer], None],
        preallocated: bool = False,
    ) -> Transfer:
        """Reserve the destination bytes (unless placed already) and start sharing the path's links."""
        if not preallocated and not self.can_start(dest, nbytes):
            raise RuntimeError(f"no room for {nbytes} bytes of {obj.label()} at {dest.label()}")
        self.advance(now)
        transfer = Transfer(
            next(self._ids), obj, source, dest, int(nbytes), self.path(source, dest), keep_source, on_done, preallocated
        )
        transfer.started_at = now
        if not preallocated:
            self._use(dest, transfer.bytes)
        self.transfers[transfer.id] = transfer
        for link in transfer.links:
            self.links[link].active.add(transfer.id)
        self._rerate()
        return transfer

    def advance(self, now: float) -> None:
        """Move every running transfer forward to `now` at its current rate."""
        dt = now - self._clock
        if dt > 0:
            for t in self.transfers.values():
                t.remaining -= t.rate_bytes_per_s * dt
        self._clock = max(self._clock, now)

    def _rerate(self) -> None:
        for t in self.transfers.values():
            t.rate_bytes_per_s = min(self.links[l].bandwidth_bytes_per_s / len(self.links[l].active) for l in t.links)
        for link in self.links.values():
            if link.active:
                total = sum(self.transfers[i].rate_bytes_per_s for i in link.active)
                link.peak_rate_bytes_per_s = max(link.peak_rate_bytes_per_s, total)
                if total > link.bandwidth_bytes_per_s * (1 + 1e-9):
                    self.violations += 1

    def next_finish(self) -> float | None:
        """When the earliest running transfer finishes at the current rates."""
        best = None
        for t in self.transfers.values():
            at = self._clock + max(0.0, t.remaining) / t.rate_bytes_per_s
            if best is None or at < best:
                best = at
        return best

    def finish_due(self, now: float) -> list[Transfer]:
        """Complete the transfers done by `now`: place their bytes, free moved sources."""
        self.advance(now)
        done = [t for t in self.transfers.values() if t.remaining <= max(DONE_BYTES, t.rate_bytes_per_s * 1e-7)]
        for t in sorted(done, key=lambda t: t.id):
            del self.transfers[t.id]
            for link in t.links:
                self.links[link].active.discard(t.id)
            if not t.preallocated:
                self.add(t.obj, t.dest, t.bytes, reserved=True)
            if t.source is not None and not t.keep_source:
                self.remove(t.obj, t.source, t.bytes)
            self.bytes_moved += t.bytes
        if done:
            self._rerate()
        return done

    def incoming(self, obj: StateObject, loc: Location) -> int:
        return sum(t.bytes for t in self.transfers.values() if t.obj == obj and t.dest == loc)

    def reading(self, obj: StateObject, loc: Location) -> bool:
        return any(t.obj == obj and t.source == loc for t in self.transfers.values())
