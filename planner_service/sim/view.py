"""What a policy may read of the simulated cluster: a read-only view of the simulator's state.

Policies decide from this view and act through the `Executor` (`executor.py`); nothing here changes
the cluster. Mappings are read-only proxies of the simulator's own, so a policy sees every change at
once and copies nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol

from planner_service.domain.engines import EngineState
from planner_service.domain.problem import Gpu, Problem
from planner_service.domain.scenario import CostConstants, Scenario
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.planner import costs
from planner_service.planner.greedy import split_evenly
from planner_service.sim.state import ModelState, SessionState, SimRequest, SimState
from planner_service.sim.trace import TraceRecord

if TYPE_CHECKING:
    from planner_service.sim.cluster import Transfer


class EvictionOrder(Protocol):
    """The policy's eviction order on a GPU, lowest first (None: never evict)."""

    def victim_key(self, sim: SimView, obj: StateObject, loc: Location) -> tuple | None: ...


class ClusterReader(Protocol):
    """The reading side of `SimCluster`: bytes per object and location, capacities, transfers in flight."""

    @property
    def placed(self) -> Mapping[tuple[StateObject, Location], int]: ...

    @property
    def transfers(self) -> Mapping[int, Transfer]: ...

    @property
    def capacity(self) -> Mapping[Location, int]: ...

    def free(self, loc: Location) -> int: ...

    def bytes_of(self, obj: StateObject, loc: Location) -> int: ...

    def objects_at(self, loc: Location) -> Iterator[StateObject]: ...

    def node_bytes(self, obj: StateObject, node: str, tier: Tier) -> int: ...

    def complete_below(self, obj: StateObject, node: str) -> Tier | None: ...

    def full_size(self, obj: StateObject) -> int: ...

    def reading(self, obj: StateObject, loc: Location) -> bool: ...


