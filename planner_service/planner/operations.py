"""Turn the confirmed placement into a target placement, one safe operation at a time.

Per object and node, bytes that leave a fast tier while a slower tier gains
are a `demote` (the copy moves down); bytes a tier gains otherwise are a
`promote` from the node's fastest complete copy below it (`keep_source`: the
source stays) or, for KV only, are created by prefill (`from` is null); bytes
left over are a `drop`. Moves never leave a node.

`depends_on` makes every order that respects it safe, because node agents
run operations in parallel as soon as their dependencies are done:
  * a copy's source is freed only after every operation reading it;
  * a location gains bytes only after every operation freeing bytes there
    (unless that free itself waits on the gain: then the target leaves room;
    or the location is host RAM or NVMe with room for all it gains beside all
    it holds now: then no free there needs to come first);
  * a complete copy is dropped only after the other complete copy it relies on exists;
  * on an engine's GPU a session's KV lands only after its model's weights there (the engine computes it).

Only the entries that differ between the two placements are visited (the
checkpoints that stay on NVMe are never walked), a free that already
waits on a gain is found by one walk from the gain over the operations
waiting on it, not by a search per (gain, free) pair, and dependencies are
kept only for the few operations that have some: once nothing is left for
the rest to wait on, they are ordered by one sort, not one heap step each.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import filterfalse
from operator import itemgetter
from typing import Any

from planner_service.domain.problem import Problem
from planner_service.domain.scenario import Capability, Slo
from planner_service.domain.state import TIER_RANK, Kind, Location, Placement, StateObject, Tier
from planner_service.planner import costs
from planner_service.planner.residency import UNKNOWN, ResidencyIndex, Serving, copy_placement
from planner_service.wire.enums import Action as Action  # noqa: PLC0414 -- re-exported: it was defined here
from planner_service.wire.enums import Priority as Priority  # noqa: PLC0414 -- re-exported: it was defined here
from planner_service.wire.enums import Transition
from planner_service.wire.operations import EngineStep

PRIORITY_RANK = {Priority.BLOCKING: 0, Priority.INTERACTIVE: 1, Priority.BACKGROUND: 2, Priority.PREFETCH: 3}
SLO_PRIORITY = {
    Slo.BLOCKING: Priority.BLOCKING,
    Slo.INTERACTIVE: Priority.INTERACTIVE,
    Slo.BACKGROUND: Priority.BACKGROUND,
}
_URGENCY = {slo: rank for rank, slo in enumerate(Slo)}  # most urgent first


# Enum members read once per operation, bound here: on Python 3.11 each `Enum.MEMBER` lookup goes through
# EnumType.__getattr__ and costs about ten global reads.
_GPU, _HOST, _NVME = Tier.GPU, Tier.HOST, Tier.NVME
_WEIGHTS, _EXPERTS, _KV = Kind.WEIGHTS, Kind.EXPERTS, Kind.KV
_KV_OFFLOAD, _WEIGHTS_OFFLOAD = Capability.KV_OFFLOAD, Capability.WEIGHTS_OFFLOAD
_PROMOTE, _DEMOTE, _DROP = Action.PROMOTE, Action.DEMOTE, Action.DROP
_PREFETCH, _BACKGROUND = Priority.PREFETCH, Priority.BACKGROUND
_RESTART = Transition.RESTART.value
# the steps that bring an instance up: its KV pool and CUDA context take room on its GPUs with the call
_UP = frozenset(t.value for t in (Transition.START, Transition.WAKE, Transition.RESTART))
_KEY = itemgetter(0)  # of a dict item: sorting items by it skips a level of tuple comparison


@dataclass(slots=True)
class Operation:
    id: str
    action: Action
    object: StateObject
    source: Location | None
    dest: Location | None
    bytes: int
    keep_source: bool
    priority: Priority = Priority.BACKGROUND
    depends_on: list[str] = field(default_factory=list)
    estimated_seconds: float = 0.0
    node: str = ""  # every move stays inside one node
    # what it buys: the words, or (purpose, waiting SLO) to say them from; read it as `reason`
    why: str | tuple[str | None, Slo | None] = ""
    # on an engine node (vLLM, SGLang): the engine transition that carries the move out (engine_plan.py)
    engine: EngineStep | None = None

    @property
    def reason(self) -> str:
        """What the operation buys, in words; formatted on first read (most plans are only executed)."""
        if not isinstance(self.why, str):
            self.why = _words(self, *self.why)
        return self.why

    def frees(self) -> Location | None:
        """The location this operation takes bytes from, if any."""
        return None if self.keep_source else self.source

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "action": self.action.value,
            "object": self.object.to_json(),
            "from": self.source.to_json() if self.source else None,
            "to": self.dest.to_json() if self.dest else None,
            "bytes": int(self.bytes),
            "keep_source": self.keep_source,
            "priority": self.priority.value,
            "depends_on": list(self.depends_on),
            "estimated_seconds": round(self.estimated_seconds, 6),
            "reason": self.reason,
            "node": self.node,
            "engine": None if self.engine is None else self.engine.model_dump(mode="json"),
        }


def _words(op: Operation, purpose: str | None, waiting: Slo | None) -> str:
    """An operation's reason: what it moves, and what the planner wanted the object for (`purpose`) or
    the SLO of the request in flight that needs it (`waiting`)."""
    gib = op.bytes / 2**30
    obj = op.object.label()
    if op.action is _PROMOTE:
        assert op.dest is not None
        if op.source is None:
            base = f"prefill {gib:.2f} GiB of {obj} on {op.dest.label()}"
        else:
            base = f"bring {gib:.2f} GiB of {obj} to {op.dest.label()}"
        if waiting is not None:
            slo = waiting.value
            return f"{base}: {'an' if slo[0] in 'aeiou' else 'a'} {slo} request is waiting for it"
        return f"{base}: {purpose}" if purpose else f"{base}: predicted to be needed"
    assert op.source is not None
    if op.action is _DEMOTE:
        assert op.dest is not None
        return f"free {gib:.2f} GiB on {op.source.label()}; keep {obj} on {op.dest.label()} for a cheaper way back"
    return f"free {gib:.2f} GiB on {op.source.label()}; {obj} is worth less than the room it takes"


def apply_operation(placement: Placement, op: Operation) -> None:
    """Apply one operation to a placement in place (what a node agent's `done` confirms)."""
    if op.dest is not None:
        key = (op.object, op.dest)
        placement[key] = placement.get(key, 0) + op.bytes
    free_source(placement, op)


def free_source(placement: Placement, op: Operation) -> None:
    """Take what `op` moves off its source, in place (nothing for a copy that keeps its source)."""
    if op.source is not None and not op.keep_source:
        key = (op.object, op.source)
        left = placement.get(key, 0) - op.bytes
        if left > 0:
            placement[key] = left
        else:
            placement.pop(key, None)


def apply_operations(placement: Mapping[tuple[StateObject, Location], int], ops: Sequence[Operation]) -> Placement:
    out = dict(placement)
    for op in ops:
        apply_operation(out, op)
    return out


class _Builder:
    def __init__(
        self,
        problem: Problem,
        target: Mapping[tuple[StateObject, Location], int],
        reasons: Mapping[StateObject, str],
        now: ResidencyIndex,
        then: Mapping[str, Serving],
        no_backup: Collection[tuple[str, str]] = (),
        kv_prefill_only: Collection[tuple[str, str]] = (),
    ):
        self.p = problem
        self.no_backup = no_backup
        self.target = target
        self.reasons = reasons
        self.now = now
        self.ops: list[Operation] = []
        # set by `link`: position in `ops` -> the positions it waits on (only operations that wait on some:
        # most wait on none), and the reverse
        self._deps: dict[int, set[int]] = {}
        self._waiting: dict[int, set[int]] = {}
        # model -> the most urgent SLO of its requests in flight (what its weights and routed experts serve)
        self.model_slo: dict[str, Slo] = {}
        self.active_slo = self._active_slo()
        self.stale_kv = self._stale_kv_models(then)
        # (KV, node) wherever KV sits below the GPUs now (there a location's id is its node) and the node's
        # engine can load it back (`kv_prefill_only`: (model, node) pairs whose engines compute KV anew)
        self._kv_below_gpu = {
            (obj, loc.id)
            for obj, loc in now.kv_entries
            if loc.tier is not _GPU and (obj.model, loc.id) not in kv_prefill_only
        }
        # remembered per builder: thousands of operations share objects, GPUs and sources
        self._prefill_seconds: dict[tuple[str, str], float] = {}  # (model, gpu) -> seconds per byte of KV
        self._sources: dict[tuple[StateObject, str, Tier], Location | None] = {}

    def _stale_kv_models(self, then: Mapping[str, Serving]) -> set[str]:
        """Models served at another precision in the target: their sessions' KV must be computed again."""
        return {m for m, now in self.now.serving.items() if m in then and then[m].precision != now.precision}

    def _active_slo(self) -> dict[StateObject, Slo]:
        """Objects a request in flight needs on GPU, with the most urgent SLO among those requests
        (its own for a session's KV, the most urgent of the model's for its weights); fills `model_slo`."""
        out: dict[StateObject, Slo] = {}
        model_slo = self.model_slo
        for s in self.p.sessions.values():
            if not s.active:
                continue
            out[StateObject.kv(s.model, s.id)] = s.slo
            slo = model_slo.get(s.model)
            if slo is None or _URGENCY[s.slo] < _URGENCY[slo]:
                model_slo[s.model] = s.slo
        for model_id, slo in model_slo.items():
            for precision in self.p.models[model_id].precisions:
                out[StateObject.weights(model_id, precision)] = slo
        return out

    def _new(
        self,
        action: Action,
        obj: StateObject,
        source: Location | None,
        dest: Location | None,
        nbytes: int,
        keep: bool,
        node: str,
    ) -> Operation:
        nbytes = int(nbytes)
        op = Operation(
            "", action, obj, source, dest, nbytes, keep,  # named in `ordered`
            self._priority(action, obj, dest), [], self._seconds(action, obj, source, dest, nbytes, node), node,
            (self.reasons.get(obj), self.active_slo.get(obj)),
        )  # fmt: skip
        self.ops.append(op)
        return op

    def _prefill(self, obj: StateObject, node: str, gpus: list[Location]) -> None:
        """KV computed by prefill on each GPU of its group (`_new` for PROMOTE from nowhere, in one pass)."""
        slo = self.active_slo.get(obj)
        priority = SLO_PRIORITY[slo] if slo is not None else _PREFETCH
        why = (self.reasons.get(obj), slo)
        target, ops = self.target, self.ops
        for dest in gpus:  # (the rate is called on self, not bound to a local: compiled, that is a direct call)
            nbytes = target[(obj, dest)]
            seconds = nbytes * self._prefill_seconds_per_byte(obj.model, dest.id)
            ops.append(Operation("", _PROMOTE, obj, None, dest, nbytes, True, priority, [], seconds, node, why))

    # -- diff -------------------------------------------------------------

    def _changed(self) -> dict[tuple[StateObject, str], list[Location]]:
        """(object, node) -> the locations whose bytes differ between the confirmed placement and the target."""
        before, after = copy_placement(self.p.residency), self.target
        # entries only the target holds (a set of a dict's keys, less a dict's, reuses the hashes the dicts
        # keep), then the confirmed entries the target changes or lacks (placements hold no zero entries)
        keys = after.keys() - before
        keys.update(key for key, nbytes in before.items() if after.get(key) != nbytes)
        # stale KV that stays on a GPU is recomputed there all the same
        keys.update(key for key in self.now.on_gpus if key[0].kind is _KV and key[0].model in self.stale_kv)
        gpus = self.p.gpus
        changed: dict[tuple[StateObject, str], list[Location]] = defaultdict(list)
        for obj, loc in keys:
            changed[(obj, gpus[loc.id].node if loc.tier is _GPU else loc.id)].append(loc)
        return changed

    def diff(self) -> None:
        residency, target, stale_kv, kv_below_gpu = self.p.residency, self.target, self.stale_kv, self._kv_below_gpu
        for (obj, node), locs in sorted(self._changed().items(), key=_KEY):  # (keys are unique: pairs sort alike)
            stale = obj.kind is _KV and obj.model in stale_kv
            if obj.kind is _KV and (obj, node) not in kv_below_gpu and not stale:
                if all(loc.tier is _GPU and (obj, loc) not in residency for loc in locs):
                    self._prefill(obj, node, sorted(locs))  # the common case: KV new to the node
                    continue
            gains: dict[Location, int] = {}
            losses: dict[Location, int] = {}
            for loc in sorted(locs):
                before = residency.get((obj, loc), 0)
                after = target.get((obj, loc), 0)
                if stale and loc.tier is _GPU and before and after:
                    # KV of the old precision cannot serve the new weights: free it, prefill anew
                    gains[loc], losses[loc] = after, before
                    continue
                if after > before:
                    gains[loc] = after - before
                elif after < before:
                    losses[loc] = before - after
            if gains and losses:
                self._moves_down(obj, node, gains, losses)
            if gains:
                self._copies_up(obj, node, gains, stale)
            for loc, nbytes in losses.items():  # in location order, as `locs` was walked
                if nbytes > 0:
                    self._new(_DROP, obj, loc, None, nbytes, False, node)

    def _moves_down(self, obj: StateObject, node: str, gains: dict[Location, int], losses: dict[Location, int]) -> None:
        # an engine that does not sleep at level 1 keeps no host copy of its GPU weights: the host copy is
        # read from NVMe instead (a read-ahead of the checkpoint)
        no_backup = (obj.model, node) in self.no_backup
        for dest in sorted(gains, key=lambda l: (-TIER_RANK[l.tier], l)):
            for src in sorted(losses, key=lambda l: (TIER_RANK[l.tier], l)):
                if TIER_RANK[src.tier] >= TIER_RANK[dest.tier] or gains[dest] == 0 or losses[src] == 0:
                    continue
                if no_backup and src.tier is _GPU and dest.tier is _HOST:
                    continue
                nbytes = min(gains[dest], losses[src])
                self._new(_DEMOTE, obj, src, dest, nbytes, False, node)
                gains[dest] -= nbytes
                losses[src] -= nbytes

    def _copies_up(self, obj: StateObject, node: str, gains: dict[Location, int], stale: bool = False) -> None:
        for dest, nbytes in sorted(gains.items(), key=lambda kv: (TIER_RANK[kv[0].tier], kv[0])):
            if nbytes <= 0:
                continue
            if (stale or (obj, node) not in self._kv_below_gpu) and obj.kind is _KV and dest.tier is _GPU:
                # KV with no copy below the GPUs to restore from (or of a stale precision): prefill it there
                self._new(_PROMOTE, obj, None, dest, nbytes, True, node)
                continue
            source = self._complete_source_for(obj, node, dest)
            if source is not None:
                action = _PROMOTE if TIER_RANK[source.tier] > TIER_RANK[dest.tier] else _DEMOTE
                self._new(action, obj, source, dest, nbytes, True, node)
                continue
            if obj.kind is not _KV:
                raise ValueError(f"no complete copy of {obj.label()} on node {node} to fill {dest.label()} from")
            # KV: restore what a lower tier holds, prefill the rest on the GPU
            for below, have in self._kv_below(obj, node):
                if nbytes and TIER_RANK[below.tier] > TIER_RANK[dest.tier]:
                    part = min(have, nbytes)
                    self._new(_PROMOTE, obj, below, dest, part, True, node)
                    nbytes -= part
            if nbytes and dest.tier is _GPU:
                self._new(_PROMOTE, obj, None, dest, nbytes, True, node)
            elif nbytes:
                raise ValueError(f"no source for {nbytes} bytes of {obj.label()} at {dest.label()}")

    def _kv_below(self, obj: StateObject, node: str) -> list[tuple[Location, int]]:
        """The node's host DRAM and NVMe copies of a session's KV it can restore from, with their bytes."""
        if _KV_OFFLOAD not in self.p.nodes[node].capabilities:
            return []
        below = (Location.host(node), Location.nvme(node))
        return [(loc, self.p.residency[(obj, loc)]) for loc in below if self.p.residency.get((obj, loc), 0)]

    def _complete_source_for(self, obj: StateObject, node: str, dest: Location) -> Location | None:
        """The node's fastest complete copy below GPU, on another tier than `dest`, that its engines can read.

        (GPU shards are never read as a source for another tier's full copy.)
        """
        key = (obj, node, dest.tier)
        source = self._sources.get(key, UNKNOWN)
        if source is UNKNOWN:
            source = self._sources[key] = self._find_complete_source(obj, node, dest.tier)
        return source

    def _find_complete_source(self, obj: StateObject, node: str, dest_tier: Tier) -> Location | None:
        caps = self.p.nodes[node].capabilities
        if obj.kind is _KV and _KV_OFFLOAD not in caps:
            return None
        for tier in (_HOST, _NVME):
            if tier is dest_tier:
                continue
            if tier is _HOST and obj.kind is _WEIGHTS and _WEIGHTS_OFFLOAD not in caps:
                continue
            if self.now.complete(obj, node, tier):
                return Location(tier, node)
        return None

    # -- dependencies -------------------------------------------------------

    def link(self) -> None:
        """Set `depends_on` (as positions in `self.ops` until `ordered` names them) and inherit priorities."""
        ops = self.ops
        deps: dict[int, set[int]] = defaultdict(set)
        readers: dict[tuple[StateObject, Location], list[int]] = defaultdict(list)
        frees_at: dict[Location, list[int]] = defaultdict(list)
        adds_at: dict[Location, list[int]] = defaultdict(list)
        for i, op in enumerate(ops):
            if op.source is not None:
                if op.keep_source:
                    readers[(op.object, op.source)].append(i)
                else:
                    frees_at[op.source].append(i)
            if op.dest is not None:
                adds_at[op.dest].append(i)
        for frees in frees_at.values():
            for i in frees:
                op = ops[i]
                source = op.source
                assert source is not None  # ops in frees_at have a source
                # a source is freed only after its readers are done
                after = [r for r in readers.get((op.object, source), ()) if r != i]
                # a complete copy is dropped only once another complete copy on the node exists
                if op.action is _DROP and op.object.kind is not _KV:
                    for other in self._complete_copies_in_target(op.object, self.p.node_of(source)):
                        if other != source:
                            after.extend(a for a in adds_at.get(other, ()) if ops[a].object == op.object)
                if after:
                    deps[i].update(after)
        # on an engine's GPU a session's KV comes after its model's weights there: the engine they bring up
        # computes it (prefilled on an engine not up yet, it is reported gone and planned again, each replan)
        for loc, adds in adds_at.items():
            if loc.tier is not _GPU:
                continue
            weights: dict[str, list[int]] = defaultdict(list)
            for i in adds:
                if ops[i].object.kind is _WEIGHTS:
                    weights[ops[i].object.model].append(i)
            for i in adds:
                obj = ops[i].object
                if obj.kind is _KV and obj.model in weights and self._on_engine(obj.model, loc):
                    deps[i].update(weights[obj.model])
        # a location gains bytes only after the frees there, except a free that itself waits on the gain, and
        # host RAM or NVMe with room for every gain beside all it holds now: a gain there waits on no free
        # (waiting on a host copy's drop that a wake makes, a demote off a GPU let the wake fill that GPU first)
        waiting: dict[int, set[int]] = defaultdict(set)  # op -> the ops that depend on it directly
        for i, ds in deps.items():
            for d in ds:
                waiting[d].add(i)
        for loc, adds in adds_at.items():
            freed = frees_at.get(loc)
            if not freed or self._room_for_all(loc, [ops[i] for i in adds]):
                continue
            for add in adds:
                after_add = _downstream(waiting, add)
                first = [f for f in freed if f != add and f not in after_add]
                if first:
                    deps[add].update(first)
                for f in first:
                    waiting[f].add(add)
        self._deps, self._waiting = dict(deps), waiting
        self._inherit_priority()

    def _room_for_all(self, loc: Location, adds: Sequence[Operation]) -> bool:
        """Whether `loc`, host RAM or NVMe, holds what it holds now and every gain `adds` bring it, none freed
        (a GPU also holds engines' pools and contexts that no move carries: `share_step_dependencies`)."""
        if loc.tier is _GPU:
            return False
        return self.now.used.get(loc, 0) + sum(op.bytes for op in adds) <= self.p.capacity_of(loc)

    def _on_engine(self, model_id: str, loc: Location) -> bool:
        """Whether the model runs through an engine on the node of `loc`."""
        return self.p.nodes[self.p.node_of(loc)].engine_kind(model_id) is not None

    def _complete_copies_in_target(self, obj: StateObject, node: str) -> list[Location]:
        size = self.p.size_of(obj)
        return [Location(t, node) for t in (_HOST, _NVME) if self.target.get((obj, Location(t, node)), 0) >= size]

    def _inherit_priority(self) -> None:
        inherit_priority(self.ops, self._deps)

    def ordered(self) -> list[Operation]:
        """Kahn's topological order, most urgent first among the ready; ids set to "op-N" in that order."""
        return kahn_order(self.ops, self._deps, self._waiting)

    # -- annotations --------------------------------------------------------

    def _priority(self, action: Action, obj: StateObject, dest: Location | None) -> Priority:
        if dest is not None and dest.tier is _GPU:
            slo = self.active_slo.get(obj)
            if slo is None and obj.kind is _EXPERTS:
                slo = self.model_slo.get(obj.model)
            return SLO_PRIORITY[slo] if slo is not None else _PREFETCH
        if action is _PROMOTE:
            return _PREFETCH
        return _BACKGROUND

    def _seconds(
        self,
        action: Action,
        obj: StateObject,
        source: Location | None,
        dest: Location | None,
        nbytes: int,
        node_id: str,
    ) -> float:
        if action is _DROP:
            return 0.0
        node = self.p.nodes[node_id]
        assert dest is not None  # only drops have none
        if action is _PROMOTE:
            if dest.tier is _GPU:
                if source is None:  # KV made by prefill
                    return nbytes * self._prefill_seconds_per_byte(obj.model, dest.id)
                return costs.even_copy_seconds(nbytes, (self.p.gpus[dest.id],), source.tier, node)
            return nbytes / node.nvme_read_bytes_per_s
        assert source is not None  # a demotion or drop
        gpu = self.p.gpus[source.id] if source.tier is _GPU else None
        return costs.write_down_seconds(nbytes, gpu, dest.tier, node)

    def _prefill_seconds_per_byte(self, model_id: str, gpu_id: str) -> float:
        """Seconds to compute one byte of the model's KV by prefill on one GPU."""
        key = (model_id, gpu_id)
        rate = self._prefill_seconds.get(key)
        if rate is None:
            model = self.p.models[model_id]
            per_token = costs.prefill_seconds_per_token(model, [self.p.gpus[gpu_id]], self.p.constants)
            rate = self._prefill_seconds[key] = per_token / max(1, model.kv_bytes_per_token)
        return rate


def inherit_priority(ops: Sequence[Operation], deps: Mapping[int, Collection[int]]) -> None:
    """What an urgent operation waits on is as urgent as it is (`deps`: position -> the positions it waits on)."""
    for i in sorted(deps, key=lambda i: (PRIORITY_RANK[ops[i].priority], i)):
        priority = ops[i].priority
        rank = PRIORITY_RANK[priority]
        stack = list(deps[i])
        while stack:
            j = stack.pop()
            if PRIORITY_RANK[ops[j].priority] > rank:
                ops[j].priority = priority
                stack.extend(deps.get(j, ()))


def kahn_order(ops: list[Operation], deps: Mapping[int, set[int]], children: Mapping[int, set[int]]) -> list[Operation]:
    """Kahn's topological order of `ops` (`deps`: position -> the positions it waits on; `children`: the
    reverse), most urgent first among the ready; ids set to "op-N" in that order, `depends_on` filled."""
    n = len(ops)
    # an operation's place in the ready heap: rank * n + position, one int that orders as the pair
    # (rank, position) does and compares several times faster (sorting the heap's rest is most of the work)
    entry = [PRIORITY_RANK[op.priority] * n + i for i, op in enumerate(ops)]
    position = n.__rmod__  # of an entry
    pending = {i: len(ds) for i, ds in deps.items()}
    ready = list(map(entry.__getitem__, filterfalse(pending.__contains__, range(n))))  # waiting on nothing
    heapq.heapify(ready)
    sequence: list[int] = []  # positions in `ops`, in order
    awaited = set(children)  # operations others wait on, not yet in the order
    while ready and awaited:
        i = position(heapq.heappop(ready))
        sequence.append(i)
        if i in awaited:
            awaited.remove(i)
            for child in children[i]:
                pending[child] -= 1
                if not pending[child]:
                    heapq.heappush(ready, entry[child])
    # nothing waits on the rest (most operations): they come in the order the heap would pop them
    sequence.extend(map(position, sorted(ready)))
    if len(sequence) != len(ops):
        raise ValueError("operation dependencies form a cycle")
    order = list(map(ops.__getitem__, sequence))
    for k, op in enumerate(order, 1):
        op.id = f"op-{k}"  # an f-string formats in about half the time `str.format` takes
    place = dict(zip(sequence, range(n), strict=True))  # position in `ops` -> in the order
    for i, ds in deps.items():
        ops[i].depends_on = [ops[d].id for d in sorted(ds, key=place.__getitem__)]
    return order


# Tags the moves of one restart that free its old instance's GPU bytes as a stop of that instance and the rest
# as a start of the new one, in place, prices them and answers the moves the halves need besides (a stop
# frees its whole shard and a start loads its whole shard on a GPU both groups share); None (nothing
# changed) where the engine cannot be stopped and started (engine_plan.py).
Unpair = Callable[[list[Operation], list[Operation]], list[Operation] | None]


def share_step_dependencies(ops: list[Operation], unpair: Unpair | None = None) -> list[Operation]:
    """Every move of one engine step waits on what any of them waits on, and `ops` in an order that respects it.

    A step is one call for the whole instance, made on the first of its moves an agent runs (the moves of the
    other GPUs of the group find it done): a start on four GPUs whose first GPU must be freed first would
    otherwise run on the move of the second GPU, which waits on nothing, and find the first GPU full. A wait
    is not shared where it would close a circle (the dependency waits on the move itself, as a free that
    waits on the gain does).

    Where that leaves a restart with a move that does not wait on all its step waits on, no order makes the
    one call safe: two engines that trade GPUs each restart onto GPUs the other holds, and whichever call
    comes first starts on a full GPU. `unpair` turns such a restart into a stop and a start, as an operator
    would: the stop frees the old GPUs at once and waits on nothing the start waits on, every move of the
    start waits on every move of the stop, and the waits are shared again from the plan's own (one restart
    fewer each round).

    A step that brings an instance up (a start, wake or restart) takes room for its KV pool and CUDA context
    on every GPU of its group with that one call, whichever of its moves makes it, even one that moves
    nothing there: each of its moves waits on every free of those GPUs that does not wait on the step.

    `ops` is returned as it is when nothing changes; else in Kahn's order again, ids renumbered."""
    groups = _step_groups(ops)
    position = {op.id: i for i, op in enumerate(ops)}
    base: dict[int, set[int]] = {i: {position[d] for d in op.depends_on} for i, op in enumerate(ops) if op.depends_on}
    waits_for_room = _up_steps_wait_for_frees(ops, groups, base)
    if not waits_for_room and not any(
        len(members) > 1 and any(ops[m].depends_on for m in members) for members in groups.values()
    ):
        return ops
    unpaired = False
    while True:
        deps = {i: set(ds) for i, ds in base.items()}
        waiting = _reverse(deps)
        changed, cut = _share(groups, deps, waiting)
        split = None
        for key in cut:
            if key[2] == _RESTART and (split := _unpaired(ops, groups[key], base, unpair)) is not None:
                break
        if split is None:
            break
        stop, start = split
        for t in start:
            base.setdefault(t, set()).update(stop)
        groups = _step_groups(ops)
        unpaired = True
    if not (changed or unpaired or waits_for_room):
        return ops
    if unpaired:
        inherit_priority(ops, deps)  # a stop that an urgent start waits on is as urgent
    return kahn_order(ops, deps, waiting)


def _up_steps_wait_for_frees(
    ops: Sequence[Operation], groups: Mapping[tuple[str, str, str], list[int]], deps: dict[int, set[int]]
) -> bool:
    """Make each move of a step that brings an instance up wait on the frees of its group's GPUs that do not
    wait on the step, in place (`deps`: positions); whether any wait was added."""
    frees_at: dict[str, list[int]] = defaultdict(list)
    for i, op in enumerate(ops):
        if _frees_gpu(op):
            assert op.source is not None  # a free of a GPU
            frees_at[op.source.id].append(i)
    waiting = _reverse(deps)
    changed = False
    for key, members in groups.items():
        step = ops[members[0]].engine
        if key[2] not in _UP or step is None:
            continue
        after_step = set(members).union(*(_downstream(waiting, m) for m in members))
        first = {f for g in step.instance.gpus for f in frees_at.get(g, ()) if f not in after_step}
        for m in members:
            for f in first - deps.get(m, set()):
                deps.setdefault(m, set()).add(f)
                waiting[f].add(m)
                changed = True
    return changed


def _unpaired(
    ops: list[Operation], members: list[int], base: Mapping[int, set[int]], unpair: Unpair | None
) -> tuple[list[int], list[int]] | None:
    """The restart's moves as (stop, start) positions once `unpair` has re-tagged them, with the moves it
    adds appended to `ops`; None where they do not divide (no free or no gain on the GPUs), where the start's
    waits on the stop would close a circle, or where the engine cannot be stopped and started."""
    stop = [m for m in members if _frees_gpu(ops[m])]
    start = [m for m in members if not _frees_gpu(ops[m])]
    if not stop or not start or unpair is None:
        return None
    waiting = _reverse(base)
    stops = set(stop)
    if any(stops & _downstream(waiting, t) for t in start):
        return None
    added = unpair([ops[m] for m in stop], [ops[m] for m in start])
    if added is None:
        return None
    for op in added:
        (stop if _frees_gpu(op) else start).append(len(ops))
        ops.append(op)
    return stop, start


def _frees_gpu(op: Operation) -> bool:
    return op.source is not None and op.source.tier is _GPU and not op.keep_source


def _reverse(deps: Mapping[int, set[int]]) -> dict[int, set[int]]:
    """op -> the ops that wait on it directly."""
    waiting: dict[int, set[int]] = defaultdict(set)
    for i, ds in deps.items():
        for d in ds:
            waiting[d].add(i)
    return waiting


def _step_groups(ops: Sequence[Operation]) -> dict[tuple[str, str, str], list[int]]:
    """(node, instance, transition) -> the positions of the moves of that engine step."""
    groups: dict[tuple[str, str, str], list[int]] = defaultdict(list)
    for i, op in enumerate(ops):
        if op.engine is not None:
            groups[(op.node, op.engine.instance.id, op.engine.transition.value)].append(i)
    return groups


def _share(
    groups: Mapping[tuple[str, str, str], list[int]], deps: dict[int, set[int]], waiting: dict[int, set[int]]
) -> tuple[bool, list[tuple[str, str, str]]]:
    """Share each step's waits among its moves, in place: whether any wait was added, and the steps one of
    whose moves was left without a wait of the step (it would have closed a circle)."""
    changed = False
    cut: list[tuple[str, str, str]] = []
    for key, members in groups.items():
        if len(members) < 2:
            continue
        union = {d for m in members for d in deps.get(m, ())} - set(members)
        if not union:
            continue
        left_out = False
        for m in members:
            after_m = _downstream(waiting, m)  # waiting on one of these, m would close a circle
            missing = union - deps.get(m, set())
            left_out = left_out or bool(missing & after_m)
            for d in missing - after_m:
                deps.setdefault(m, set()).add(d)
                waiting[d].add(m)
                changed = True
        if left_out:
            cut.append(key)
    return changed, cut


def _downstream(waiting: Mapping[int, set[int]], start: int) -> set[int]:
    """Every operation that waits on `start`, directly or through others."""
    seen: set[int] = set()
    stack = [start]
    while stack:
        for nxt in waiting.get(stack.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def build_operations(
    problem: Problem,
    target: Mapping[tuple[StateObject, Location], int],
    reasons: Mapping[StateObject, str] | None = None,
    now: ResidencyIndex | None = None,
    then: Mapping[str, Serving] | None = None,
    no_backup: Collection[tuple[str, str]] = (),
    kv_prefill_only: Collection[tuple[str, str]] = (),
) -> list[Operation]:
    """The operations that turn `problem.residency` into `target`, in a topological order of `depends_on`.

    `now` indexes the confirmed placement and `then` says who serves each model in the target, when the
    caller has them already. `no_backup`: (model, node) pairs whose GPU copies may not move to host RAM;
    `kv_prefill_only`: (model, node) pairs whose engines compute a session's KV anew, never load it back.
    """
    now = now or ResidencyIndex.build(problem, problem.residency)
    then = then if then is not None else ResidencyIndex.serving_in(problem, target)
    builder = _Builder(problem, target, reasons or {}, now, then, no_backup, kv_prefill_only)
    builder.diff()
    builder.link()
    return builder.ordered()


def transfer_bytes(ops: Sequence[Operation]) -> int:
    return sum(op.bytes for op in ops if op.action is not _DROP)


def total_seconds(ops: Sequence[Operation]) -> float:
    return math.fsum(op.estimated_seconds for op in ops)
