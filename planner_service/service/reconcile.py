"""What a node's heartbeat says about the confirmed placement: GPUs that hold less than it records, and
objects its engines report gone. The node's measurements win over what reports said, but one heartbeat
alone is not trusted: its telemetry may have been taken before an operation it reports done finished, so a
finding counts only when the next heartbeat (taken after the first was answered) repeats it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from planner_service.domain.state import Kind, Location, Placement, StateObject, Tier, entry_json
from planner_service.service.inputs import EngineInstanceStateIn, GpuTelemetryIn
from planner_service.wire.enums import EngineState

LOST_TOLERANCE_FRACTION = 0.05
"""How far below the confirmed bytes a GPU's measured use may be before the node counts as having lost
state there, as a fraction of the GPU's capacity: the planner's sizes are estimates of what an engine
allocates (rounded shards, allocator granularity), and the driver's count moves while engines run."""

OFF_GPU_STATES = frozenset({EngineState.STOPPED, EngineState.ASLEEP_DISCARDED, EngineState.ASLEEP_HOST})
"""Engine states in which the instance's model holds nothing on its GPUs (planner_service/wire/enums.py:
a level-1 sleep keeps the weights in host RAM and frees the KV pool, a level-2 sleep and a stop discard
both)."""


@dataclass(frozen=True, slots=True)
class Shortfall:
    """A GPU whose measured use is below what the confirmed placement holds there by more than the tolerance."""

    gpu: str
    confirmed_bytes: int
    used_bytes: int

    @property
    def missing_bytes(self) -> int:
        return self.confirmed_bytes - self.used_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "confirmed_bytes": self.confirmed_bytes,
            "used_bytes": self.used_bytes,
            "missing_bytes": self.missing_bytes,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Shortfall:
        return cls(str(data["gpu"]), int(data["confirmed_bytes"]), int(data["used_bytes"]))


@dataclass(frozen=True, slots=True)
class Gone:
    """A placement entry the node's reported engine states say is not there, and why."""

    object: StateObject
    location: Location
    bytes: int
    why: str

    def key(self) -> str:
        return f"{self.object.label()}@{self.location.label()}"

    def to_json(self) -> dict[str, Any]:
        return entry_json(self.object, self.location, self.bytes) | {"why": self.why}


def gpu_bytes(placement: Placement) -> dict[str, int]:
    """Bytes the placement holds on each GPU."""
    held: dict[str, int] = defaultdict(int)
    for (_, loc), n in placement.items():
        if loc.tier is Tier.GPU:
            held[loc.id] += n
    return held


def shortfalls(
    placement: Placement,
    gpus: Sequence[GpuTelemetryIn],
    capacity: Mapping[str, int],
    leaving: Mapping[str, int] | None = None,
    beyond_pools: Mapping[str, int] | None = None,
) -> list[Shortfall]:
    """The reported GPUs whose measured `used_bytes` is below the confirmed bytes by more than the tolerance
    (`LOST_TOLERANCE_FRACTION` of the GPU's `capacity`) plus what operations in flight are taking off the GPU
    (`leaving`: an engine frees them before its report lands); a GPU reported without `used_bytes` is not
    judged. The confirmed bytes count no KV beyond a running engine's reported pool (`beyond_pools`: the
    engine holds none there)."""
    held = gpu_bytes(placement)
    leaving = leaving or {}
    beyond_pools = beyond_pools or {}
    found = []
    for g in gpus:
        if g.used_bytes is None or g.id not in capacity:
            continue
        confirmed = held.get(g.id, 0) - beyond_pools.get(g.id, 0)
        if confirmed - g.used_bytes > LOST_TOLERANCE_FRACTION * capacity[g.id] + leaving.get(g.id, 0):
            found.append(Shortfall(g.id, confirmed, g.used_bytes))
    return found


def gone(
    placement: Placement,
    node_gpus: Collection[str],
    instances: Sequence[EngineInstanceStateIn],
    moving: Collection[tuple[StateObject, Location]],
) -> list[Gone]:
    """Placement entries on the node's GPUs (`node_gpus`) of a model whose engine the heartbeat reports, on a
    GPU where no reported instance of that model runs: on an engine node a model's bytes are on a GPU only
    inside an engine running there. Weights count at a reported precision only, and experts and KV only where
    no weights of an unreported precision of the model are (those belong to an engine this report says
    nothing about). Entries in `moving` (an operation in flight moves them: the engine is between states) are
    left alone."""
    by_model: dict[str, list[EngineInstanceStateIn]] = defaultdict(list)
    for entry in instances:
        by_model[entry.instance.model].append(entry)
    here = sorted(
        (key, n)
        for key, n in placement.items()
        if n > 0 and key[0].model in by_model and key[1].tier is Tier.GPU and key[1].id in node_gpus
    )
    weights_at: dict[tuple[str, Location], set[str | None]] = defaultdict(set)  # (model, GPU) -> precisions
    for (obj, loc), _ in here:
        if obj.kind is Kind.WEIGHTS:
            weights_at[(obj.model, loc)].add(obj.precision)
    found = []
    for (obj, loc), n in here:
        if (obj, loc) in moving:
            continue
        reported = by_model[obj.model]
        precisions = {e.instance.precision for e in reported}
        if obj.kind is Kind.WEIGHTS:
            if obj.precision not in precisions:
                continue
            reported = [e for e in reported if e.instance.precision == obj.precision]
        elif weights_at[(obj.model, loc)] - precisions:
            continue
        if any(e.state not in OFF_GPU_STATES and loc.id in e.instance.gpus for e in reported):
            continue
        found.append(Gone(obj, loc, n, _why_gone(loc.id, reported)))
    return found


def _why_gone(gpu: str, reported: Sequence[EngineInstanceStateIn]) -> str:
    """The report that puts a model's entry off `gpu`: its instance there in an off-GPU state, or else the
    model's reported instances, none of which is on that GPU."""
    for e in reported:
        if gpu in e.instance.gpus:
            return f"engine instance {e.instance.id} reported {e.state.value}"
    named = ", ".join(f"{e.instance.id} {e.state.value}" for e in reported)
    return f"no reported engine instance holds {gpu} ({named})"