class SimView:
    """The simulator's state as a policy sees it: the clock, the cluster, requests, sessions, engines."""

    __slots__ = (
        "_rules",
        "_sim",
        "cluster",
        "demand",
        "gpu_tokens",
        "host_tokens",
        "last_used",
        "models",
        "running",
        "sessions",
    )

    def __init__(self, sim: SimState, rules: EvictionOrder) -> None:
        self._sim = sim
        self._rules = rules
        self.cluster: ClusterReader = sim.cluster
        self.models: Mapping[str, ModelState] = MappingProxyType(sim.models)  # the engine serving each model
        self.sessions: Mapping[str, SessionState] = MappingProxyType(sim.sessions)
        self.demand: Mapping[str, int] = MappingProxyType(sim.demand)  # waiting + running requests per model
        self.running: Mapping[str, int] = MappingProxyType(sim.running)  # running requests per model
        self.last_used: Mapping[StateObject, float] = MappingProxyType(sim.last_used)
        self.gpu_tokens: Mapping[StateObject, int] = MappingProxyType(sim.gpu_tokens)  # KV tokens valid on GPU
        self.host_tokens: Mapping[StateObject, int] = MappingProxyType(sim.host_tokens)  # KV tokens in host DRAM

    @property
    def now(self) -> float:
        return self._sim.now

    @property
    def problem(self) -> Problem:
        return self._sim.problem

    @property
    def c(self) -> CostConstants:
        return self._sim.c

    @property
    def scenario(self) -> Scenario:
        return self._sim.scenario

    @property
    def records(self) -> Sequence[TraceRecord]:
        return self._sim.records

    @property
    def waiting(self) -> Sequence[SimRequest]:
        """Requests admitted and not started, oldest first."""
        return self._sim.waiting  # typed read-only; not copied, it is read on every dispatch pass

    @property
    def needs_kv_room(self) -> AbstractSet[str]:
        """Models whose last group could not hold a waiting request's KV."""
        return self._sim.needs_kv_room

    def sleeping_engines(self) -> dict[tuple[str, str], tuple[EngineState, tuple[str, ...]]]:
        """(node, model) -> the state and GPU group of each sleeping engine instance: what a node agent's
        heartbeat reports of them (`Problem.observed_engines`)."""
        asleep = self._sim.engines.asleep
        return {(e.node, e.instance.model): (e.state, e.instance.gpus) for e in (asleep[k] for k in sorted(asleep))}

    def kv_footprint(self, req: SimRequest) -> int:
        return self._sim.kv_footprint(req)

    def largest_waiting_kv(self, model_id: str) -> int:
        return self._sim.largest_waiting_kv(model_id)

    def pinned(self, obj: StateObject, force: bool = False) -> bool:
        """What running requests need, weights being loaded, (unless forced) weights a waiting request wants,
        and the weights of an engine that can neither sleep nor stop (an adopted one without sleep mode)."""
        if obj.kind is Kind.KV:
            return obj in self._sim.running_kv
        state = self.models.get(obj.model)
        if obj.kind is Kind.WEIGHTS and state is not None and state.precision == obj.precision:
            busy = self._sim.running.get(obj.model) if force else self._sim.demand.get(obj.model)
            return state.status != "ready" or bool(busy) or not state.can_leave
        return False

    def spare_weight_bytes(self, obj: StateObject, loc: Location) -> int:
        """Bytes of `obj` (weights) at `loc` its model's engine does not read: beyond its shard there, all of them
        off its GPUs; 0 while an earlier engine of the model still runs requests (they read the old copy)."""
        state = self.models.get(obj.model)
        have = self.cluster.bytes_of(obj, loc)
        if state is None or state.precision != obj.precision:
            return have
        if any(model == obj.model and epoch != state.epoch for model, epoch in self._sim.running_on):
            return 0
        ids = [g.id for g in state.gpus]
        if loc.id not in ids:
            return have
        shard = split_evenly(self._sim.problem.models[obj.model].weights_bytes[obj.precision], len(ids))[
            ids.index(loc.id)
        ]
        return max(0, have - shard)

    def evictable(self, loc: Location, protect: Iterable[str] = ()) -> list[tuple[tuple, StateObject]]:
        protect = set(protect)
        out = []
        for obj in self.cluster.objects_at(loc):
            if (
                obj.model in protect and obj.kind is Kind.WEIGHTS or self.pinned(obj) or self.experts_fixed(obj, loc)
            ):  # experts are a cache: they give way, unless their engine fixed them at launch
                continue
            key = self._rules.victim_key(self, obj, loc)
            if key is not None:
                out.append((key, obj))
        out.sort()
        return out

    def experts_fixed(self, obj: StateObject, loc: Location) -> bool:
        """Whether `obj` is a MoE's experts on a GPU whose running engine fixed its expert share at launch
        (vLLM, SGLang: changing it is a restart; only `local` moves experts at run time)."""
        if obj.kind is not Kind.EXPERTS or loc.tier is not Tier.GPU:
            return False
        state = self._sim.models.get(obj.model)
        node = self._sim.problem.gpus[loc.id].node
        return state is not None and state.node == node and not self._sim.engines.runtime_experts(node, obj.model)

    def stoppable_contexts(self, gpu_id: str, evicted: Collection[str]) -> int:
        """Bytes of CUDA context on a GPU that the running engines of the `evicted` models free once their
        weights go: each leaves its GPUs, and a managed one's context, kept as its residue where it sleeps,
        is stopped for the room (`Executor.make_room`)."""
        book, out = self._sim.engines, 0
        for model_id in evicted:
            state = self.models.get(model_id)
            if state is not None and any(g.id == gpu_id for g in state.gpus) and book.may_stop(state.instance):
                out += book.context_bytes(state.node, model_id)
        return out

    def stoppable_residue(self, gpu_id: str) -> int:
        """Bytes that stopping the managed engines sleeping on a GPU would free there."""
        book = self._sim.engines
        if not book.asleep:
            return 0
        return sum(book.residue_bytes() for e in book.sleeping_on(gpu_id) if book.may_stop(e.instance))

    @staticmethod
    def _holds(group: tuple[Gpu, ...], room: dict[str, int], nbytes: int, kv_bytes: int, context: int) -> bool:
        """Whether every GPU of the group has room for its even shard of the weights and the KV, and the
        engine's CUDA context."""
        shard = math.ceil(nbytes / len(group)) + math.ceil(kv_bytes / len(group)) + context
        return all(room[g.id] >= shard for g in group)

    def bring_up_bytes(self, model_id: str, node_id: str, precision: str, group: tuple[Gpu, ...], gpu_id: str) -> int:
        """Bytes bringing the model up on `group` takes on one of its GPUs beside the weights' shard: the
        engine's CUDA context, less the residue of its own sleeping instance there that the wake keeps as
        that context or the stop frees (`EngineBook.frees_on_bring_up`)."""
        book = self._sim.engines
        freed = book.frees_on_bring_up(node_id, model_id, precision, group)
        return book.context_bytes(node_id, model_id) - (self.own_residue(model_id, gpu_id) if freed else 0)

    def own_residue(self, model_id: str, gpu_id: str) -> int:
        """Bytes the model's own sleeping engine holds on a GPU (what its wake there frees)."""
        book = self._sim.engines
        return sum(book.residue_bytes() for e in book.sleeping_on(gpu_id) if e.instance.model == model_id)

    def choose_group(
        self,
        model_id: str,
        allowed: Callable[[str], bool] = lambda g: True,
        protect: Iterable[str] = (),
        kv_bytes: int = 0,
    ) -> tuple[str, str, tuple[Gpu, ...]] | None:
        """Where an on-demand load would go: (node, precision, gpus), the least eviction first, then the fastest.

        The group must hold the weights plus `kv_bytes` (a waiting request's KV), split evenly.
        Preferred precision first; a degraded one only when the preferred fits nowhere. Per node the
        candidates are the fewest GPUs that hold it and the group of the model's instance sleeping there
        (a wake: its fixed part is seconds, a cold start's tens of seconds, `engines.bring_up_fixed_seconds`).
        """
        model = self._sim.problem.models[model_id]
        protect = {*protect, model_id}
        for precision in model.precisions:
            obj = StateObject.weights(model_id, precision)
            nbytes = model.weights_bytes[precision]
            best = None
            for node_id in sorted(self._sim.problem.nodes):
                node = self._sim.problem.nodes[node_id]
                source = self.cluster.complete_below(obj, node_id)
                if source is None or not node.can_serve(model_id):
                    continue
                fixed = node.engine_gpus.get(model_id)  # its declared engine runs on these GPUs only
                context = self._sim.engines.context_bytes(node_id, model_id)
                room = {}
                for g in fixed or node.gpus:
                    if allowed(g):
                        loc = Location.gpu(g)
                        victims = [o for _, o in self.evictable(loc, protect)]
                        room[g] = (
                            self.cluster.free(loc)
                            + sum(self.cluster.bytes_of(o, loc) for o in victims)
                            + self.stoppable_residue(g)
                            + self.stoppable_contexts(g, {o.model for o in victims if o.kind is Kind.WEIGHTS})
                        )
                if fixed and len(room) < len(fixed):
                    continue
                gpus = sorted((self._sim.problem.gpus[g] for g in room), key=lambda g: (-room[g.id], g.id))
                groups = []
                for k in range(len(fixed) if fixed else 1, len(gpus) + 1):
                    group = tuple(sorted(gpus[:k], key=lambda g: g.id))
                    if k >= max(model.min_gpus.get(g.type, 1) for g in group) and self._holds(
                        group, room, nbytes, kv_bytes, context
                    ):
                        groups.append(group)
                        break
                book = self._sim.engines
                sleeping = book.asleep.get((model_id, node_id))
                if sleeping is not None and sleeping.instance.precision == precision:
                    asleep_on = sleeping.instance.gpus
                    if all(g in room for g in asleep_on):
                        own = 0 if book.may_stop(sleeping.instance) else book.residue_bytes()  # its wake frees it
                        waking = {g: room[g] + own for g in asleep_on}
                        group = tuple(sorted((self._sim.problem.gpus[g] for g in asleep_on), key=lambda g: g.id))
                        if group not in groups and self._holds(group, waking, nbytes, kv_bytes, context):
                            groups.append(group)
                for group in groups:
                    k = len(group)
                    shard = math.ceil(nbytes / k) + math.ceil(kv_bytes / k)
                    evict = sum(max(0, shard - self.cluster.free(Location.gpu(g.id))) for g in group)
                    seconds = costs.even_copy_seconds(
                        math.ceil(nbytes / k), group, source, node
                    ) + book.start_fixed_seconds(node_id, model_id, precision, group)
                    key = (evict > 0, seconds, evict, node_id)
                    if best is None or key < best[0]:
                        best = (key, (node_id, precision, group))
            if best is not None:
                return best[1]
        return None
