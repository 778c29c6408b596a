"""Where the confirmed placement will be once the operations in flight land, held within the physical limits.

A replan starts from that landing place: planning from the confirmed
placement alone would repeat the moves in flight. The operations in flight
were planned to fit, but a plan made before a cluster edit, a node's
reconcile or a report recorded as a conflict may no longer fit beside what
is confirmed now, and a state over a capacity cannot be planned at all.
Refusing to plan until they land would stop the controller for as long as
they run, and longer when their reports come back as conflicts. So each
operation in flight lands here only as far as it fits: its frees count
whole (they only make room), its bytes count up to the room left at its
destination and the object's full size, and one that lands less is
*capped*. The plan made over a capped operation sees its destination full,
and its new operations that fill that location wait for the capped one
(`Queues.install`): when it lands, its report is checked against the
confirmed state like any other, and the next replan sees where it left the
cluster.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from planner_service.domain.problem import Problem
from planner_service.domain.state import Kind, Location, Placement, StateObject, Tier
from planner_service.planner.operations import free_source
from planner_service.service.records import OpRecord
from planner_service.wire.enums import EngineState, Transition

EngineKey = tuple[str, str]  # (node, model)
_UP = frozenset((Transition.START, Transition.WAKE, Transition.RESTART))
_ASLEEP = {Transition.SLEEP_LEVEL_1: EngineState.ASLEEP_HOST, Transition.SLEEP_LEVEL_2: EngineState.ASLEEP_DISCARDED}


@dataclass(frozen=True, slots=True)
class Landing:
    placement: Placement  # the confirmed placement with the operations in flight landed, each as far as it fits
    capped: frozenset[str]  # the operations in flight that land less than they move there


def land(placement: Placement, inflight: Sequence[OpRecord], sizes: Problem) -> Landing:
    """The landing place of `inflight` (in their plans' order) on `placement`, with `sizes`' capacities."""
    out = dict(placement)
    for r in inflight:  # frees first: every one of them makes room once they have all landed
        free_source(out, r.op)
    used: dict[Location, int] = defaultdict(int)
    for (_, loc), nbytes in out.items():
        used[loc] += nbytes
    capped: set[str] = set()
    for r in inflight:
        op = r.op
        if op.dest is None or op.bytes <= 0:
            continue
        key = (op.object, op.dest)
        nbytes = min(op.bytes, _room(sizes, op.dest, used[op.dest]), _size_left(sizes, out, key))
        if nbytes < op.bytes:
            capped.add(r.id)
        if nbytes > 0:
            out[key] = out.get(key, 0) + nbytes
            used[op.dest] += nbytes
    return Landing(out, frozenset(capped))


def _room(sizes: Problem, loc: Location, used: int) -> int:
    """Bytes left at `loc` (no limit at a location the live problem no longer has: it is not planned)."""
    known = loc.id in sizes.gpus if loc.tier is Tier.GPU else loc.id in sizes.nodes
    return max(0, sizes.capacity_of(loc) - used) if known else 2**63


def _size_left(sizes: Problem, placement: Placement, key: tuple[StateObject, Location]) -> int:
    """Bytes of the object that `key`'s location may still gain before it holds the full size."""
    obj = key[0]
    known = obj.model in sizes.models and (obj.kind is not Kind.KV or obj.session in sizes.sessions)
    return max(0, sizes.size_of(obj) - placement.get(key, 0)) if known else 2**63


@dataclass(frozen=True, slots=True)
class LandedEngines:
    """What the nodes report of their engines, with the engine steps in flight landed (`land_engines`)."""

    observed: dict[EngineKey, tuple[EngineState, tuple[str, ...]]]  # the sleeping ones: state and GPU group
    expert_fractions: dict[EngineKey, float]  # the sleeping MoE ones: the GPU expert share they launched with
    pools: dict[EngineKey, int]  # the running and sleeping ones: their KV pool per GPU


def land_engines(engines: LandedEngines, inflight: Sequence[OpRecord]) -> LandedEngines:
    """The engines as the steps in flight leave them (in their plans' order), beside `land`'s placement: a
    wake in flight lands the weights on the GPUs while the heartbeat still reports the engine asleep, and a
    plan from that mix steps an engine from a state it is not in (a wake of a running engine, moves of its
    weights with no step, a sleep refused as leaving from a state other than running)."""
    observed, fractions, pools = dict(engines.observed), dict(engines.expert_fractions), dict(engines.pools)
    for r in inflight:
        step = r.op.engine
        if step is None:
            continue
        key = (r.op.node, step.instance.model)
        if step.transition in _UP:  # running: its weights on the GPUs say so
            observed.pop(key, None)
            fractions.pop(key, None)
            if step.instance.kv_pool_bytes_per_gpu:
                pools[key] = step.instance.kv_pool_bytes_per_gpu
        elif step.transition in _ASLEEP:
            observed[key] = (_ASLEEP[step.transition], tuple(step.instance.gpus))
            fractions[key] = step.instance.gpu_expert_fraction  # (a dense model's holds no expert bytes)
        elif step.transition is Transition.STOP:
            observed.pop(key, None)
            fractions.pop(key, None)
            pools.pop(key, None)
    return LandedEngines(observed, fractions, pools)
