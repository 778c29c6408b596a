"""The greedy planner: the online default.

It rebuilds what the GPUs should hold, then settles the lower tiers:

1. **Serve active requests.** Models with a request in flight each get one
   node's GPUs. Their nodes and precisions are chosen together (`joint.py`):
   each (node, precision) is priced on the empty GPUs by the model's
   *estimated marginal objective* (`_group_cost`: load time for move_weight
   and the waiting requests; what readying their KV costs there, restored
   from the node's lower tiers or re-prefilled, and the SLO violations of
   those that wait past their target (`_kv_cost`); re-prefill of the
   predicted requests' history on the group's summed FLOP/s, its attention
   included (`costs.prefill_seconds`; linear alone, the estimate was a third
   of what a 61,000-token history costs DeepSeek-V3 or GLM-4.5-Air on an
   A100), less what the
   KV the node holds saves them, and the violations of those whose
   re-prefill alone passes their target; the degraded-precision cost of a
   less preferred precision), a node holding several is priced with its MoE
   models sharing its room for experts (the decode slowdown at the best
   expert fractions that room allows, on each group's summed PCIe
   bandwidth, and the predicted re-prefills' streaming of the experts
   left off GPU: `_expert_terms`), and a local search moves and swaps models
   between options (or trades two like nodes' models) while the sum falls,
   then steps out of that local optimum once, and a budgeted branch and
   bound looks for a lower sum over every assignment (rotations of three
   models). Served one at a time (most urgent SLO, then largest), the first
   models would take the best nodes: DeepSeek-V3, whose experts gain little
   per GiB, a node GLM-4.5-Air's experts would fill. The dense models
   without a request in flight join that choice, as ones that may stay cold:
   kept warm, each saves its predicted requests a cold load and re-prefills
   their history on the group's FLOP/s (`_warm_value`), but only room a node
   keeps free holds it, and the small models in flight would otherwise spread
   over every node that could (and take the fastest cards from the idle
   models whose re-prefills gain most there). So do the MoE models without a
   request in flight, whose experts compete for the room of the nodes they
   would share. (What each of these steps bought against the MILP:
   docs/studies/gap.md.)
   Where the choice keeps an idle model warm, its weights are placed right
   after the models in flight. Then, in that order, each takes its best group on its node
   (`_best_group`; per node the widest group that fits and the fewest-GPU
   one are priced, staying put or resharding on the current node included),
   or on any node if that one has no room left after all. Their sessions'
   KV follows onto the same GPUs, water-filled across users so that no
   user's sessions starve another user's.
2. **Spend the rest by value per byte.** Candidates are the weights of
   other models, KV of sessions on served models, and chunks of a MoE's hot
   experts; each is valued by the objective it saves (`objective.py`) minus
   the price of the bytes (and, for weights, the expert room they take from a
   MoE on their node), and placed from the densest down while it pays
   (lazily re-priced when weights land on the same node). Expert chunks go
   only where the node has a complete copy below its GPUs to load them from
   (else at most what its GPUs hold now), spread over the node's cards. An
   engine MoE's chunk that then finds no room takes the place of the last
   chunks other engine MoEs placed on its cards where they are worth less
   (`_trade_for`: filled by value per byte, a large chunk can come too late).
3. **Demote by tiers.** What leaves the GPUs goes to host DRAM if it is worth
   the room there, else to NVMe or is dropped when a lower copy exists (KV
   may be dropped; the last complete copy of weights or experts on a node
   never is). Host DRAM is filled with likely next models from NVMe.

On engine nodes (vLLM, SGLang; `engine_plan.py`) the greedy plans only what the engines can reach: an
adopted engine, which only its owner starts or relaunches, runs as it is or not at all there (its group
and precision are pinned; one that cannot leave its GPUs is placed first), the CUDA context it would keep
asleep is held on its GPUs, and a model that stays on its running engine keeps the sessions' KV in that
engine's fixed pool (the engine frees no one request's KV), so that room is never given to another model;
a running MoE engine keeps its GPU expert share as launched, on its group's GPUs and beside them, and
where the node choice keeps the model on its node at its precision that room is held from the start, so
that no model served before it takes it. The active sessions' new KV joins a pool that stays, its LRU evicting
idle sessions' KV for it (`_evict_for_active`), and a stay whose pool cannot take them is priced with their
wait (`_pool_overflow`). The joint choice prices such a stay with its launched pool whole, and the engine's
GPUs are held until its model is placed (`_hold_staying`). An engine MoE's group on a node is the one whose
cards keep the most room for its equal-share experts, and the joint choice caps its experts at that room
less its cards' share of what the node's other models take (`_group_experts`, `joint.Option.expert_cards`),
each card losing what the fullest fixed card holds; a node where a running engine stays on some of its
cards, or a model on a narrow group of a node without engines, fits only what its other cards hold beside it,
model by model in the order they are placed, a MoE at its priced width (`_fixed_cards`, `joint.spread_fits`),
and such a narrow stay's cards are held too (`_narrow_stay_held`), while a model the choice prices off its
narrow group leaves it (`_narrow_on`); an idle model kept warm through an engine is priced with its minimum
pool; and a model whose chosen node cannot hold its weights and active KV after all goes to a node that can.
Where the choice keeps a model on fewer than half of a node's cards that the models beside it want, the greedy
plans a second time with that model free to leave them and keeps the plan with the lower objective
(`plan_greedy`). (What each bought: docs/studies/gap.md, "Closing the gap on engine nodes", "The cards beside a
model that stays on a narrow group" and "A model kept on a few of a node's cards the others want".)

The result is a target placement; `operations.py` turns it into moves.

Speed (`statebudget bench plan`): the predicted demand is one array
[models x sessions] (`objective.Demand`); a search for a model's GPU group
tries one node per look (nodes whose GPUs, free bytes and links match give
the same options, so the first by id stands for all; a node serving a MoE is
tried only when no node of its look serves none) plus the few nodes with a
copy in host DRAM, and past 2 * NODE_SHORTLIST candidates only the tightest
and roomiest few; the joint choice prices each model's options once (one
node per look, copied to the others) and each set of options on a node
once; each node's free room and GPUs-by-free-bytes are kept up to date as
bytes are taken rather than recomputed per candidate; a MoE's expert curve
has one cached shape per (model, node) (nodes alike share it), scaled by
the group's PCIe bandwidth, and MoE models sharing a node have one curve of
running totals per set (a room is then one bisection; the joint choice
reads the same cache); reasons are formatted only for offers that are
placed; the checkpoints on NVMe, most of any placement, are looked up in
place and copied without re-hashing, never walked one by one.
The residency index and demand built here are handed to
`make_plan`, so operations and the evaluator do not build them again.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import operator
from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from planner_service.domain.engines import EngineState, tensor_parallel_ok
from planner_service.domain.problem import Gpu, ModelSpec, Node, Problem, Session
from planner_service.domain.scenario import Capability, Slo
from planner_service.domain.state import Kind, Location, Placement, StateObject, Tier
from planner_service.domain.units import GIB
from planner_service.planner import costs, engine_costs, joint
from planner_service.planner.engine_holdings import (
    kept_contexts,
    launched_experts,
    launched_pools,
    min_pool_bytes_per_gpu,
    pooled_kv,
)
from planner_service.planner.engine_instances import (
    ENGINE_CONSTANTS,
    ENGINE_NODE_KINDS,
    can_leave,
    confirmed_states,
    engine_of,
    pinned_instances,
)
from planner_service.planner.engine_targets import engine_target
from planner_service.planner.errors import PlanningError
from planner_service.planner.lateness import Lateness
from planner_service.planner.objective import ColdLoad, Demand, cold_load, evaluate, expert_share, kv_ready
from planner_service.planner.residency import UNKNOWN, ResidencyIndex, copy_placement

SLO_RANK = {Slo.BLOCKING: 0, Slo.INTERACTIVE: 1, Slo.BACKGROUND: 2}
_ALL_ON_GPU = (1.0, False)  # the expert share the greedy's estimates of predicted re-prefills take (`_prefill_rates`)
EXPERT_CHUNKS = 16  # granularity of partial expert residency the greedy considers
_BY_ID = operator.attrgetter("id")
_H2D = operator.attrgetter("h2d_bytes_per_s")
_COST_KEY = operator.itemgetter(0)
_OFFER_BYTES, _OFFER_CHANGE = operator.itemgetter(3), operator.itemgetter(4)  # of `_ExpertTerms.offers`
# bound once: on Python 3.11 an `Enum.MEMBER` lookup costs about ten global reads
_GPU, _HOST, _NVME, _KV, _WEIGHTS = Tier.GPU, Tier.HOST, Tier.NVME, Kind.KV, Kind.WEIGHTS
_CONTEXT = ENGINE_CONSTANTS.context_bytes_per_gpu  # an engine instance's CUDA context, per GPU of its group
_KV_OFFLOAD, _WEIGHTS_OFFLOAD, _PARTIAL_EXPERTS = (
    Capability.KV_OFFLOAD,
    Capability.WEIGHTS_OFFLOAD,
    Capability.PARTIAL_EXPERTS,
)
_NO_SESSIONS: frozenset[str] = frozenset()
NODE_SHORTLIST = 4  # past 2x this many candidate nodes, a group search prices the tightest and roomiest this many each


_CostKey = tuple[float, int, int, str, float]  # (cost, precision rank, slack, node, load seconds): see `_group_options`
_GroupOption = tuple[_CostKey, str, tuple[Gpu, ...]]  # (cost key, precision, GPUs); the key: see `_best_group`
_GpuSpec = tuple[str, float, float, float, float]  # (type, bf16 FLOP/s, HBM, host->GPU, GPU->host bytes/s)
# (model, positions of its engine's GPUs, the precision it is pinned to or ""), by model
_EngineShape = tuple[tuple[str, tuple[int, ...], str], ...]
_Pinned = Mapping[tuple[str, str], tuple[str, tuple[str, ...]] | None]  # see `engine_instances.pinned_instances`
_Look = tuple[tuple[float, tuple[_GpuSpec, ...], _EngineShape], tuple[int, ...]]  # see `_GpuBook`
_Why = tuple[str, tuple[float, ...]]  # (template, the numbers it formats): see `_words`
# `spend`'s offers: (value, bytes, kind, payload), the payload's shape set by its kind (see `spend`)
_Push = Callable[[float, int, str, tuple[Any, ...]], None]


@dataclass(frozen=True, slots=True)
class Group:
    node: str
    precision: str
    gpus: tuple[Gpu, ...]


@dataclass
class TargetPlan:
    """What the greedy decided: the target placement plus what it could not do and why."""

    placement: Placement
    groups: dict[str, Group]
    unserved: dict[str, str]  # session -> the constraint that kept its model off GPU
    reasons: dict[StateObject, str] = field(default_factory=dict)
    # what it was planned from, for `make_plan` to reuse: the confirmed placement's index and the demand
    now: ResidencyIndex | None = None
    demand: Demand | None = None


def _tightest_group(
    gpus: list[Gpu], free: list[int], k: int, model: ModelSpec, nbytes: int, per_gpu: int = 0
) -> tuple[tuple[Gpu, ...], int] | None:
    """The tightest `k` of a node's GPUs (`gpus` sorted by `free` bytes) that each hold an even shard of `nbytes`
    and `per_gpu` more (an engine's CUDA context), in id order, with their free bytes together; None if there
    are fewer or the model needs more GPUs there."""
    share = math.ceil(nbytes / k) + per_gpu
    start = bisect.bisect_left(free, share)
    if len(gpus) - start < k:
        return None
    group = tuple(sorted(gpus[start : start + k], key=_BY_ID))
    if model.min_gpus and k < max(model.min_gpus.get(g.type, 1) for g in group):
        return None
    return group, sum(free[start : start + k])


def _roomiest_group(
    gpus: list[Gpu], free: list[int], widths: Sequence[int], model: ModelSpec, nbytes: int, per_gpu: int = 0
) -> tuple[tuple[Gpu, ...], int] | None:
    """Of the roomiest `k` GPUs for each width in `widths` (`gpus` sorted by `free` bytes), the group that keeps
    the most room beside an even shard of `nbytes` and `per_gpu` more on every card (k times its least free
    card's room), in id order, with their free bytes together; None where no width holds the shards."""
    best: tuple[int, tuple[Gpu, ...], int] | None = None
    for k in widths:
        if k > len(gpus):
            continue
        share = math.ceil(nbytes / k) + per_gpu
        least = free[len(gpus) - k]
        if least < share:
            continue
        group = gpus[len(gpus) - k :]
        if model.min_gpus and k < max(model.min_gpus.get(g.type, 1) for g in group):
            continue
        room = k * (least - share)
        if best is None or room > best[0]:
            best = (room, tuple(sorted(group, key=_BY_ID)), sum(free[len(gpus) - k :]))
    return None if best is None else (best[1], best[2])


def _spec(gpu: Gpu) -> _GpuSpec:
    """What a GPU is, beside its room: its type and the speeds the cost model reads."""
    return (gpu.type, gpu.bf16_flops, gpu.hbm_bytes_per_s, gpu.h2d_bytes_per_s, gpu.d2h_bytes_per_s)


def _engine_shape(node: Node, pinned: _Pinned) -> _EngineShape:
    """The node's fixed engine groups as positions among its GPUs (by id), with the instances its engines are
    pinned to (`engine_instances.pinned_instances`; no GPUs: the model cannot run there): nodes alike must match
    in them too."""
    position = {g: i for i, g in enumerate(sorted(node.gpus))}
    shape = {m: (tuple(position[g] for g in gpus), "") for m, gpus in node.engine_gpus.items()}
    for (node_id, model), instance in pinned.items():
        if node_id == node.id:
            shape[model] = ((), "") if instance is None else (tuple(position[g] for g in instance[1]), instance[0])
    return tuple(sorted((m, gpus, precision) for m, (gpus, precision) in shape.items()))


def split_evenly(nbytes: int, parts: int) -> list[int]:
    """Shard sizes for tensor parallelism: equal, the remainder on the first shards."""
    base, extra = divmod(nbytes, parts)
    return [base + 1] * extra + [base] * (parts - extra)


class _GpuBook:
    """Free HBM per GPU while the target is being built, and which nodes look alike to a placement.

    Two nodes *look alike* when their NVMe reads equally fast and their GPUs,
    taken in id order, match in free bytes, type and host link: then a model
    gets the same group shape, load time and slack on either, so a search
    needs to try only the first of them (by id) per source tier. Change
    `free` through `take`: `alike` does not see changes made to it directly.
    """

    def __init__(self, problem: Problem, pinned: _Pinned) -> None:
        self.p = problem
        self.free = {g.id: g.capacity_bytes for g in problem.gpus.values()}
        self._dirty: set[str] = set()  # nodes whose look changed since the grouping was last brought up to date
        self._gpu_ids = {n.id: sorted(n.gpus) for n in problem.nodes.values()}
        self._gpus = {n: [problem.gpus[g] for g in ids] for n, ids in self._gpu_ids.items()}  # node -> its GPUs, by id
        self._room = {n: sum(self.free[g] for g in ids) for n, ids in self._gpu_ids.items()}
        self._by_free: dict[str, tuple[list[Gpu], list[int]]] = {}  # node -> its GPUs by free bytes (see `by_free`)
        self._hardware = {  # the part of a node's look that never changes (custom GPUs share one type name)
            n.id: (
                n.nvme_read_bytes_per_s,
                tuple(_spec(problem.gpus[g]) for g in self._gpu_ids[n.id]),
                _engine_shape(n, pinned),
            )
            for n in problem.nodes.values()
        }
        self._look: dict[str, _Look] = {}
        self._alike: dict[_Look, list[str]] = defaultdict(list)  # look -> its nodes, sorted by id
        for node_id in sorted(problem.nodes):
            self._look[node_id] = look = self._looks(node_id)
            self._alike[look].append(node_id)

    def fits(self, gpus: Iterable[Gpu], shards: Iterable[int]) -> bool:
        free = self.free
        for g, b in zip(gpus, shards, strict=True):
            if free[g.id] < b:
                return False
        return True

    def take(self, gpus: Sequence[Gpu], shards: Iterable[int]) -> None:
        """Take shards on the GPUs of one group (all on one node)."""
        free, taken = self.free, 0
        for g, b in zip(gpus, shards, strict=True):
            free[g.id] -= b
            taken += b
        if taken:
            self._changed(gpus[0].node, taken)

    def take_from(self, node_id: str, takes: Iterable[tuple[str, int]]) -> None:
        """Take (GPU id, bytes) pairs on one node."""
        taken = 0
        for g, b in takes:
            self.free[g] -= b
            taken += b
        self._changed(node_id, taken)

    def _changed(self, node_id: str, taken: int) -> None:
        self._room[node_id] -= taken
        self._dirty.add(node_id)
        self._by_free.pop(node_id, None)

    def by_free(self, node_id: str) -> tuple[list[Gpu], list[int]]:
        """The node's GPUs sorted by (free bytes, id), and their free bytes in that order."""
        entry = self._by_free.get(node_id)
        if entry is None:
            gpus = self._gpus[node_id]
            free = list(map(self.free.__getitem__, self._gpu_ids[node_id]))
            order = sorted(range(len(gpus)), key=free.__getitem__)  # stable: ties stay in id order
            entry = self._by_free[node_id] = (list(map(gpus.__getitem__, order)), list(map(free.__getitem__, order)))
        return entry

    def gpu_ids(self, node_id: str) -> list[str]:
        """The node's GPU ids, sorted."""
        return self._gpu_ids[node_id]

    def room(self, node_id: str) -> int:
        """Free bytes on all of the node's GPUs together."""
        return self._room[node_id]

    def alike(self) -> Iterable[list[str]]:
        """Nodes grouped by look, each group sorted by id."""
        for node_id in self._dirty:
            self._regroup(node_id)
        self._dirty.clear()
        return self._alike.values()

    def _looks(self, node_id: str) -> _Look:
        return (self._hardware[node_id], tuple(self.free[g] for g in self._gpu_ids[node_id]))

    def _regroup(self, node_id: str) -> None:
        old, new = self._look[node_id], self._looks(node_id)
        if old == new:
            return
        self._alike[old].remove(node_id)
        if not self._alike[old]:
            del self._alike[old]
        bisect.insort(self._alike[new], node_id)
        self._look[node_id] = new


@dataclass(frozen=True, slots=True)
class _ExpertShape:
    """A MoE's expert chunks on one node. Its decode slowdown at step k is `scale * miss[k]`, where the
    scale (served weight * slowdown with no expert on GPU) depends on the group's PCIe bandwidth."""

    # (model, partial experts, limit): all the shape depends on (nodes alike share it); a plain tuple, as it
    # goes into `_expert_terms`' memo key as it is
    key: tuple[Hashable, ...]
    steps: list[int]  # [0, expert bytes on GPU at each chunk step the node may hold]
    miss: list[float]  # share of routed-expert reads that miss the GPU at each step
    sizes: list[int]  # per chunk (step k -> k + 1): its bytes
    gains: list[float]  # per chunk: the change of `miss` (negative: fewer misses)
    order: list[float]  # per chunk (step k -> k + 1): change of `miss` per byte, as a running max (concave hit rate)

    def paying(self, scale: float, price: float) -> int:
        """The step up to which every chunk saves more slowdown than the HBM price of its bytes."""
        return bisect.bisect_left(self.order, -price / scale) if scale > 0 else 0


@dataclass(frozen=True, slots=True)
class _ExpertTerms:
    """One MoE's part of `GreedyPlanner._experts_cost` on a node, for its group's bandwidth and the expert
    bytes already placed: what does not depend on the room the node has left."""

    now: float  # served weight * decode slowdown with the expert bytes placed
    # per chunk from the placed bytes to the last paying one: (change of the slowdown per byte, as a running
    # max: the sort key, model, step, bytes, change of the slowdown plus the bytes' price)
    offers: list[tuple[float, str, int, int, float]]


class GreedyPlanner:
    """`nodes` and `precisions` fix where and at which precision a model is served (the local search's
    moves, `search.py`); what they leave open is the greedy's choice. Given neither, the joint choice fixes
    them for the models with requests in flight (`serve_active`). `leave`: models the joint choice may not keep
    on the group they serve from now (`plan_greedy`'s second plan)."""

    def __init__(
        self,
        problem: Problem,
        nodes: Mapping[str, str] | None = None,
        precisions: Mapping[str, str] | None = None,
        leave: frozenset[str] = frozenset(),
    ) -> None:
        self.p = problem
        self.nodes = dict(nodes or {})
        self.precisions = dict(precisions or {})
        self.leave = leave
        self._chosen: dict[str, joint.Option] = {}  # the joint choice (`narrowing`)
        self._chosen_cards: dict[str, list[int]] = {}  # the free bytes of each node's cards it was made on
        self.c = problem.constants
        self.now = ResidencyIndex.build(problem, problem.residency)
        # engines that can run only as they are, or not at all (adopted ones: only their owner launches them)
        states = confirmed_states(problem)
        self._pinned = pinned_instances(problem, states)
        self.book = _GpuBook(problem, self._pinned)
        # the CUDA contexts that engines which cannot stop keep asleep: held until their weights land there
        self._contexts = kept_contexts(states)
        for gpu_ids, nbytes in self._contexts.values():
            self.book.take([problem.gpus[g] for g in gpu_ids], [nbytes] * len(gpu_ids))
        # (node, model) -> the KV in each running engine's fixed pool, kept while it runs as it is
        self._pools = pooled_kv(problem, states)
        self._pooled: set[StateObject] = set()  # KV placed where its engine's pool keeps it
        # (node, model) -> the pool per GPU each running engine was launched with (engine_holdings.launched_pools)
        self._launched_pools = launched_pools(problem, states)
        # model -> (its group's GPU ids, the room per GPU its engine's KV pool holds beyond the KV placed in it):
        # a launched pool takes its room whole, and the sessions' KV placed there fills it first
        self._pool_room: dict[str, tuple[tuple[str, ...], list[int]]] = {}
        self._fixed_pools: set[str] = set()  # models on their launched engine as it is: its pool does not grow
        # (node, model) -> the routed experts each running MoE engine holds on the node's GPUs: its launch
        # setting, kept while it runs as it is; the models whose expert share is so fixed in the target
        self._launched_experts = launched_experts(problem, states)
        self._experts_fixed: set[str] = set()
        # the engines whose experts' room is held until their model is placed (`_hold_launched_experts`)
        self._experts_held: set[tuple[str, str]] = set()
        # model -> (its running engine's GPUs, the bytes per GPU held there until it is placed: `_hold_staying`)
        self._stay_held: dict[str, tuple[tuple[Gpu, ...], list[int]]] = {}
        self._widened: set[str] = set()  # see `_narrow_on`
        self._narrow_stays: dict[str, tuple[joint.Option, list[joint.Option]]] = {}  # see `_narrow_stay_held`
        self._coming: dict[str, int] = {}  # see `_leaves_room`
        self._priced_group: dict[tuple[str, str, str], tuple[Gpu, ...]] = {}  # (model, node, precision) -> the
        # group the joint choice priced there
        self._running = {key: view for key, view in states.items() if view.state is EngineState.RUNNING}
        # (node, model) -> the sleeping engines whose node reported their launched pool: a wake as they are maps
        # that pool back, no larger and no smaller (engine_holdings.woken_pools)
        self._asleep_pools = {
            key: (view, problem.engine_pools[key])
            for key, view in states.items()
            if view.state in (EngineState.ASLEEP_HOST, EngineState.ASLEEP_DISCARDED) and key in problem.engine_pools
        }
        self._stuck = {
            key: view for key, view in states.items() if view.state is EngineState.RUNNING and not can_leave(view)
        }
        self._at = {g: Location.gpu(g) for g in problem.gpus}  # GPU id -> its location
        self.target: Placement = {}
        self.groups: dict[str, Group] = {}
        self.unserved: dict[str, str] = {}
        self.reasons: dict[StateObject, str] = {}
        self.demand = demand = Demand.of(problem)
        self.position = demand.position  # session id -> column of `weighted`
        self.row = demand.row  # model id -> row of `weighted`
        self.weighted = demand.q * demand.slo_weight  # [models x sessions] SLO weight * probability of the next request
        self.demand_total = self.weighted.sum(axis=1)  # [models]
        self.slo_target = demand.slo_target
        self.lateness = Lateness(demand, self.weighted)
        self.active = self._active_sessions()
        self._host_copies = self._host_copies_by_object()
        # (kv object, node) wherever KV sits now, and where it sits on the node's GPUs; (model, node) -> the
        # sessions with KV below the node's GPUs, and on them
        self._kv_held: set[tuple[StateObject, str]] = set()
        self._kv_on_gpus: set[tuple[StateObject, str]] = set()
        self._sessions_below: dict[tuple[str, str], set[str]] = defaultdict(set)
        self._sessions_on_gpus: dict[tuple[str, str], set[str]] = defaultdict(set)
        for obj, loc in self.now.kv_entries:
            assert obj.session is not None  # a KV object
            node_id = problem.node_of(loc)
            self._kv_held.add((obj, node_id))
            if loc.tier is _GPU:
                self._kv_on_gpus.add((obj, node_id))
                self._sessions_on_gpus[(obj.model, node_id)].add(obj.session)
            else:
                self._sessions_below[(obj.model, node_id)].add(obj.session)
        self._savings: dict[tuple[str, str, float, float, float, bool], float] = {}  # see `_restore_saving`
        self._cold_groups: dict[tuple[str, str, str], tuple[Gpu, ...] | None] = {}
        # node -> model -> the GPUs of its engine there, where it runs on fixed ones or is pinned to its own
        self._fixed_groups = {
            n.id: {m: tuple(problem.gpus[g] for g in gpus) for m, gpus in n.engine_gpus.items()}
            for n in problem.nodes.values()
        }
        for (node_id, model_id), instance in self._pinned.items():
            if instance is not None:
                self._fixed_groups[node_id][model_id] = tuple(problem.gpus[g] for g in instance[1])
        self._uniform = {  # nodes whose cards are all alike
            n.id: len(
                {(g.type, g.capacity_bytes, g.h2d_bytes_per_s, g.bf16_flops) for g in (problem.gpus[i] for i in n.gpus)}
            )
            <= 1
            for n in problem.nodes.values()
        }
        # model -> SLO-weighted tokens a re-prefill would process, and attention pairs (c (c + 1) / 2 for a history
        # of c tokens: `costs.prefill_seconds`) (Python floats: they are read one at a time)
        self._context_demand: dict[str, float] = dict(
            zip(self.row, (self.weighted @ demand.context).tolist(), strict=True)
        )
        self._pairs_demand: dict[str, float] = dict(
            zip(self.row, (self.weighted @ costs.causal_pairs(demand.context, 0)).tolist(), strict=True)
        )
        # SLO class -> its weight and target, read once (`CostConstants` looks them up by name, a Python call each)
        self._slo_weight = {slo: self.c.slo_weights.of(slo) for slo in Slo}
        self._slo_target = {slo: self.c.slo_targets_seconds.of(slo) for slo in Slo}
        self._active_weight = {m: sum(self._slo_weight[s.slo] for s in sessions) for m, sessions in self.active.items()}
        # node -> {MoE model served there: (its spec, its group's summed host->GPU bandwidth, which its expert
        # fetches run on)}
        self._moe_on: dict[str, dict[str, tuple[ModelSpec, float]]] = defaultdict(dict)
        self._sources: dict[tuple[StateObject, str], Tier | None] = {}
        self._experts_placed: dict[str, int] = defaultdict(int)  # MoE model -> expert bytes the target puts on GPU
        self._steps_cache: dict[tuple[str, bool], list[int]] = {}  # (model, partial experts) -> `_expert_steps`
        # (node, MoE models) -> `_experts_curve`
        self._curves: dict[tuple[str | tuple[str, float, int], ...], tuple[list[int], list[float]]] = {}
        self._expert_terms_memo: dict[tuple[tuple[Hashable, ...], float, int, float], _ExpertTerms] = {}
        self._histories = demand.context  # per session: the tokens a re-prefill of its history processes
        self._prefill_settings: dict[tuple[str, str], tuple[int, bool]] = {}  # `_expert_prefill_setting`
        self._expert_prefill: dict[tuple[str, str, float], float] = {}  # `_expert_prefill_seconds`
        # (model, prefill chunk) -> per session its re-prefill's passes, and their SLO-weighted sum over the
        # model's predicted requests (`_reprefill_demand`)
        self._prefill_passes: dict[tuple[str, int], tuple[Any, float]] = {}
        self._price = self.c.gpu_price_seconds_per_gib / GIB  # seconds per byte held on GPU
        self._shapes: dict[tuple[str, bool, int], _ExpertShape] = {}
        self._shape_on: dict[tuple[str, str], _ExpertShape] = {}  # (model, node) -> its shape
        self._served: dict[str, float] = {}
        self._active_context: dict[str, float] = {}
        # (model, re-prefill seconds per token and per attention pair) -> `_late_penalty`
        self._late: dict[tuple[str, float, float], float] = {}
        self._limits: dict[tuple[str, str], int] = {}
        self._split_units: dict[tuple[str, bool], int] = {}
        self._refused_chunk: dict[StateObject, int] = {}  # experts -> the smallest chunk of them that found no room
        # an engine MoE -> the chunks of its experts the spend step placed, in order: (bytes, value, why)
        self._engine_chunks: dict[str, list[tuple[int, float, _Why]]] = defaultdict(list)
        self._placed_on: dict[str, int] = defaultdict(
            int
        )  # node -> weights placed there so far (offers older are stale)
        self._host_free: dict[str, int] = {}  # node -> host DRAM free now (`_host_room`)
        self._cold_loads: dict[str, ColdLoad] = {}  # model -> its cold load from the confirmed placement

    # -- inputs ------------------------------------------------------------

    def _active_sessions(self) -> dict[str, list[Session]]:
        active: dict[str, list[Session]] = defaultdict(list)
        for s in sorted((s for s in self.p.sessions.values() if s.active), key=lambda s: s.id):
            active[s.model].append(s)
        return active

    def _host_copies_by_object(self) -> dict[StateObject, list[str]]:
        """Nodes whose host DRAM holds a complete copy, per object."""
        out: dict[StateObject, list[str]] = defaultdict(list)
        for (obj, loc), nbytes in self.now.on_host.items():
            if nbytes >= self.p.size_of(obj) > 0:
                out[obj].append(loc.id)
        return out

    def _demand(self, model_id: str) -> float:
        """Total SLO-weighted probability of a next request on the model."""
        return float(self.demand_total[self.row[model_id]])

    def _weight(self, session_id: str, model_id: str) -> float:
        return float(self.weighted[self.row[model_id], self.position[session_id]])

    def _source(self, obj: StateObject, node: str) -> Tier | None:
        """The tier a load of `obj` onto the node's GPUs reads from (its engines may not load weights from host DRAM)."""
        key = (obj, node)
        tier = self._sources.get(key, UNKNOWN)
        if tier is UNKNOWN:
            tier = self.now.complete_source(obj, node)
            if tier is _HOST and obj.kind is not _KV and _WEIGHTS_OFFLOAD not in self.p.nodes[node].capabilities:
                tier = _NVME if self.now.complete(obj, node, _NVME) else None
            self._sources[key] = tier
        return tier

    def _may_serve_from(self, model: ModelSpec, node_id: str, gpus: tuple[Gpu, ...]) -> bool:
        """Whether the node serves the model, and from these GPUs (its engine's, where those are fixed)."""
        fixed = self._fixed_groups[node_id].get(model.id)
        return self.p.nodes[node_id].can_serve(model.id) and (fixed is None or fixed == gpus)

    def _cold_group(self, model: ModelSpec, precision: str, node: str) -> tuple[Gpu, ...] | None:
        key = (model.id, precision, node)
        if key not in self._cold_groups:
            self._cold_groups[key] = costs.cold_group(self.p, model, precision, self.p.nodes[node])
        return self._cold_groups[key]

    # -- step 1: where each model's weights go -----------------------------

    def _best_group(self, model: ModelSpec, extra_bytes: int) -> tuple[_CostKey, Group] | None:
        """The best (cost key, group) for the model's weights plus `extra_bytes` of KV, if any fits (see `_group_options`)."""
        options = self._group_options(model, extra_bytes)
        if not options:
            return None
        key, precision, gpus = min(options, key=_COST_KEY)
        return key, Group(key[3], precision, gpus)

    def _group_options(
        self, model: ModelSpec, extra_bytes: int, experts: bool = True, price_kv: bool = True
    ) -> list[_GroupOption]:
        """The groups the model's weights plus `extra_bytes` of KV may take, as (cost key, precision, GPUs).

        The key (cost, precision rank, slack, node, load seconds) orders by the
        group's estimated marginal objective (`_group_cost`: load, prefill and
        MoE decode terms, and the expert room it takes from MoE models on the
        node; plus the degraded-precision cost of every request served at a
        less preferred precision), then by precision preference, then by how
        tightly the group fits, then by node. Per node the widest group that
        fits and the fewest-GPU one are priced (`_fits_by_width`): a wider group
        prefills and fetches missed experts faster at the same bytes (the
        evaluator sums FLOP/s and PCIe bandwidth over it). Where a node's GPUs
        hold a copy besides the one serving, its cards copy only what they lack.
        With `price_kv`, a group is priced with what the sessions' KV is worth
        there: the re-prefill of the active sessions' KV a change of node or
        precision leaves behind, and what the predicted requests save where
        their KV sits (`_restore_saving`); the joint choice prices the KV per
        node itself (`_kv_cost`).
        """
        current = self.now.serving.get(model.id)
        options: list[_GroupOption] = []
        # a degraded precision costs every request served at it; it wins only where its smaller bytes buy more
        degrade = self.c.degraded_precision_seconds * self._served_weight(model.id)
        for rank, precision in enumerate(model.precisions):
            if self.precisions.get(model.id, precision) != precision:
                continue
            obj = StateObject.weights(model.id, precision)
            nbytes = model.weights_bytes[precision]
            size = nbytes + extra_bytes
            penalty = degrade if rank else 0.0
            if price_kv and current and current.precision != precision:
                penalty += self._active_context_seconds(model)  # the active sessions' KV no longer matches
            stay_node = None
            if current and current.precision == precision and self._may_serve_from(model, current.node, current.gpus):
                stay = current.gpus
                shards = self._launch_shards(model, precision, stay, extra_bytes)
                stay_node = current.node
                if self._stay_fits(model.id, Group(stay_node, precision, stay), shards):
                    cost = self._group_cost(
                        model, stay, current.node, 0.0, size, experts, restores=price_kv, staying=True
                    )
                    cost += penalty + self._pool_overflow(model, current.node, precision, stay)
                    options.append(((cost, rank, 0, stay_node, 0.0), precision, stay))
                # other groups on the same node: only the shards a card lacks now are copied
                for gpus, free in self._fits_by_width(
                    stay_node, model, nbytes + self._kv_room(model, stay_node, extra_bytes)
                ):
                    if gpus == stay:
                        continue
                    seconds = self._regroup_seconds(obj, gpus, nbytes, stay_node)
                    if seconds is None:
                        continue
                    cost = self._group_cost(
                        model, gpus, stay_node, seconds, size, experts, restores=price_kv, staying=True
                    )
                    cost += penalty
                    options.append(((cost, rank, free - nbytes - extra_bytes, stay_node, seconds), precision, gpus))
            if model.id in self.nodes:
                candidates = self._candidate_on(self.nodes[model.id], obj, nbytes + extra_bytes, skip=stay_node)
            else:
                candidates = self._load_candidates(obj, nbytes + extra_bytes, skip=stay_node)
            for node_id, source in candidates:
                node = self.p.nodes[node_id]
                moved = 0.0
                if price_kv and current and current.node != node_id and not penalty:
                    moved = self._active_context_seconds(model)
                held = self.now.on(
                    obj, node_id, _GPU
                )  # a copy there besides the one serving: cards copy what they lack
                for gpus, free in self._fits_by_width(
                    node_id, model, nbytes + self._kv_room(model, node_id, extra_bytes)
                ):
                    if held:
                        seconds = self._regroup_seconds(obj, gpus, nbytes, node_id)
                    else:
                        seconds = engine_costs.bring_up_seconds(self.p, self.now, model, precision, gpus, source, node)
                    if seconds is None:
                        continue
                    cost = (
                        penalty
                        + moved
                        + self._group_cost(model, gpus, node_id, seconds, size, experts, restores=price_kv)
                    )
                    options.append(((cost, rank, free - nbytes - extra_bytes, node_id, seconds), precision, gpus))
        if model.id in self.nodes:
            options = [option for option in options if option[0][3] == self.nodes[model.id]]
            if model.id in self._widened and current is not None:  # the choice priced it off its narrow group
                options = [o for o in options if o[2] != current.gpus] or options
            roomy = [o for o in options if self._leaves_room(model, o[1], o[2], extra_bytes)]
            options = roomy or options
        if self._pinned:
            options = [option for option in options if self._reaches(model.id, option[0][3], option[1])]
        return [o for o in options if self._launch_fits(model, o[1], o[2], extra_bytes)]

    def _launch_shards(self, model: ModelSpec, precision: str, gpus: tuple[Gpu, ...], kv_bytes: int) -> list[int]:
        """Bytes per GPU of `gpus` the model's engine takes there with `kv_bytes` of active KV, as
        `_place_weights` takes them: the weights' shards, what an instance running or asleep there as launched
        keeps or maps back (its experts, the KV in its pool: counted whole, the active sessions' part of it within
        `kv_bytes`, the idle sessions' part giving way to the active sessions' new KV), its pool beyond that KV
        and its CUDA context."""
        node_id = gpus[0].node
        kept, kept_active, idle = self._kept_on(model.id, node_id, precision, gpus)
        return [
            w + max(k, p + i) + c - i + x
            for w, k, c, p, i, x in zip(
                split_evenly(model.weights_bytes[precision], len(gpus)),
                split_evenly(max(0, kv_bytes - kept_active), len(gpus)),
                kept,
                self._launch_room(model.id, node_id, precision, gpus),
                idle,
                self._context_room(model.id, node_id, gpus),
                strict=True,
            )
        ]

    def _launch_fits(self, model: ModelSpec, precision: str, gpus: tuple[Gpu, ...], kv_bytes: int) -> bool:
        """Whether `gpus` hold all the model's engine takes there (`_launch_shards`). A group found by the weights
        and KV alone let a sleeping DeepSeek-class engine wake with its launched expert share beside a running
        engine on L40s, 1.6 GiB a card over (the demo cluster on fake engines: a wake refused for CUDA out of
        memory). Nothing to add on a node without engines."""
        node_id = gpus[0].node
        if engine_of(self.p, node_id, model.id) is None:
            return True
        shards = self._launch_shards(model, precision, gpus, kv_bytes)
        return self._stay_fits(model.id, Group(node_id, precision, gpus), shards)

    def _leaves_room(self, model: ModelSpec, precision: str, gpus: tuple[Gpu, ...], kv_bytes: int) -> bool:
        """Whether the model's weights at `precision` and `kv_bytes` of KV on `gpus` leave a group for the
        largest model the joint choice put on the same node that is still to be placed (`_coming`): the choice
        priced the node's room, and a smaller model placed first on a narrow group (its own, where it stays)
        could take cards a larger one needs (gap-study plain seed 35: a Llama-3.1-8B staying on one L40 left
        the Llama-3.3-70B chosen beside it no group, two sessions unserved)."""
        node_id = gpus[0].node
        coming = [m for m in self._coming if self.nodes.get(m) == node_id]
        if not coming:
            return True
        other_id = max(coming, key=lambda m: (self._coming[m], m))
        other = self.p.models[other_id]
        share = math.ceil((model.weights_bytes[precision] + self._kv_room(model, node_id, kv_bytes)) / len(gpus))
        extra = self._context_room(model.id, node_id, gpus)[0] + self._pool_beyond_even(model, node_id, len(gpus))
        ids = {g.id for g in gpus}
        left = sorted(
            (self.book.free[g] - (share + extra if g in ids else 0) for g in self.book.gpu_ids(node_id)), reverse=True
        )
        need = self._coming[other_id]
        context = _CONTEXT if self.p.nodes[node_id].engine_kind(other_id) in ENGINE_NODE_KINDS else 0
        return any(
            left[k - 1] >= math.ceil(need / k) + context + self._pool_beyond_even(other, node_id, k)
            for k in self._widths(other, node_id)
        )

    def _reaches(self, model_id: str, node_id: str, precision: str) -> bool:
        """Whether the model's engine on the node can run at `precision` (its group: `_fixed_groups`)."""
        key = (node_id, model_id)
        if key not in self._pinned:
            return True
        instance = self._pinned[key]
        return instance is not None and instance[0] == precision

    def _active_context_seconds(self, model: ModelSpec) -> float:
        """Rough price of re-prefilling the active sessions' KV held on the current node (on the current group)."""
        seconds = self._active_context.get(model.id)
        if seconds is None:
            current = self.now.serving.get(model.id)
            seconds = 0.0
            if current is not None and self.active.get(model.id):
                per_token, per_pair = self._prefill_rates(model, current.gpus)
                held = [
                    s for s in self.active[model.id] if (StateObject.kv(model.id, s.id), current.node) in self._kv_held
                ]
                seconds = sum(self._slo_weight[s.slo] * _reprefill(s.context_tokens, per_token, per_pair) for s in held)
            self._active_context[model.id] = seconds
        return seconds

    def _regroup_seconds(self, obj: StateObject, gpus: tuple[Gpu, ...], nbytes: int, node_id: str) -> float | None:
        """Seconds to reshard weights onto `gpus` of the node serving them now: each card copies what it lacks.

        None when a card must grow and the node has no complete copy below its GPUs to copy from.
        """
        shards = split_evenly(nbytes, len(gpus))
        gains = [
            max(0, b - self.now.placement.get((obj, self._at[g.id]), 0)) for g, b in zip(gpus, shards, strict=True)
        ]
        if not any(gains):
            return 0.0
        source = self._source(obj, node_id)
        if source is None:
            return None
        assert obj.precision is not None  # a weights object
        fixed = engine_costs.up_fixed_seconds(
            self.p, self.now, node_id, obj.model, obj.precision, [g.id for g in gpus], host_copy=source is _HOST
        )  # a new group of a running engine: a restart
        return costs.copy_seconds(gains, gpus, source, self.p.nodes[node_id]) + fixed

    def _group_cost(
        self,
        model: ModelSpec,
        gpus: tuple[Gpu, ...],
        node_id: str,
        load_seconds: float,
        need: int,
        experts: bool = True,
        restores: bool = True,
        staying: bool = False,
    ) -> float:
        """Estimated objective seconds of serving the model on `gpus` (what differs between groups).

        move_weight and the active requests wait for the load; predicted
        requests re-prefill their history on the group's FLOP/s, and pay the
        violation penalty where that alone outlasts their target, less what
        those whose KV the node holds save (with `restores`: `_restore_saving`,
        its GPUs' KV counting where the model is `staying`); a MoE's
        requests pay the decode slowdown left after the best expert fraction
        the node's remaining room can hold; and a MoE already on the node loses
        the expert room the group takes. Without `experts`, the last two are
        left out (the joint choice prices them per node).
        """
        c = self.c
        active_w = self._active_weight.get(model.id, 0.0)
        cost = load_seconds * (c.move_weight + active_w)
        per_token, per_pair = self._prefill_rates(model, gpus)
        cost += per_token * self._context_demand[model.id] + per_pair * self._pairs_demand[model.id]
        cost += self._late_penalty(model.id, per_token, per_pair)
        if restores:
            cost -= self._restore_saving(model, node_id, gpus, per_token, per_pair, staying)
        if not experts:
            return cost
        others = [moe for m, moe in self._moe_on.get(node_id, {}).items() if m != model.id]
        if model.is_moe or others:
            # the MoE models on the node share its free room for experts: price the joint change
            room = self.book.room(node_id)
            if model.is_moe and self.p.nodes[node_id].engine_kind(model.id) is not None:
                # an engine's experts lie in equal shares on its own group (`_place_engine_experts`): its room
                # is what every card of the group keeps beside its shard, times the cards
                free = self.book.free
                own = len(gpus) * max(0, min(free[g.id] for g in gpus) - -(-need // len(gpus)))
                cost += self._experts_cost(node_id, [(model, sum(map(_H2D, gpus)))], own)
                after = others
            else:
                after = [*others, (model, sum(map(_H2D, gpus)))] if model.is_moe else others
            cost += self._experts_cost(node_id, after, max(0, room - need)) - self._experts_cost(node_id, others, room)
        return cost

    def _restore_saving(
        self, model: ModelSpec, node_id: str, gpus: tuple[Gpu, ...], per_token: float, per_pair: float, staying: bool
    ) -> float:
        """What the model's predicted requests save on the node where their sessions' KV sits: restored from
        below its GPUs (or, `staying` on the GPUs serving it at its precision, kept there) rather than
        re-prefilled, as the evaluator prices them, and the violation penalty of those then in time."""
        key = (model.id, node_id, per_token, per_pair, sum(map(_H2D, gpus)), staying)
        saving = self._savings.get(key)
        if saving is None:
            arriving = {s.id for s in self.active.get(model.id, ())}  # their KV comes onto the GPUs with the model
            sessions = self._kv_kept(model.id, node_id, staying)
            row, position, weighted, targets = self.row[model.id], self.position, self.weighted, self.slo_target
            penalty = self.c.violation_penalty_seconds
            saving = 0.0
            for sid in sessions:
                column = position[sid]
                w = float(weighted[row, column])
                if w > 0:
                    full = _reprefill(self.p.sessions[sid].context_tokens, per_token, per_pair)
                    ready = 0.0 if sid in arriving else self._kv_ready_on(model, sid, node_id, gpus, staying)
                    saving += w * (full - ready)
                    if ready <= targets[column] < full:  # late re-prefilled (`_late_penalty`), in time restored
                        saving += w * penalty
            self._savings[key] = saving
        return saving

    def _kv_kept(self, model_id: str, node_id: str, on_gpus: bool) -> set[str]:
        """The sessions whose KV for the model the node keeps: those in flight (their KV comes onto the GPUs with
        the model), those with KV below its GPUs, and, `on_gpus`, those with KV on them."""
        kept = {s.id for s in self.active.get(model_id, ())} | self._sessions_below.get(
            (model_id, node_id), _NO_SESSIONS
        )
        if on_gpus:
            kept |= self._sessions_on_gpus.get((model_id, node_id), _NO_SESSIONS)
        return kept

    def _kv_ready_on(
        self,
        model: ModelSpec,
        session_id: str,
        node_id: str,
        gpus: tuple[Gpu, ...],
        staying: bool,
        share: tuple[float, bool] = _ALL_ON_GPU,
    ) -> float:
        """Seconds to ready the session's KV for the model on `gpus` of the node, as the evaluator prices it:
        restored from the node's lower tiers or re-prefilled (a MoE at `share`), what its GPUs hold counting
        where `staying`."""
        on_gpus = self.now.on(StateObject.kv(model.id, session_id), node_id, _GPU) if staying else 0
        return kv_ready(self.p, self.now, model, session_id, node_id, gpus, on_gpus, share)

    def _late_penalty(self, model_id: str, per_token: float, per_pair: float) -> float:
        """The violation penalty of the model's predicted requests whose history's re-prefill alone, at
        `per_token` seconds per token and `per_pair` per attention pair, outlasts their SLO target (on a group
        where the model is warm)."""
        key = (model_id, per_token, per_pair)
        late = self._late.get(key)
        if late is None:
            late = self._late[key] = (
                self.lateness.weight_late(self.row[model_id], per_token, 0.0, per_pair)
                * self.c.violation_penalty_seconds
            )
        return late

    def _prefill_rates(self, model: ModelSpec, gpus: Sequence[Gpu]) -> tuple[float, float]:
        """Prefill seconds per token and per attention pair of the model on `gpus` (`costs.prefill_seconds`),
        as if all a MoE's experts were on GPU (`_ALL_ON_GPU`): what its experts off GPU add to the predicted
        re-prefills (`costs.expert_prefill_seconds`, at the plan's own share as the evaluator prices them) is
        priced with the experts, per byte placed (`_expert_terms`)."""
        return costs.prefill_seconds_per_token(model, gpus, self.c), costs.attention_seconds_per_pair(
            model, gpus, self.c
        )

    def _expert_steps(self, model: ModelSpec, node_id: str) -> list[int]:
        """Cumulative bytes of the expert chunks the greedy offers on the node (hottest first)."""
        partial = _PARTIAL_EXPERTS in self.p.nodes[node_id].capabilities
        key = (model.id, partial)  # all they depend on
        steps = self._steps_cache.get(key)
        if steps is None:
            unit = model.expert_bytes if partial else model.experts_bytes
            chunk_bytes = (
                max(unit, (model.experts_bytes // EXPERT_CHUNKS) // unit * unit) if partial else model.experts_bytes
            )
            steps, placed = [], 0
            while placed < model.experts_bytes:
                placed = min(model.experts_bytes, placed + chunk_bytes)
                steps.append(placed)
            self._steps_cache[key] = steps
        return steps

    def _expert_split_unit(self, model: ModelSpec, node_id: str) -> int:
        """The largest size that divides every expert chunk on the node (a whole number of experts)."""
        key = (model.id, _PARTIAL_EXPERTS in self.p.nodes[node_id].capabilities)  # as for `_expert_steps`
        unit = self._split_units.get(key)
        if unit is None:
            steps = self._expert_steps(model, node_id)
            unit = self._split_units[key] = math.gcd(*(b - a for a, b in itertools.pairwise([0, *steps])))
        return unit

    def _expert_limit(self, model: ModelSpec, node_id: str) -> int:
        """Most expert bytes the node's GPUs may hold: all with a complete copy below to load from, else what they hold now."""
        key = (model.id, node_id)
        limit = self._limits.get(key)
        if limit is None:
            obj = StateObject.experts(model.id)
            if self.now.complete_source(obj, node_id) is not None:
                limit = model.experts_bytes
            else:
                limit = self.now.on(obj, node_id, _GPU)
            self._limits[key] = limit
        return limit

    def _experts_cost(self, node_id: str, moes: list[tuple[ModelSpec, float]], room: int) -> float:
        """Decode slowdown (served weight * seconds) plus HBM price of the MoE models on a node sharing `room` for experts.

        Each model has already `_experts_placed` bytes on GPU; `room` more are
        handed out chunk by chunk, the best saving per byte first (the hit rate
        is concave, so each model's chunks come hottest first), while a chunk
        saves more than its price and the next one fits (`_experts_curve`).
        """
        if not moes:
            return 0.0
        taken, cost = self._curve(node_id, moes)
        return cost[bisect.bisect_right(taken, room) - 1]

    def _curve(self, node_id: str, moes: list[tuple[ModelSpec, float]]) -> tuple[list[int], list[float]]:
        """`_experts_curve`, remembered per (node, models, their bandwidths and placed bytes)."""
        placed = self._experts_placed
        key: tuple[str | tuple[str, float, int], ...] = (
            node_id,
            *[(m.id, h2d, placed.get(m.id, 0)) for m, h2d in moes],
        )
        curve = self._curves.get(key)
        if curve is None:
            curve = self._curves[key] = self._experts_curve(node_id, moes)
        return curve

    def _experts_curve(self, node_id: str, moes: list[tuple[ModelSpec, float]]) -> tuple[list[int], list[float]]:
        """The paying chunks of MoE models sharing a node's room, the best saving per byte first (each model's
        in step order: `order` is a running max), as running totals: bytes taken ([0, ...]) and the models'
        slowdown plus the price of those bytes ([slowdown now, ...])."""
        placed = self._experts_placed
        chosen = [self._expert_terms(node_id, m, h2d, placed.get(m.id, 0)) for m, h2d in moes]
        offers = (
            chosen[0].offers if len(chosen) == 1 else sorted(itertools.chain.from_iterable(t.offers for t in chosen))
        )
        taken = [0, *itertools.accumulate(map(_OFFER_BYTES, offers))]
        return taken, list(itertools.accumulate(map(_OFFER_CHANGE, offers), initial=sum(t.now for t in chosen)))

    def _expert_terms(self, node_id: str, model: ModelSpec, h2d: float, placed: int) -> _ExpertTerms:
        """`_ExpertTerms` of a MoE on the node, on a group of summed host->GPU bandwidth `h2d`, with `placed`
        expert bytes on GPU (remembered per shape, which nodes alike share: a group search prices the same few
        again and again)."""
        shape = self._expert_shape(model, node_id)
        # the predicted re-prefills' seconds per expert byte off GPU: streamed once a pass, linear in the bytes
        # (`costs.expert_prefill_seconds`), so a byte on GPU saves it and pays its HBM price less it
        per_byte = self._expert_prefill_seconds(model, node_id, h2d) / model.experts_bytes
        key = (shape.key, h2d, placed, per_byte)
        terms = self._expert_terms_memo.get(key)
        if terms is None:
            # served weight * decode slowdown with no expert on GPU (costs.decode_slowdown_seconds at f = 0)
            scale = (
                self._served_weight(model.id)
                * self.c.output_tokens_per_request
                * model.active_expert_bytes_per_token
                / h2d
            )
            price = self._price - per_byte
            steps, miss = shape.steps, shape.miss
            j = bisect.bisect_right(steps, placed) - 1  # `placed` is always a step
            best = max(j, shape.paying(scale, price))
            sizes = shape.sizes[j:best]
            changes = [scale * gain + price * nbytes for gain, nbytes in zip(shape.gains[j:best], sizes, strict=True)]
            order = [scale * o - per_byte for o in shape.order[j:best]]
            offers = list(zip(order, itertools.repeat(model.id), range(j, best), sizes, changes))
            terms = _ExpertTerms(scale * miss[j] + per_byte * (model.experts_bytes - placed), offers)
            self._expert_terms_memo[key] = terms
        return terms

    def _expert_prefill_setting(self, model: ModelSpec, node_id: str) -> tuple[int, bool]:
        """The prefill chunk of the node's cards and whether its host DRAM holds all the MoE's experts now (its
        CPU may then compute those off GPU): what `_expert_prefill_seconds` needs of the node."""
        key = (model.id, node_id)
        setting = self._prefill_settings.get(key)
        if setting is None:
            chunk = costs.prefill_chunk_tokens([self.p.gpus[g] for g in self.p.nodes[node_id].gpus])
            in_dram = self.now.complete_source(StateObject.experts(model.id), node_id) is _HOST
            setting = self._prefill_settings[key] = (chunk, in_dram)
        return setting

    def _expert_prefill_seconds(self, model: ModelSpec, node_id: str, h2d: float) -> float:
        """SLO-weighted seconds the model's predicted requests lose to re-prefilling their histories on the node
        with none of its routed experts on GPU, on a group of summed host->GPU bandwidth `h2d`
        (`costs.expert_prefill_seconds` at f = 0). The sessions whose KV the node keeps (`_reprefill_demand`)
        restore it instead: priced for all, the experts on the node holding that KV looked worth more than the
        evaluator finds them (gap-study plain seed 22: 11,940.7 s before, 11,293.8 s with it)."""
        key = (model.id, node_id, h2d)
        seconds = self._expert_prefill.get(key)
        if seconds is None:
            chunk, in_dram = self._expert_prefill_setting(model, node_id)
            passes, tokens = self._reprefill_demand(model, node_id, chunk)
            seconds = passes * (model.experts_bytes / h2d)
            if in_dram:
                cpu = costs.cpu_expert_prefill_seconds_per_token(model, 0.0, self.c)
                seconds = min(seconds, tokens * cpu)
            self._expert_prefill[key] = seconds
        return seconds

    def _reprefill_demand(self, model: ModelSpec, node_id: str, chunk: int) -> tuple[float, float]:
        """The model's SLO-weighted predicted prefill passes (`costs.expert_prefill_passes`, in chunks of
        `chunk` tokens) and tokens of the histories re-prefilled on the node: all less those of the sessions
        whose KV the node keeps (`_kv_kept`, on its GPUs where the model runs there now)."""
        whole = self._prefill_passes.get((model.id, chunk))
        if whole is None:
            share = model.active_expert_bytes_per_token / model.experts_bytes
            per_session = costs.expert_prefill_passes(self._histories, share, chunk)
            row = self.weighted[self.row[model.id]]
            whole = self._prefill_passes[(model.id, chunk)] = (per_session, float(row @ per_session))
        per_session, passes = whole
        tokens = self._context_demand[model.id]
        current = self.now.serving.get(model.id)
        kept = self._kv_kept(model.id, node_id, current is not None and current.node == node_id)
        if kept:
            at = [self.position[sid] for sid in kept]
            weights = self.weighted[self.row[model.id], at]
            passes -= float(weights @ per_session[at])
            tokens -= float(weights @ self._histories[at])
        return max(0.0, passes), max(0.0, tokens)

    def _expert_shape(self, model: ModelSpec, node_id: str) -> _ExpertShape:
        """The model's expert chunks the node may hold, and the share of expert reads each step still misses."""
        shape = self._shape_on.get((model.id, node_id))
        if shape is not None:
            return shape
        limit = self._expert_limit(model, node_id)
        partial = _PARTIAL_EXPERTS in self.p.nodes[node_id].capabilities
        key = (model.id, partial, limit)
        shape = self._shapes.get(key)
        if shape is None:
            steps = [0] + [b for b in self._expert_steps(model, node_id) if b <= limit]
            skew = self.c.expert_popularity_skew
            miss = [1.0 - min(1.0, b / model.experts_bytes) ** skew for b in steps]  # 1 - costs.expert_hit_rate
            sizes = [b - a for a, b in itertools.pairwise(steps)]
            gains = [b - a for a, b in itertools.pairwise(miss)]
            slope = [g / n for g, n in zip(gains, sizes, strict=True)]
            shape = self._shapes[key] = _ExpertShape(
                key, steps, miss, sizes, gains, list(itertools.accumulate(slope, max))
            )
        self._shape_on[(model.id, node_id)] = shape
        return shape

    def _expert_loss(self, node_id: str, nbytes: int) -> float:
        """Objective seconds the MoE models on the node lose when `nbytes` of its free room go to something else."""
        moes = list(self._moe_on.get(node_id, {}).values())
        if not moes:
            return 0.0
        room = self.book.room(node_id)
        return self._experts_cost(node_id, moes, max(0, room - nbytes)) - self._experts_cost(node_id, moes, room)

    def _served_weight(self, model_id: str) -> float:
        """SLO-weighted requests that decode on the model's group: predicted plus active."""
        served = self._served.get(model_id)
        if served is None:
            served = self._served[model_id] = self._demand(model_id) + self._active_weight.get(model_id, 0.0)
        return served

    def _load_candidates(self, obj: StateObject, need: int, skip: str | None) -> list[tuple[str, Tier]]:
        """(node, source tier) pairs worth trying for a load of `obj` that takes `need` bytes of HBM.

        Nodes with less room than `need` cannot hold it. Nodes that look alike
        give equal options, and the lower node id wins the tie, so per look only
        the first node loading from NVMe is tried; nodes holding a copy in host
        DRAM (few) are all tried.
        """
        out = []
        for node_id in self._host_copies.get(obj, ()):
            source = self._source(obj, node_id)
            if node_id != skip and source is not None and self.book.room(node_id) >= need:
                out.append((node_id, source))
        for nodes in self.book.alike():
            if self.book.room(nodes[0]) < need:
                continue
            # A node serving a MoE also prices the expert room it would take, so it does not stand for the
            # others; but it never beats a node of its look that serves none (sharing the room only costs).
            with_moe = []
            for node_id in nodes:
                if node_id == skip or self._source(obj, node_id) is not _NVME:
                    continue
                if node_id in self._moe_on:
                    with_moe.append((node_id, _NVME))
                    continue
                out.append((node_id, _NVME))
                break
            else:
                out.extend(with_moe)
        if len(out) > 2 * NODE_SHORTLIST:
            # many distinct nodes (large clusters): price only the tightest and the roomiest few, and every
            # node with a copy in host DRAM (the group search is the hot loop of planning at scale)
            hosted = [c for c in out if c[1] is _HOST]
            by_room = sorted((c for c in out if c[1] is not _HOST), key=lambda c: (self.book.room(c[0]), c[0]))
            keep = {c[0] for c in by_room[:NODE_SHORTLIST]} | {c[0] for c in by_room[-NODE_SHORTLIST:]}
            out = hosted + [c for c in by_room if c[0] in keep]
        return out

    def _candidate_on(self, node_id: str, obj: StateObject, need: int, skip: str | None) -> list[tuple[str, Tier]]:
        """`_load_candidates` restricted to one node."""
        source = self._source(obj, node_id)
        if node_id == skip or source is None or self.book.room(node_id) < need:
            return []
        return [(node_id, source)]

    def _fits_by_width(self, node_id: str, model: ModelSpec, nbytes: int) -> list[tuple[tuple[Gpu, ...], int]]:
        """The groups of one node worth pricing for `nbytes` split evenly, with their free bytes together:
        the widest that fits and the fewest GPUs.

        For each width k the candidate is the tightest k GPUs that hold an even
        shard (min_gpus respected). The widest prefills and fetches missed
        experts fastest and loads in parallel over the most links, and takes
        the same bytes of the node as any other width (on an engine node but
        for one CUDA context per card, which no price counts), so it is the
        one that usually wins; the fewest GPUs (the tightest fit) stays on offer for
        nodes of unlike cards, where a wide group may leave a large card's room
        in small pieces. A model whose engine runs on fixed GPUs of the node
        has that group alone, where it fits; a node serving through engines
        none of which serves the model has none. On an engine node each card
        of the group holds the engine's CUDA context too (`_context_room`).
        """
        if not self.p.nodes[node_id].can_serve(model.id):
            return []
        fixed = self._fixed_groups[node_id].get(model.id)
        if fixed is not None:
            share = (
                math.ceil(nbytes / len(fixed))
                + self._context_room(model.id, node_id, fixed)[0]
                + self._pool_beyond_even(model, node_id, len(fixed))
            )
            if not costs.holds_evenly(fixed, model, nbytes) or any(self.book.free[g.id] < share for g in fixed):
                return []
            return [(fixed, sum(self.book.free[g.id] for g in fixed))]
        gpus, free = self.book.by_free(node_id)
        kind = self.p.nodes[node_id].engine_kind(model.id)
        widths = [k for k in range(len(gpus), 0, -1) if tensor_parallel_ok(kind, model.attention_heads, k)]
        # a new group's context (where it is a sleeping engine's own group, its context is held already and
        # counted again: a wake there is on offer where the node fixes the group, above)
        context = _CONTEXT if kind in ENGINE_NODE_KINDS else 0
        # plain loops over a module function rather than a closure and generators: the hot loop of a group search
        wide = None
        for k in widths:
            wide = _tightest_group(gpus, free, k, model, nbytes, context + self._pool_beyond_even(model, node_id, k))
            if wide is not None:
                break
        if wide is None:
            return []
        if model.is_moe and kind is not None:
            # an engine's experts lie in equal shares on its own group: the group whose cards keep the most room
            # beside their shards holds the most of them (the widest may take a card another engine fills)
            beyond = max((self._pool_beyond_even(model, node_id, k) for k in widths), default=0)
            roomy = _roomiest_group(gpus, free, widths, model, nbytes, context + beyond)
            if roomy is not None and roomy[0] != wide[0]:
                return [wide, roomy]
        if self._uniform[node_id]:
            return [wide]  # like cards: the widest is never worse (more FLOP/s and links, the same bytes but contexts)
        for k in reversed(widths):  # the fewest GPUs, if fewer than the widest's fit
            if k >= len(wide[0]):
                break
            narrow = _tightest_group(gpus, free, k, model, nbytes, context + self._pool_beyond_even(model, node_id, k))
            if narrow is not None:
                return [wide, narrow]
        return [wide]

    def _kept_on(
        self, model_id: str, node_id: str, precision: str, gpus: tuple[Gpu, ...]
    ) -> tuple[list[int], int, list[int]]:
        """Bytes per GPU of `gpus` that staying there at `precision` takes beyond the weights: the sessions' KV
        in the running engine's pool and its routed experts unless held already (`_keep_pool`; those beside the
        group: `_stay_fits`); how much of that KV is the active sessions'; and per GPU the idle sessions' part
        of it, which the pool's LRU evicts for the active sessions' new KV (`_evict_for_active`)."""
        out = [0] * len(gpus)
        idle = [0] * len(gpus)
        active_bytes = 0
        ids = tuple(g.id for g in gpus)
        key = (node_id, model_id)
        pool = self._pools.get(key)
        if pool is not None and pool[:2] == (precision, ids):
            active = {s.id for s in self.active.get(model_id, ())}
            position = {g: i for i, g in enumerate(ids)}
            for (kv, loc), nbytes in pool[2].items():
                out[position[loc.id]] += nbytes
                if kv.session in active:
                    active_bytes += nbytes
                else:
                    idle[position[loc.id]] += nbytes
        experts = self._launched_experts.get(key)
        if experts is not None and key not in self._experts_held and experts[:2] == (precision, ids):
            for i, g in enumerate(ids):
                out[i] += experts[2].get(g, 0)
        return out, active_bytes, idle

    def _kv_room(self, model: ModelSpec, node_id: str, kv_bytes: int) -> int:
        """The GPU bytes `kv_bytes` of the sessions' KV take in a new launch on the node: on a vLLM / SGLang
        node the engine's pool, never less than one request of the model's maximum context
        (engines.min_kv_pool_bytes_per_gpu; split over a group it totals the same, to rounding)."""
        if engine_of(self.p, node_id, model.id) is None:
            return kv_bytes
        return max(kv_bytes, min_pool_bytes_per_gpu(self.p, model.id, 1))

    def _pool_beyond_even(self, model: ModelSpec, node_id: str, width: int) -> int:
        """What a new engine's minimum pool takes on each card of a group of `width` beyond the even share of
        its one-card total that `_kv_room` counts: 0 where the KV splits over the group, more where the ranks
        replicate KV heads or hold the whole MLA latent (engines.kv_split_ways), so that a group offered for
        its weights and pool is one `_launch_room` finds room in."""
        if engine_of(self.p, node_id, model.id) is None:
            return 0
        one = min_pool_bytes_per_gpu(self.p, model.id, 1)
        return max(0, min_pool_bytes_per_gpu(self.p, model.id, width) - -(-one // width))

    def _launch_room(self, model_id: str, node_id: str, precision: str, gpus: Sequence[Gpu]) -> list[int]:
        """Bytes per GPU of `gpus` the model's engine pool takes beyond the KV kept in it (`_kept_on`): on a
        vLLM / SGLang node, a running engine that stays as it is keeps its launched pool (its room less the
        KV it holds there), a sleeping one woken as it is the pool its node reported; a new launch takes at
        least its minimum pool. Nothing elsewhere."""
        if engine_of(self.p, node_id, model_id) is None:
            return [0] * len(gpus)
        key = (node_id, model_id)
        ids = tuple(g.id for g in gpus)
        pool = self._pools.get(key)
        view_pool = self._launched_pools.get(key)
        running = self._running.get(key)
        if running is not None and view_pool is not None and (running.precision, running.gpus) == (precision, ids):
            held = dict.fromkeys(ids, 0)
            if pool is not None:
                for (_, loc), nbytes in pool[2].items():
                    held[loc.id] += nbytes
            return [max(0, view_pool - held[g]) for g in ids]
        asleep = self._asleep_pools.get(key)
        if asleep is not None and (asleep[0].precision, asleep[0].gpus) == (precision, ids):
            return [asleep[1]] * len(ids)
        return [min_pool_bytes_per_gpu(self.p, model_id, len(ids))] * len(ids)

    def _context_room(self, model_id: str, node_id: str, gpus: Sequence[Gpu]) -> list[int]:
        """Bytes per GPU of `gpus` the CUDA context of the model's engine there takes beyond what is held: on a
        vLLM / SGLang node every instance up holds one on each GPU of its group (engines.holdings), apart from
        its pool, which the KV fills (`_kv_fits`); a sleeping engine's, held already (`kept_contexts`), is
        its own group's when it wakes or restarts there. Nothing elsewhere."""
        if engine_of(self.p, node_id, model_id) is None:
            return [0] * len(gpus)
        held = self._contexts.get((node_id, model_id))
        if held is not None and held[0] == tuple(g.id for g in gpus):
            return [0] * len(gpus)
        return [_CONTEXT] * len(gpus)

    def _hold_pool_room(self, model: ModelSpec, group: Group) -> None:
        """Take the room of the model's engine pool beyond the KV kept in it (`_launch_room`)."""
        room = self._launch_room(model.id, group.node, group.precision, group.gpus)
        ids = tuple(g.id for g in group.gpus)
        key = (group.node, model.id)
        launched = self._running.get(key) or (self._asleep_pools[key][0] if key in self._asleep_pools else None)
        if launched is not None and (launched.precision, launched.gpus) == (group.precision, ids):
            if engine_of(self.p, group.node, model.id) is not None:
                self._fixed_pools.add(model.id)
        if any(room) or model.id in self._fixed_pools:
            self.book.take(group.gpus, room)
            self._pool_room[model.id] = (ids, room)

    def _kv_fits(self, obj: StateObject, group: Group, shards: list[int]) -> bool:
        """Whether the KV shards fit on the group: in its engine pool's held room first, then in free room;
        a running engine that stays as it is holds no more than its pool."""
        held = self._pool_room.get(obj.model)
        if held is None or held[0] != tuple(g.id for g in group.gpus):
            return self.book.fits(group.gpus, shards)
        if obj.model in self._fixed_pools:
            return all(b <= r for b, r in zip(shards, held[1], strict=True))
        return self.book.fits(group.gpus, [max(0, b - r) for b, r in zip(shards, held[1], strict=True)])

    def _stay_fits(self, model_id: str, group: Group, shards: list[int]) -> bool:
        """Whether `shards` (the weights with `_kept_on`) fit on the group's GPUs and, where the group is the
        model's running engine as it is, so do the experts it keeps on the node's other GPUs (held already,
        or not)."""
        if not self.book.fits(group.gpus, shards):
            return False
        key = (group.node, model_id)
        experts = self._launched_experts.get(key)
        ids = tuple(g.id for g in group.gpus)
        if experts is None or key in self._experts_held or experts[:2] != (group.precision, ids):
            return True
        free = self.book.free
        return all(free[g] >= nbytes for g, nbytes in experts[2].items() if g not in ids)

    def _hold_launched_experts(self) -> None:
        """Hold the room of the experts of each running MoE engine whose model the node choice (the caller's or
        the joint one) keeps on its node at its precision, until that model is placed: its expert share is a
        launch setting, and it may lie on GPUs beside the engine's group, another model's, which a model
        served before it would otherwise fill (the stay's fit checks the group alone)."""
        for key, (precision, _, held) in self._launched_experts.items():
            node_id, model_id = key
            chosen = self.nodes.get(model_id) == node_id and self.precisions.get(model_id) == precision
            if chosen and model_id not in self.groups:
                self._experts_held.add(key)
                self.book.take_from(node_id, held.items())

    def _stay_bytes(self, model_id: str, node_id: str, precision: str) -> tuple[tuple[Gpu, ...], list[int]] | None:
        """Where the model's engine runs on the node at `precision`: its GPUs and the bytes per GPU staying on it
        as it is takes there beyond what is held already (the weights' shard and the launched KV pool, which
        takes its room whole, and its CUDA context unless held already); else None."""
        key = (node_id, model_id)
        running = self._running.get(key)
        pool = self._launched_pools.get(key)
        if running is None or pool is None or running.precision != precision or engine_of(self.p, *key) is None:
            return None
        gpus = tuple(self.p.gpus[g] for g in running.gpus)
        shards = split_evenly(self.p.models[model_id].weights_bytes[precision], len(gpus))
        return gpus, [b + pool + x for b, x in zip(shards, self._context_room(model_id, node_id, gpus), strict=True)]

    def _hold_staying(self, chosen: Iterable[str], needs: Mapping[str, int]) -> None:
        """Hold the room of each running engine whose model the joint choice keeps on its node at its
        precision, and of each model it keeps on the narrow group it serves from on a node without engines
        (`_narrow_stay_held`), until that model is placed: the choice priced it staying on its own GPUs, but a
        model placed before it takes the widest group that fits and may spread over them (gap-study engine
        seed 12: a coder took three L40s, one of them a Llama-3.1-8B's running engine with a full pool, which
        then moved to another node and pushed a MoE's experts off it; plain seed 28: a coder took all four L40s
        of a Qwen2.5-7B staying on one, which then spread over the four too, re-preparing its seven requests in
        flight, 587.5 s more than the MILP's optimum)."""
        for model_id in sorted(chosen):
            if model_id in self.groups or model_id not in self.nodes:
                continue
            key = (model_id, self.nodes[model_id], self.precisions[model_id])
            stay = self._stay_bytes(*key)
            if stay is None and model_id in self._narrow_stays:
                stay = self._narrow_stay_held(model_id)
                if stay is None:
                    continue
            elif stay is None or self._priced_group.get(key) != stay[0]:
                continue  # (the choice priced a restart on another group there: a MoE's for its experts' room)
            if not self.book.fits(*stay):
                continue
            self.book.take(*stay)
            self._stay_held[model_id] = stay
        # where a model the choice puts on the same node then finds no group there (its cards taken by the held
        # ones), the node's holds go: the choice priced the node's room, not its cards (gap-study engine seed 31:
        # a coder's engine filling one A100 kept a Llama-3.3-70B off the node it was chosen for)
        for node_id in sorted({self.nodes[m] for m in self._stay_held}):
            for model_id in sorted(m for m in chosen if self.nodes.get(m) == node_id and m not in self._stay_held):
                model = self.p.models[model_id]
                need = needs.get(model_id, 0)
                nbytes = model.weights_bytes[self.precisions[model_id]] + self._kv_room(model, node_id, need)
                if model_id not in self.groups and not self._fits_by_width(node_id, model, nbytes):
                    for held in [m for m in self._stay_held if self.nodes[m] == node_id]:
                        self._release_stay(held)
                    break

    def _release_stay(self, model_id: str) -> None:
        """Give back the room `_hold_staying` held for the model (its group is chosen next)."""
        stay = self._stay_held.pop(model_id, None)
        if stay is not None:
            self.book.take(stay[0], [-b for b in stay[1]])

    def _release_experts(self, model_id: str, staying: tuple[str, str] | None = None) -> None:
        """Give back the hold on the experts of the model's running engines, but `staying`'s."""
        for key in [k for k in self._experts_held if k[1] == model_id and k != staying]:
            self._experts_held.discard(key)
            self.book.take_from(key[0], [(g, -nbytes) for g, nbytes in self._launched_experts[key][2].items()])

    def _keep_pool(self, model: ModelSpec, group: Group) -> None:
        """Where the model stays on its running engine as it is, the sessions' KV in that engine's pool stays
        with it (the engine frees no one request's KV), and so do its routed experts (their GPU share is a
        launch setting: the KV of new requests cannot take their room)."""
        key = (group.node, model.id)
        ids = tuple(g.id for g in group.gpus)
        experts = self._launched_experts.get(key)
        staying = experts is not None and experts[:2] == (group.precision, ids)
        self._release_experts(model.id, key if staying else None)
        if experts is not None and staying:
            obj = StateObject.experts(model.id)
            if key in self._experts_held:  # the room held for them becomes the target's
                self._experts_held.discard(key)
            else:
                self.book.take_from(group.node, experts[2].items())
            for g, nbytes in experts[2].items():
                self.target[(obj, self._at[g])] = nbytes
            self._experts_placed[model.id] += sum(experts[2].values())
            self._experts_fixed.add(model.id)
            self.reasons[obj] = (
                "the GPU expert share its engine was launched with: kept while it runs, back with a wake"
            )
        pool = self._pools.get(key)
        if pool is None or pool[:2] != (group.precision, ids):
            return
        pool = self._pools[key] = (*pool[:2], self._evict_for_active(model, group, pool[2]))
        self.book.take_from(group.node, [(loc.id, nbytes) for (_, loc), nbytes in pool[2].items()])
        for (kv, loc), nbytes in pool[2].items():
            self.target[(kv, loc)] = self.target.get((kv, loc), 0) + nbytes
            self._pooled.add(kv)
            self.reasons[kv] = "kept in the KV pool of its running engine, which frees no one request's KV"

    def _pool_overflow(self, model: ModelSpec, node_id: str, precision: str, gpus: tuple[Gpu, ...]) -> float:
        """The unserved penalty of the active sessions a running engine that stays as it is cannot take into its
        fixed pool (its idle sessions' KV evicted: `_evict_for_active`), taken in the order `_water_fill` serves
        them; 0 elsewhere. Unpriced, the greedy kept a Qwen2.5-7B on its engine whose 4.4 GiB pool could not
        take a blocking session's 2 GiB (gap-study engine seed 14)."""
        key = (node_id, model.id)
        running = self._running.get(key)
        pool_bytes = self._launched_pools.get(key)
        active = self.active.get(model.id)
        ids = tuple(g.id for g in gpus)
        if not active or running is None or pool_bytes is None or (running.precision, running.gpus) != (precision, ids):
            return 0.0
        position = {g.id: i for i, g in enumerate(gpus)}
        room = [pool_bytes] * len(gpus)
        in_pool: dict[str, int] = defaultdict(int)
        pool = self._pools.get(key)
        names = {s.id for s in active}
        for (kv, loc), nbytes in pool[2].items() if pool is not None else ():
            if kv.session in names:
                room[position[loc.id]] -= nbytes
                in_pool[kv.session or ""] += nbytes
        cost = 0.0
        for s in sorted(active, key=lambda s: (SLO_RANK[s.slo], s.context_tokens, s.id)):
            shards = split_evenly(max(0, self._kv_bytes(s, model) - in_pool.get(s.id, 0)), len(gpus))
            if all(b <= r for b, r in zip(shards, room, strict=True)):
                room = [r - b for b, r in zip(shards, room, strict=True)]
            else:
                cost += self.c.unserved_penalty_seconds * self._slo_weight[s.slo]
        return cost

    def _evict_for_active(
        self, model: ModelSpec, group: Group, pooled: Mapping[tuple[StateObject, Location], int]
    ) -> dict[tuple[StateObject, Location], int]:
        """The KV a running engine that stays as it is keeps in its fixed pool once its active sessions' new KV
        is in: where the pool's room left beside what it holds is short of that KV on a GPU, its LRU evicts
        idle sessions' KV there (in the order `engine_kv.kv_within_pools` cuts it), never an active
        session's. Kept whole, that idle KV left the active requests unserved (gap-study engine seed 12: two
        blocking sessions of a GLM-4.5-Air whose pool held 20 GiB of idle sessions' KV)."""
        active = self.active.get(model.id)
        pool_bytes = self._launched_pools.get((group.node, model.id))
        if not active or pool_bytes is None:
            return dict(pooled)
        position = {g.id: i for i, g in enumerate(group.gpus)}
        held = [0] * len(group.gpus)
        in_pool: dict[str, int] = defaultdict(int)
        for (kv, loc), nbytes in pooled.items():
            held[position[loc.id]] += nbytes
            assert kv.session is not None  # a KV object
            in_pool[kv.session] += nbytes
        need = [0] * len(group.gpus)
        for s in active:
            rest = max(0, self._kv_bytes(s, model) - in_pool.get(s.id, 0))
            for i, b in enumerate(split_evenly(rest, len(group.gpus))):
                need[i] += b
        short = [max(0, n - (pool_bytes - h)) for n, h in zip(need, held, strict=True)]
        if not any(short):
            return dict(pooled)
        kept = {}
        for (kv, loc), nbytes in sorted(pooled.items()):
            i = position[loc.id]
            if short[i] > 0 and not self.p.sessions[kv.session or ""].active:
                cut = min(short[i], nbytes)
                short[i] -= cut
                nbytes -= cut
            if nbytes > 0:
                kept[(kv, loc)] = nbytes
        return kept

    def _place_weights(self, model: ModelSpec, group: Group, reason: str) -> None:
        obj = StateObject.weights(model.id, group.precision)
        shards = split_evenly(model.weights_bytes[group.precision], len(group.gpus))
        self._keep_pool(model, group)
        self.book.take(group.gpus, shards)
        self.book.take(group.gpus, self._context_room(model.id, group.node, group.gpus))
        self._hold_pool_room(model, group)
        for g, b in zip(group.gpus, shards, strict=True):
            if b:
                self.target[(obj, self._at[g.id])] = b
        self.groups[model.id] = group
        self.reasons[obj] = reason
        self._placed_on[group.node] += 1
        if model.is_moe:
            self._moe_on[group.node][model.id] = (model, sum(map(_H2D, group.gpus)))

    def _place_spread(self, obj: StateObject, group: Group, shards: list[int]) -> None:
        """Place `obj` over the group's GPUs in the given shards (`split_evenly` of its bytes); KV fills its
        engine pool's held room first (`_hold_pool_room`)."""
        held = self._pool_room.get(obj.model) if obj.kind is _KV else None
        if held is not None and held[0] == tuple(g.id for g in group.gpus):
            room = held[1]
            taken = []
            for i, b in enumerate(shards):
                use = min(room[i], b)
                room[i] -= use
                taken.append(b - use)
            self.book.take(group.gpus, taken)
        else:
            self.book.take(group.gpus, shards)
        for g, b in zip(group.gpus, shards, strict=True):
            if b:
                key = (obj, self._at[g.id])
                self.target[key] = self.target.get(key, 0) + b

    def _kv_bytes(self, session: Session, model: ModelSpec) -> int:
        return session.context_tokens * model.kv_bytes_per_token

    def _serve_order(self) -> list[str]:
        """Models with requests in flight, most urgent SLO first, then largest; models with only stand-ins
        (seats kept for the recent load) after every model a real request waits for, so that room kept for
        predicted load never turns away a request that is here."""

        def urgency(model_id: str) -> tuple[bool, int, int, str]:
            model = self.p.models[model_id]
            sessions = self.active[model_id]
            return (
                all(s.stand_in for s in sessions),
                min(SLO_RANK[s.slo] for s in sessions),
                -model.weights_bytes[model.preferred],
                model_id,
            )

        return sorted(self.active, key=urgency)

    def _place_stuck(self) -> None:
        """The running engines that cannot leave their GPUs (an adopted one launched without a sleep it may be
        asked for) keep serving there, with their pools: placed first, whatever their demand."""
        for (node_id, model_id), view in sorted(self._stuck.items()):
            assert view.precision is not None  # a running instance
            group = Group(node_id, view.precision, tuple(self.p.gpus[g] for g in view.gpus))
            self._place_weights(self.p.models[model_id], group, "its engine cannot leave its GPUs (adopted)")

    def serve_active(self) -> None:
        active = self.active
        self._place_stuck()
        order = self._serve_order()
        needs = {m: sum(self._kv_bytes(s, self.p.models[m]) for s in active[m]) for m in order}  # active KV bytes
        # a caller's choices (the local search's) stand as given; else the nodes are chosen together
        free_order = [m for m in order if m not in self.groups]
        pinned = self._pin_joint_choice(free_order, needs) if not self.nodes and not self.precisions else set()
        self._hold_launched_experts()
        if pinned:
            self._hold_staying(pinned, needs)
        self._coming = {  # the bytes each model the choice placed on a node takes there, until it is placed
            m: self.p.models[m].weights_bytes[self.precisions[m]]
            + self._kv_room(self.p.models[m], self.nodes[m], needs.get(m, 0))
            for m in pinned
            if m not in self.groups
        }
        for model_id in order:
            self._coming.pop(model_id, None)
            model = self.p.models[model_id]
            sessions = active[model_id]
            need = needs[model_id]
            if model_id in self.groups:  # its engine cannot leave its GPUs: its sessions' KV joins it there
                self._serve_sessions(model, self.groups[model_id], sessions)
                continue
            self._release_stay(model_id)
            best = self._best_group(model, need)
            if best is None and model_id in pinned:
                # the node the joint choice gave it cannot hold the weights and all the active KV after all (it
                # priced the node's room, not its cards): a node that can, as each session left out costs the
                # unserved penalty (gap-study engine seed 6: a coder beside a Llama-3.3-70B and a running
                # engine's fixed pool left two sessions out, 4,800 s)
                chosen = self.nodes.pop(model_id), self.precisions.pop(model_id)
                best = self._best_group(model, need)
                if best is None:
                    self.nodes[model_id], self.precisions[model_id] = chosen
            # where the weights and all the active KV fit nowhere, take the group that holds the most of that KV
            best = best or self._roomiest_group(model, need)
            if best is None and model_id in pinned:  # the joint choice has no room left after all: any node
                self.nodes.pop(model_id, None)
                self.precisions.pop(model_id, None)
                best = self._best_group(model, need) or self._roomiest_group(model, need)
            if best is None:
                for s in sessions:
                    self.unserved[s.id] = self._why_unplaceable(model)
                continue
            _, group = best
            self._place_weights(model, group, f"serves {len(sessions)} active session(s)")
            self._serve_sessions(model, group, sessions)
        # an idle model the joint choice keeps warm, the largest first: the choice priced the node's room, and a
        # smaller one placed first may spread over cards the larger one needs whole
        for model_id in sorted(pinned - set(order), key=self._largest_first):
            self._coming.pop(model_id, None)
            if model_id in self.groups:
                continue
            self._release_stay(model_id)
            model = self.p.models[model_id]
            best = self._best_group(model, 0)
            if best is None:  # no room left after all: `spend` may still offer it elsewhere
                del self.nodes[model_id], self.precisions[model_id]
                continue
            (_, rank, _, _, seconds), group = best
            value, saved = self._warm_value(model, group.gpus, rank, seconds)
            nbytes = model.weights_bytes[group.precision]
            # placed before `spend`, whose value per byte would let the served models' KV and experts fill its room
            self._place_weights(
                model, group, _words((_KEPT_WARM, (self._demand(model_id), saved, value, nbytes / GIB)))
            )
        for model_id in list(self._stay_held):
            self._release_stay(model_id)
        # a running MoE engine kept by the node choice but not placed after all may stop: `spend` offers its room
        for model_id in sorted({m for _, m in self._experts_held} - set(self.groups)):
            self._release_experts(model_id)

    def _largest_first(self, model_id: str) -> tuple[int, str]:
        return -min(self.p.models[model_id].weights_bytes.values()), model_id

    def _serve_sessions(self, model: ModelSpec, group: Group, sessions: list[Session]) -> None:
        served = {s.id for s in self._water_fill(model, group, sessions)}
        for s in sessions:
            if s.id not in served:
                self.unserved[s.id] = (
                    f"kv capacity: the KV of session {s.id} does not fit on node {group.node}'s GPUs "
                    f"beside {model.id}'s weights and other users' fair share"
                )

    def _pin_joint_choice(self, order: list[str], needs: Mapping[str, int]) -> set[str]:
        """Fix each active model's node and precision as `joint.assign` chooses them together on the greedy's
        own cost estimates, and return the models fixed (their groups are chosen when they are placed).

        A model whose weights and active KV fit on no node takes a node whole
        (as `_roomiest_group` does). Past `joint.MAX_OPTIONS` nothing is fixed.
        The idle models the choice weighs (`_idle_models`) are fixed too where they are kept warm.
        """
        if (
            len(order) < 2
            or sum(len(self.p.models[m].precisions) for m in order) * len(self.p.nodes) > joint.MAX_OPTIONS
        ):
            return set()  # nothing to choose together, or too large a choice to search online: served in turn
        alike = {
            n: [m for m in nodes if m != n] for nodes in self.book.alike() for n in nodes
        }  # node -> its look-alikes
        options = {}
        for model_id in order:
            model = self.p.models[model_id]
            options[model_id] = self._serve_options(model, needs[model_id], alike, whole=False)
            options[model_id] = options[model_id] or self._serve_options(model, 0, alike, whole=True)
        order = [m for m in order if options[m]]
        if len(order) < 2:
            return set()
        rooms = {node_id: self.book.room(node_id) for node_id in self.p.nodes}
        dense, moes = self._idle_models()
        idle = [*dense, *moes]  # they may be kept warm (last in the order: the models in flight pack first)
        for model_id in idle:
            options[model_id] = self._idle_options(self.p.models[model_id], alike)
        for model_id, offered in options.items():
            if model_id in self.leave:
                options[model_id] = [o for o in offered if not o.fixed] or offered
        cards = {node_id: [self.book.free[g] for g in self.book.gpu_ids(node_id)] for node_id in self.p.nodes}
        chosen = joint.assign(
            options, [*order, *idle], rooms, self._curve, dense[:1], cards
        )  # the options priced most single-MoE curves; the largest idle dense model may clear a node for itself
        for model_id in idle:
            if chosen[model_id].node == joint.NOWHERE:
                del chosen[model_id]
        self._chosen, self._chosen_cards = chosen, cards
        self.nodes = {m: option.node for m, option in chosen.items()}
        self.precisions = {m: option.precision for m, option in chosen.items()}
        self._widened = {m for m, option in chosen.items() if not option.fixed and self._narrow_on(m, option)}
        self._narrow_stays = {  # `_stays_narrow`: the choice kept it on its cards, the others on the node beside it
            model_id: (option, [o for o in chosen.values() if o.node == option.node and not o.fixed])
            for model_id, option in chosen.items()
            if option.fixed and engine_of(self.p, option.node, model_id) is None
        }
        return set(chosen)

    def narrowing(self) -> frozenset[str]:
        """The models the joint choice kept on fewer than half of a node's cards (an uneven split: one card of
        four leaves the others three) where the models it put beside them want those cards too: a MoE among
        them (its experts take what room there is), or more bytes than the node's other cards hold
        (`plan_greedy`)."""
        out = set()
        for m, option in self._chosen.items():
            cards = self._chosen_cards.get(option.node, [])
            if not option.fixed or 2 * len(option.fixed) >= len(cards):
                continue
            beside = [o for o in self._chosen.values() if o.node == option.node and not o.fixed]
            others = sum(free for i, free in enumerate(cards) if i not in option.fixed)
            if any(o.moe for o in beside) or sum(o.need for o in beside) > others:
                out.add(m)
        return frozenset(out)

    def _narrow_on(self, model_id: str, option: joint.Option) -> bool:
        """Whether the model serves on a narrow group of the option's node at its precision (`_stays_narrow`):
        chosen there without its staying option, it was priced on the node's best other group, and staying
        after all takes cards the choice gave the others (engine seed 204 of `gap --engines`: a Llama-3.1-8B
        kept its one A100 and left GLM-4.5-Air three)."""
        current = self.now.serving.get(model_id)
        return (
            current is not None
            and current.node == option.node
            and current.precision == option.precision
            and self._stays_narrow(model_id, current.node, current.precision, current.gpus)
        )

    def _narrow_stay_held(self, model_id: str) -> tuple[tuple[Gpu, ...], list[int]] | None:
        """The cards and bytes per card to hold for a model the joint choice keeps on the narrow group it serves
        from on a node without engines, where the models the choice put beside it fit the node's other room as
        they were priced (a MoE at its group's width); else None: held, it would push them onto narrower groups
        than their prices assumed (gap-study plain seed 3: DeepSeek-V3 on three of four L40S, 1,388.5 s more)."""
        option, beside = self._narrow_stays[model_id]
        ids = self.book.gpu_ids(option.node)
        gpus = tuple(self.p.gpus[ids[i]] for i in option.fixed)
        shares = split_evenly(option.need, len(gpus))
        held = dict(zip((g.id for g in gpus), shares, strict=True))
        left = [self.book.free[g] - held.get(g, 0) for g in ids]
        return (gpus, shares) if joint.spread_fits(left, beside) else None

    def _idle_models(self) -> tuple[list[str], list[str]]:
        """The models without requests in flight whose room the joint choice should weigh: every dense one
        predicted, largest first (by its smallest precision's bytes), and every MoE predicted (its experts
        compete for the room of the nodes the models in flight share). Only the largest dense one once: with the
        prefill's attention priced, a model in flight gains enough from a node's faster cards to take them
        from a smaller idle one that gains more there, unseen by the choice (the demo: its planner moved onto
        n1's L40s, where the summarizer was kept warm, 594.3 -> 608.0)."""
        dense: list[str] = []
        moes: list[str] = []
        for model_id, model in self.p.models.items():
            if model_id in self.active or model_id in self.groups or self._demand(model_id) <= 0:
                continue
            (moes if model.is_moe else dense).append(model_id)
        return sorted(dense, key=self._largest_first), moes

    def _idle_options(self, model: ModelSpec, alike: Mapping[str, list[str]]) -> list[joint.Option]:
        """The idle model's options for `joint.assign`: staying cold (`joint.NOWHERE`) and each (node, precision)
        where keeping it warm pays, at minus what it saves (`_warm_value`, its cold load read from host DRAM
        where the lower-tier step could stage it there: room is held only where it pays even then). A MoE has
        every (node, precision), each carrying its experts to the node's curve, where their worth is priced,
        and its cold option costs its decode with no expert on GPU; a dense model's cold option costs
        nothing. A node that looks like one priced from NVMe gets its option (`_with_alike`)."""
        best: dict[tuple[str, str], joint.Option] = {}
        keys: dict[tuple[str, str], float] = {}
        for (_, rank, _, node_id, seconds), precision, gpus in self._group_options(model, 0, experts=False):
            cost = -self._warm_value(model, gpus, rank, seconds, staged=True)[0]
            moe = (model, sum(map(_H2D, gpus))) if model.is_moe else None
            # kept warm through an engine, it launches with its minimum KV pool, and its context on each card
            nbytes, per_card = self._launch_bytes(model, node_id, precision, gpus, 0)
            cap, by = self._group_experts(model, node_id, gpus, nbytes, cost)
            if (cost < 0 or moe) and ((node_id, precision) not in best or by < keys[(node_id, precision)]):
                best[(node_id, precision)] = joint.Option(
                    node_id,
                    precision,
                    nbytes,
                    cost,
                    moe,
                    cap,
                    len(gpus) / len(self.p.nodes[node_id].gpus),
                    self._fixed_cards(model.id, node_id, precision, gpus),
                    len(gpus),
                    per_card,
                    self._widths(model, node_id),
                )
                keys[(node_id, precision)] = by
                self._priced_group[(model.id, node_id, precision)] = gpus
        cold = 0.0  # a MoE left cold decodes with no expert on GPU (warm, the node's experts curve prices that)
        if model.is_moe:
            gpus = self._cold_load(model).gpus
            cold = (
                self._served_weight(model.id) * costs.decode_slowdown_seconds(model, 0.0, gpus, self.c) if gpus else 0.0
            )
        return [joint.Option(joint.NOWHERE, "", 0, cold, None), *self._with_alike(model, best, alike, None)]

    def _serve_options(
        self, model: ModelSpec, need: int, alike: Mapping[str, list[str]], whole: bool
    ) -> list[joint.Option]:
        """The model's (node, precision) options for its weights and `need` bytes of KV on the empty GPUs, each
        at its best width, for `joint.assign`; `whole`: each takes its node's room whole.

        The cost is `_group_cost` without the experts' term (`joint.assign`
        prices it per node, for the MoE models the node holds together), plus
        what the active requests pay to ready their KV there and the violation
        penalty of those that then outlast their SLO target (`_arrivals_cost`),
        less what the predicted requests save where the node holds their KV
        (`_restore_saving`). A node that looks like one priced from
        NVMe gets its option (`_load_candidates` tries one node per look), with
        its own price of that KV: the sessions' KV in host DRAM is not alike
        (on gap-study seed 50, a coder's six sessions held 22 GiB on one L40
        node and 8 GiB on its look-alike, priced the same).
        """
        current = self.now.serving.get(model.id)
        best: dict[tuple[str, str], joint.Option] = {}
        keys: dict[tuple[str, str], float] = {}
        stays: list[joint.Option] = []  # `_stays_narrow`
        how: dict[
            tuple[str, str], tuple[tuple[Gpu, ...], float, float]
        ] = {}  # (node, precision) -> group, load, `_kv_cost`
        for (cost, _, _, node_id, seconds), precision, gpus in self._group_options(model, need, False, price_kv=False):
            nbytes, per_card = self._launch_bytes(model, node_id, precision, gpus, need)
            stay = self._stay_bytes(model.id, node_id, precision)
            if stay is not None and stay[0] == gpus:  # its running engine as it is: its launched pool whole
                nbytes = max(nbytes, sum(stay[1]))
            moe = (model, sum(map(_H2D, gpus))) if model.is_moe else None
            kv = self._kv_cost(model, node_id, precision, gpus, seconds)
            cap, rank = self._group_experts(model, node_id, gpus, nbytes, cost + kv)
            if whole:
                nbytes = self.book.room(node_id)
            elif self._stays_narrow(model.id, node_id, precision, gpus):
                positions = tuple(self.book.gpu_ids(node_id).index(g.id) for g in gpus)
                stays.append(
                    joint.Option(node_id, precision, nbytes, cost + kv, moe, cap, 1.0, positions, len(gpus), per_card)
                )
                continue
            if (node_id, precision) not in best or rank < keys[(node_id, precision)]:
                best[(node_id, precision)] = joint.Option(
                    node_id,
                    precision,
                    nbytes,
                    cost + kv,
                    moe,
                    cap,
                    len(gpus) / len(self.p.nodes[node_id].gpus),
                    () if whole else self._fixed_cards(model.id, node_id, precision, gpus),
                    len(gpus),
                    per_card,
                    self._widths(model, node_id),
                )
                keys[(node_id, precision)] = rank
                how[(node_id, precision)] = gpus, seconds, kv
                self._priced_group[(model.id, node_id, precision)] = gpus
        out = []
        for option in self._with_alike(model, best, alike, current.node if current else None):
            key = (option.node, option.precision)
            if key not in how:  # a look-alike's copy: the same links and FLOP/s, its own lower tiers
                gpus, seconds, kv = how[next(k for n in alike[option.node] if (k := (n, option.precision)) in how)]
                option = option._replace(cost=option.cost - kv + self._kv_cost(model, *key, gpus, seconds))
            out.append(option)
        return out + stays

    def _stays_narrow(self, model_id: str, node_id: str, precision: str, gpus: tuple[Gpu, ...]) -> bool:
        """Whether `gpus` are the group serving the model now on a node without engines, fewer than its cards: an
        option of its own for the joint choice, fixed to those cards (`joint.Option.fixed`), beside the best
        other group there. Priced staying but checked by the node's room alone, the one option let the choice
        keep a model on a card that could not hold its share of the others' bytes, and then it moved after all
        (with this option, gap-study plain seeds 37, 14 and 1 lower by 480, 334 and 97 s)."""
        current = self.now.serving.get(model_id)
        return (
            current is not None
            and current.node == node_id
            and current.precision == precision
            and current.gpus == gpus
            and len(gpus) < len(self.p.nodes[node_id].gpus)
            and engine_of(self.p, node_id, model_id) is None
        )

    def _launch_bytes(
        self, model: ModelSpec, node_id: str, precision: str, gpus: tuple[Gpu, ...], kv_bytes: int
    ) -> tuple[int, int]:
        """HBM a launch of the model's engine on `gpus` takes with `kv_bytes` of KV (weights, its pool, its context
        on each card, and a pool whose ranks hold it whole, MLA's latent, or replicate KV heads on each card
        beyond its even share), and the bytes per card a narrower group does not take (`joint.Option.per_card`)."""
        replica = self._pool_beyond_even(model, node_id, len(gpus))
        contexts = self._context_room(model.id, node_id, gpus)
        nbytes = model.weights_bytes[precision] + self._kv_room(model, node_id, kv_bytes) + sum(contexts)
        return nbytes + replica * len(gpus), max(contexts) + replica

    def _fixed_cards(self, model_id: str, node_id: str, precision: str, gpus: tuple[Gpu, ...]) -> tuple[int, ...]:
        """The positions among the node's cards of `gpus` where the model cannot leave them there: its running
        engine staying as it is, or an engine pinned to them (`joint.Option.fixed`); () elsewhere."""
        ids = self.book.gpu_ids(node_id)
        if len(gpus) == len(ids):
            return ()
        stay = self._stay_bytes(model_id, node_id, precision)
        if (stay is None or stay[0] != gpus) and self._fixed_groups[node_id].get(model_id) != gpus:
            return ()
        return tuple(ids.index(g.id) for g in gpus)

    def _group_experts(
        self, model: ModelSpec, node_id: str, gpus: tuple[Gpu, ...], nbytes: int, cost: float
    ) -> tuple[int | None, float]:
        """For a MoE served through an engine on the node, the most expert bytes `gpus` hold beside an even
        split of `nbytes` (its experts lie in equal shares on its own group: k times its least free card's
        room), and `cost` plus its decode slowdown with that many on GPU, which picks its group of the node for
        the joint choice; elsewhere (None: the node's room, `cost`). Priced by the node's room alone, the choice
        kept GLM-4.5-Air on a node whose widest group took a card another engine filled (gap-study engine seed
        2: 12 GiB of its experts on GPU where an empty node held 116 GiB)."""
        if not model.is_moe or self.p.nodes[node_id].engine_kind(model.id) is None:
            return None, cost
        free = self.book.free
        cap = len(gpus) * max(0, min(free[g.id] for g in gpus) - -(-nbytes // len(gpus)))
        return cap, cost + self._experts_cost(node_id, [(model, sum(map(_H2D, gpus)))], cap)

    def _kv_cost(
        self, model: ModelSpec, node_id: str, precision: str, gpus: tuple[Gpu, ...], load_seconds: float
    ) -> float:
        """The objective seconds that depend on where the model's sessions' KV sits, for serving it on the node
        at `precision` on `gpus`: its active requests' (`_arrivals_cost`) less its predicted requests' restores."""
        per_token, per_pair = self._prefill_rates(model, gpus)
        current = self.now.serving.get(model.id)
        staying = current is not None and current.node == node_id and current.precision == precision
        arrivals = self._arrivals_cost(model, node_id, gpus, per_token, per_pair, load_seconds, staying)
        return arrivals - self._restore_saving(model, node_id, gpus, per_token, per_pair, staying)

    def _arrivals_cost(
        self,
        model: ModelSpec,
        node_id: str,
        gpus: tuple[Gpu, ...],
        per_token: float,
        per_pair: float,
        load_seconds: float,
        staying: bool,
    ) -> float:
        """What the model's active requests pay for their KV served on `gpus` of the node, as the evaluator
        prices it (restored from the node's lower tiers or re-prefilled at `per_token` seconds per token and
        `per_pair` per attention pair, what its GPUs hold counting where the model is `staying` on them at its
        precision; a MoE at its expert share on the node now, as the evaluator's arrivals: with all its experts
        on GPU, a re-prefill looked far cheaper than it is, gap-study plain seed 20: 15,153.9 s before,
        13,090.8 s with it), plus the violation penalty of those whose KV and the weights' `load_seconds`
        outlast their SLO target."""
        held, weight, target, penalty = (
            self._kv_held,
            self._slo_weight,
            self._slo_target,
            self.c.violation_penalty_seconds,
        )
        share = expert_share(self.now, model, node_id)  # they prefill before the plan's experts arrive
        cost = 0.0
        for s in self.active[model.id]:
            kv = StateObject.kv(model.id, s.id)
            if (kv, node_id) in held:
                ready = self._kv_ready_on(model, s.id, node_id, gpus, staying, share)
            else:
                ready = _reprefill(s.context_tokens, per_token, per_pair)
                if model.is_moe:
                    ready += costs.expert_prefill_seconds(s.context_tokens, model, share[0], gpus, self.c, share[1])
            w = weight[s.slo]
            cost += w * ready
            if load_seconds + ready > target[s.slo]:
                cost += penalty * w
        return cost

    def _widths(self, model: ModelSpec, node_id: str) -> tuple[int, ...]:
        """The group sizes the model's engine on the node takes (as `_fits_by_width` tries them)."""
        kind = self.p.nodes[node_id].engine_kind(model.id)
        cards = len(self.p.nodes[node_id].gpus)
        return tuple(k for k in range(1, cards + 1) if tensor_parallel_ok(kind, model.attention_heads, k))

    def _with_alike(
        self,
        model: ModelSpec,
        best: dict[tuple[str, str], joint.Option],
        alike: Mapping[str, list[str]],
        staying: str | None,
    ) -> list[joint.Option]:
        """The options per (node, precision), each one priced on a node that loads from NVMe copied to that
        node's look-alikes that load from NVMe too (`_load_candidates` tries one node per look), never to or
        from the `staying` node (where the option is priced as staying put)."""
        for (node_id, precision), option in list(best.items()):
            obj = StateObject.weights(model.id, precision)
            if self._source(obj, node_id) is not _NVME or node_id == staying:
                continue
            for other in alike[node_id]:
                if (other, precision) not in best and self._source(obj, other) is _NVME and other != staying:
                    best[(other, precision)] = option._replace(node=other)
        return list(best.values())

    def _roomiest_group(self, model: ModelSpec, need: int) -> tuple[_CostKey, Group] | None:
        """Where the weights and all the active KV fit nowhere: the group that holds the most of that KV."""
        lo, hi, best = 0, need, self._best_group(model, 0)
        for _ in range(4):  # halve the gap between what fits and what does not a few times
            if best is None:
                break
            mid = (lo + hi) // 2
            found = self._best_group(model, mid)
            if found is None:
                hi = mid
            else:
                lo, best = mid, found
        return best

    def _water_fill(self, model: ModelSpec, group: Group, sessions: list[Session]) -> list[Session]:
        """Place active sessions' KV max-min fair across users: the user holding the least goes next, and of
        users holding alike (at first, all) the one whose next session is the more urgent, then the smaller:
        taken by user name, a large background session took the room of a blocking one and a smaller one
        (gap-study engine seed 14: two sessions left out where one need be)."""
        by_user: dict[str, deque[Session]] = defaultdict(deque)
        for s in sorted(sessions, key=lambda s: (SLO_RANK[s.slo], s.context_tokens, s.id)):
            by_user[s.user].append(s)

        def turn(held: int, user: str) -> tuple[int, int, int, str]:
            following = by_user[user][0]
            return held, SLO_RANK[following.slo], following.context_tokens, user

        turns = [turn(0, user) for user in by_user]  # the least served goes next
        heapq.heapify(turns)
        served: list[Session] = []
        while turns:
            held, _, _, user = heapq.heappop(turns)
            s = by_user[user].popleft()
            obj = StateObject.kv(model.id, s.id)
            nbytes = self._kv_bytes(s, model)
            if obj in self._pooled:  # in its engine's pool already: only the rest is prefilled
                nbytes -= sum(self.target.get((obj, self._at[g.id]), 0) for g in group.gpus)
            shards = split_evenly(max(0, nbytes), len(group.gpus))
            if self._kv_fits(obj, group, shards):
                if nbytes > 0:
                    self._place_spread(obj, group, shards)
                held += self._kv_bytes(s, model)
                served.append(s)
            if by_user[user]:
                heapq.heappush(turns, turn(held, user))
        return served

    def _why_unplaceable(self, model: ModelSpec) -> str:
        if not any(n.can_serve(model.id) for n in self.p.nodes.values()):
            return f"no engine: every node serves through engines, and none has one for {model.id}"
        smallest = min(model.weights_bytes[p] for p in model.precisions)
        largest_group = max(
            (sum(self.p.gpus[g].capacity_bytes for g in n.gpus) for n in self.p.nodes.values()), default=0
        )
        if smallest > largest_group:
            return (
                f"gpu capacity: {model.id} needs {smallest} bytes of weights even at its smallest precision, "
                f"more than any node's GPUs hold ({largest_group} bytes)"
            )
        if not any(
            self.now.complete_source(StateObject.weights(model.id, p), n)
            or (self.now.serving.get(model.id) and self.now.serving[model.id].node == n)
            for p in model.precisions
            for n in self.p.nodes
        ):
            return f"no source: no node holds a complete copy of {model.id}'s weights to load from"
        return f"gpu capacity: the active models together do not fit; {model.id} waits for room"

    # -- step 2: the rest, by value per byte --------------------------------

    def spend(self) -> None:
        heap: list[tuple[float, int, str, tuple[Any, ...]]] = []
        seq = itertools.count()

        def push(value: float, nbytes: int, kind: str, payload: tuple[Any, ...]) -> None:
            if value > 0 and nbytes > 0:
                heapq.heappush(heap, (-value / nbytes, next(seq), kind, payload))

        for model_id in sorted(self.p.models):
            if model_id not in self.groups:
                self._push_weights(self.p.models[model_id], push)
            else:
                self._push_followers(model_id, push)

        group: Group  # each payload's group (the payloads are plain tuples)
        refused: set[tuple[str, str, tuple[str, ...]]] = set()  # (model, precision, GPUs) its group could not hold
        # an engine MoE -> its hottest chunk of experts that found no room: (experts, group, bytes, value, why)
        left_out: dict[str, tuple[StateObject, Group, int, float, _Why]] = {}
        while heap:
            density, _, kind, payload = heapq.heappop(heap)
            if kind == "weights":
                model_id, group, why, offered = payload
                if model_id in self.groups:
                    continue
                model = self.p.models[model_id]
                shards = split_evenly(model.weights_bytes[group.precision], len(group.gpus))
                # staying on its running engine keeps that engine's KV pool and experts
                if self._pools or self._contexts or self._launched_experts:
                    kept, _, _ = self._kept_on(model_id, group.node, group.precision, group.gpus)
                    shards = [a + b for a, b in zip(shards, kept, strict=True)]
                room = self._launch_room(model_id, group.node, group.precision, group.gpus)
                context = self._context_room(model_id, group.node, group.gpus)
                shards = [a + b + x for a, b, x in zip(shards, room, context, strict=True)]
                if offered != self._placed_on[group.node]:
                    # weights were placed on its node since the offer was made: its best group and value may
                    # have changed (lazy greedy: re-offer at the current value; it comes back at once if it
                    # still leads). Placements elsewhere only make other nodes worse.
                    self._push_weights(model, push)
                    continue
                if not self._stay_fits(model_id, group, shards):
                    # its group filled up since: re-offered once, and dropped where its best group is still the
                    # one that cannot hold it (a group search and the fit check that disagree would otherwise
                    # offer it for ever)
                    key = (model_id, group.precision, tuple(g.id for g in group.gpus))
                    if key not in refused:
                        refused.add(key)
                        self._push_weights(model, push)
                    continue
                self._place_weights(model, group, _words(why))
                self._push_followers(model_id, push)
            elif kind == "kv":  # a model's group is set once, before its followers are pushed
                obj, group, nbytes, why = payload
                shards = split_evenly(nbytes, len(group.gpus))
                if self.groups.get(obj.model) is group and self._kv_fits(obj, group, shards):
                    self._place_spread(obj, group, shards)
                    self.reasons[obj] = _words(why)
            else:
                obj, group, nbytes, why = payload
                if self.groups.get(obj.model) is not group:
                    continue
                engine = self.p.nodes[group.node].engine_kind(obj.model) is not None
                if self._place_expert_chunk(obj, group, nbytes):
                    self.reasons[obj] = _words(why)
                    if engine:
                        self._engine_chunks[obj.model].append((nbytes, -density * nbytes, why))
                elif engine and obj.model not in left_out:
                    left_out[obj.model] = (obj, group, nbytes, -density * nbytes, why)
        for chunk in sorted(left_out.values(), key=lambda c: -c[3]):
            self._trade_for(*chunk)

    def _trade_for(self, obj: StateObject, group: Group, nbytes: int, value: float, why: _Why) -> None:
        """Place a chunk of an engine MoE's experts that found no room in place of the last chunks other engine
        MoEs placed on its cards, where those are worth less together. The spend step fills the room by value
        per byte, so a large chunk (1/16 of DeepSeek-V3's routed experts, 38.1 GiB) that comes after many
        small ones of another MoE (GLM-4.5V's, 11.6 GiB) finds no room, though it is worth three of them
        (gap-study engine seed 31; the classic fix of a knapsack filled by value per byte)."""
        if self.now.complete_source(obj, group.node) is None:
            return  # its cards may keep no more than they hold now: no room to make
        held = [self.target.get((obj, self._at[g.id]), 0) for g in group.gpus]
        shares = [b - a for b, a in zip(split_evenly(sum(held) + nbytes, len(group.gpus)), held, strict=True)]
        lack = {g.id: share - self.book.free[g.id] for g, share in zip(group.gpus, shares, strict=True)}
        victims: list[tuple[str, Group]] = []  # one entry per chunk taken back, last placed first
        taken = {m: len(chunks) for m, chunks in self._engine_chunks.items()}
        totals: dict[str, int] = {}  # a victim -> its experts' bytes on its group once those chunks are taken back
        cost = 0.0
        while any(v > 0 for v in lack.values()):
            candidates = [
                (self._engine_chunks[m][taken[m] - 1][1], m)
                for m, other in self.groups.items()
                if m != obj.model
                and taken.get(m)
                and other.node == group.node
                and any(g.id in lack for g in other.gpus)
            ]
            if not candidates:
                return
            worth, victim = min(candidates)
            cost += worth
            if cost >= value:
                return
            other = self.groups[victim]
            if victim not in totals:
                totals[victim] = sum(
                    self.target.get((StateObject.experts(victim), self._at[g.id]), 0) for g in other.gpus
                )
            taken[victim] -= 1
            before = split_evenly(totals[victim], len(other.gpus))
            totals[victim] -= self._engine_chunks[victim][taken[victim]][0]
            after = split_evenly(totals[victim], len(other.gpus))
            for g, was, kept in zip(other.gpus, before, after, strict=True):
                if g.id in lack:
                    lack[g.id] -= was - kept
            victims.append((victim, other))
        for victim, other in victims:
            experts = StateObject.experts(victim)
            size, _, _ = self._engine_chunks[victim].pop()
            now = [self.target.get((experts, self._at[g.id]), 0) for g in other.gpus]
            after = split_evenly(sum(now) - size, len(other.gpus))
            self._place_spread(experts, other, [b - a for b, a in zip(after, now, strict=True)])
            self._experts_placed[victim] -= size
            chunks = self._engine_chunks[victim]
            if chunks:
                self.reasons[experts] = _words(chunks[-1][2])
            else:
                self.reasons.pop(experts, None)
        self._refused_chunk.pop(obj, None)
        if self._place_engine_experts(obj, group, nbytes, True):
            self.reasons[obj] = _words(why)
            self._engine_chunks[obj.model].append((nbytes, value, why))

    def _push_weights(self, model: ModelSpec, push: _Push) -> None:
        """The model's weights on their best group, valued by the cold loads they save."""
        if self._demand(model.id) <= 0:
            return
        best = self._best_group(model, 0)
        if best is None:
            return
        (_, rank, _, _, seconds), group = best
        nbytes = model.weights_bytes[group.precision]
        value, saved = self._warm_value(model, group.gpus, rank, seconds)
        # the expert room it takes from MoE models served on that node
        if not model.is_moe:
            value -= self._expert_loss(group.node, nbytes)
        why = (_KEPT_WARM, (self._demand(model.id), saved, value, nbytes / GIB))
        push(value, nbytes, "weights", (model.id, group, why, self._placed_on[group.node]))

    def _host_room(self, node_id: str) -> int:
        """Bytes of the node's host DRAM free now."""
        room = self._host_free.get(node_id)
        if room is None:
            used = sum(nbytes for (_, loc), nbytes in self.now.on_host.items() if loc.id == node_id)
            room = self._host_free[node_id] = self.p.nodes[node_id].host_bytes - used
        return room

    def _warm_value(
        self, model: ModelSpec, gpus: tuple[Gpu, ...], rank: int, seconds: float, staged: bool = False
    ) -> tuple[float, float]:
        """Objective seconds saved by keeping a model without requests in flight warm on `gpus` (at its
        precision of that `rank`, loaded in `seconds`), and the seconds of the cold load each request is spared.

        Warm, its predicted requests skip the cold load but re-prefill their
        history on `gpus` rather than on the cold load's group, and pay the
        violation penalty where that re-prefill misses their target rather
        than where the cold load and its re-prefill do; the HBM price, the
        load's move_weight and a degraded precision's cost count against it.
        `staged`: a cold load from NVMe reads from host DRAM instead where the
        node has room there (`_prefetch_to_host` may stage it). The joint
        choice holds a node's room for the model only where that pays even
        then; `spend` does not count on it (the room may be gone by then).
        """
        total_w = self._demand(model.id)
        cold = self._cold_load(model)
        saved = cold.seconds if math.isfinite(cold.seconds) else self.c.unserved_penalty_seconds
        if staged and cold.node is not None and cold.precision == model.preferred:
            node = self.p.nodes[cold.node]
            nbytes = model.weights_bytes[cold.precision]
            if _WEIGHTS_OFFLOAD in node.capabilities and self._host_room(cold.node) >= nbytes:
                staged_load = engine_costs.bring_up_seconds(
                    self.p, self.now, model, model.preferred, cold.gpus, _HOST, node, after_leaving=True
                )
                saved = min(saved, staged_load)
        value = total_w * saved
        value -= total_w * self.c.degraded_precision_seconds * (rank > 0)
        value -= costs.gpu_hold_cost(model.weights_bytes[model.precisions[rank]], self.c) + self.c.move_weight * seconds
        per_token, per_pair = self._prefill_rates(model, gpus)
        cold_per_token, cold_per_pair = self._prefill_rates(model, cold.gpus) if cold.gpus else (0.0, 0.0)
        # its predicted requests re-prefill their history on `gpus`, not on the cold load's group; those that
        # miss their target cold (load and re-prefill) but not warm save the violation penalty too
        value -= (per_token - cold_per_token) * self._context_demand[model.id]
        value -= (per_pair - cold_per_pair) * self._pairs_demand[model.id]
        late_cold = (
            self.lateness.weight_late(self.row[model.id], cold_per_token, saved, cold_per_pair)
            * self.c.violation_penalty_seconds
        )
        value += late_cold - self._late_penalty(model.id, per_token, per_pair)
        return value, saved

    def _cold_load(self, model: ModelSpec) -> ColdLoad:
        """`cold_load` from the confirmed placement (the same on every look)."""
        cold = self._cold_loads.get(model.id)
        if cold is None:
            cold = self._cold_loads[model.id] = cold_load(self.p, self.now, model, self.now)
        return cold

    def _push_followers(self, model_id: str, push: _Push) -> None:
        """KV of sessions likely to use the model, and its hot experts, once its weights are placed."""
        model = self.p.models[model_id]
        group = self.groups[model_id]
        node = self.p.nodes[group.node]
        kv_ok_below = _KV_OFFLOAD in node.capabilities
        for sid in sorted(self.now.kv_sessions.get(model_id, ())):
            session = self.p.sessions[sid]
            w = self._weight(sid, model_id)
            if w <= 0 or (session.active and session.model == model_id):
                continue  # not predicted here, or already placed with the active request
            obj = StateObject.kv(model_id, session.id)
            nbytes = self._kv_bytes(session, model)
            if nbytes == 0 or obj in self._pooled or not self._kv_exists(obj, group):
                continue
            without = self._kv_without_seconds(obj, session, model, group, kv_ok_below)
            value = w * without - costs.gpu_hold_cost(nbytes, self.c)
            if without > self.slo_target[self.position[sid]]:  # off GPU the request would miss its target
                value += w * self.c.violation_penalty_seconds
            push(value, nbytes, "kv", (obj, group, nbytes, (_KV_KEPT, (w, without))))
        if model.is_moe:
            self._push_expert_chunks(model, group, push)

    def _kv_without_seconds(
        self, obj: StateObject, session: Session, model: ModelSpec, group: Group, kv_ok_below: bool
    ) -> float:
        """Seconds to ready the session's KV if it is not kept on GPU: restore it from below, or re-prefill.

        KV leaving this node's GPUs is parked in host DRAM by the lower-tier
        step (when the node offloads KV and a restore beats a re-prefill), so
        a copy there counts as restorable as well as one that is there now.
        """
        node = self.p.nodes[group.node]
        tokens = session.context_tokens
        if not kv_ok_below:
            return costs.kv_ready_seconds(tokens, 0, model, group.gpus, _HOST, node, self.c)
        host = self.now.on(obj, group.node, _HOST)
        if (obj, group.node) in self._kv_on_gpus and node.host_bytes > 0:
            host = self.p.size_of(obj)
        nvme = self.now.on(obj, group.node, _NVME)
        source, restorable = (_HOST, host) if host >= nvme else (_NVME, nvme)
        return costs.kv_ready_seconds(tokens, restorable, model, group.gpus, source, node, self.c)

    def _kv_exists(self, obj: StateObject, group: Group) -> bool:
        """KV worth keeping is KV already computed, at the precision the model is served at.

        It must sit where the node can use it: on its GPUs, or below them when the node offloads KV.
        """
        usable = self._kv_held if _KV_OFFLOAD in self.p.nodes[group.node].capabilities else self._kv_on_gpus
        if (obj, group.node) not in usable:
            return False
        current = self.now.serving.get(obj.model)
        return current is None or current.precision == group.precision

    def _push_expert_chunks(self, model: ModelSpec, group: Group, push: _Push) -> None:
        obj = StateObject.experts(model.id)
        demand = self._served_weight(model.id)
        if demand <= 0 or model.id in self._experts_fixed:  # a running engine's expert share stays as launched
            return
        # chunks grow only up to what the node can load: a complete copy below its GPUs, or what they hold now
        shape = self._expert_shape(model, group.node)
        none_on_gpu = costs.decode_slowdown_seconds(model, 0.0, group.gpus, self.c)  # per request
        prefill = self._expert_prefill_seconds(
            model, group.node, sum(map(_H2D, group.gpus))
        )  # the predicted re-prefills' with none on GPU: each byte on GPU saves its share (`_expert_terms`)
        price = self._price - prefill / model.experts_bytes
        for k, nbytes in enumerate(shape.sizes):
            after = none_on_gpu * shape.miss[k + 1]
            saved = demand * none_on_gpu * -shape.gains[k]
            fraction = shape.steps[k + 1] / model.experts_bytes
            why = (_HOT_EXPERTS, (fraction, 1.0 - shape.miss[k + 1], after, demand))
            push(saved - price * nbytes, nbytes, "experts", (obj, group, nbytes, why))
        # chunks are valued in order (concave hit rate), so the heap takes them hottest first

    def _place_expert_chunk(self, obj: StateObject, group: Group, nbytes: int) -> bool:
        """Routed experts may sit on any GPU of the serving node (expert parallel): filled in card order, in whole experts.

        A chunk splits over cards in pieces that divide every chunk where it
        can (so each card holds a whole number of the MILP oracle's expert
        units), else in whole experts; without partial_experts it stays on one
        card. Without a complete copy below the node's GPUs to load from, a
        GPU keeps at most the expert bytes it holds now (nothing could fill more).
        Under a vLLM or SGLang engine the experts are the engine's own: equal
        shares on its group's cards (`_place_engine_experts`).
        """
        refused = self._refused_chunk.get(obj)
        if refused is not None and nbytes >= refused:
            return False  # a chunk this size found no room already, and room only shrinks
        node = group.node
        sourced = self.now.complete_source(obj, node) is not None
        if self.p.nodes[node].engine_kind(obj.model) is not None:
            return self._place_engine_experts(obj, group, nbytes, sourced)
        model = self.p.models[obj.model]
        if _PARTIAL_EXPERTS in self.p.nodes[node].capabilities:
            units: tuple[int, ...] = (self._expert_split_unit(model, node), model.expert_bytes)
        else:
            units = (nbytes,)
        room: list[tuple[int, str]] = []
        fixed = self._fixed_groups[node].get(obj.model)
        for g in (
            [g.id for g in fixed] if fixed else self.book.gpu_ids(node)
        ):  # in card order: of two like cards the first holds at least as much
            free = self._expert_room(obj, g, sourced)
            if free > 0:
                room.append((free, g))
        for unit in units:
            takes: list[tuple[str, int]] = []
            left = nbytes
            for free, g in room:
                if left <= 0:
                    break
                take = left if free >= left else free // unit * unit
                if take > 0:
                    takes.append((g, take))
                    left -= take
            if left <= 0:
                break
        else:
            self._refused_chunk[obj] = nbytes
            return False
        self.book.take_from(node, takes)
        for g, take in takes:
            key = (obj, self._at[g])
            self.target[key] = self.target.get(key, 0) + take
        self._experts_placed[obj.model] += nbytes
        return True

    def _place_engine_experts(self, obj: StateObject, group: Group, nbytes: int, sourced: bool) -> bool:
        """An engine's GPU expert share is one launch setting for its whole group: every tensor-parallel rank
        holds the same bytes of routed experts (domain/engines.py: shard = (weights + GPU experts) / tp), and
        none lie beside the group. So a chunk goes on the group's cards in equal shares, or not at all: each card's
        new share of all the chunks placed so far, less what it holds already."""
        held = [self.target.get((obj, self._at[g.id]), 0) for g in group.gpus]
        total = split_evenly(sum(held) + nbytes, len(group.gpus))
        shards = [after - before for after, before in zip(total, held, strict=True)]
        if any(self._expert_room(obj, g.id, sourced) < share for g, share in zip(group.gpus, shards, strict=True)):
            self._refused_chunk[obj] = nbytes
            return False
        self._place_spread(obj, group, shards)
        self._experts_placed[obj.model] += nbytes
        return True

    def _expert_room(self, obj: StateObject, gpu: str, sourced: bool) -> int:
        """Bytes of `obj`'s experts the GPU may take: its free room, and without a complete copy below the
        node's GPUs to load from, no more than it holds now (nothing could fill more)."""
        free = self.book.free[gpu]
        if not sourced:
            key = (obj, self._at[gpu])
            free = min(free, self.p.residency.get(key, 0) - self.target.get(key, 0))
        return free

    # -- step 3: lower tiers ---------------------------------------------

    def settle_lower_tiers(self) -> None:
        invalid = self._invalidated_kv_models()
        # Keep what is below GPU now, except KV made stale by a precision change.
        kept = copy_placement(self.p.residency)
        for key in self.now.on_gpus:
            del kept[key]
        for key in self.now.kv_entries:
            if key[0].model in invalid:
                kept.pop(key, None)
        self.target.update(kept)
        host_used: dict[str, int] = defaultdict(int)
        for (obj, loc), nbytes in self.now.on_host.items():
            if (obj, loc) in kept:
                host_used[loc.id] += nbytes
        nvme_used: dict[str, int] | None = None  # a pass over every checkpoint on NVMe: made only when needed
        # What leaves the GPUs: keep the last complete copy; park useful KV in host DRAM.
        leaving: dict[tuple[StateObject, str], int] = defaultdict(int)
        for (obj, loc), nbytes in self.now.on_gpus.items():
            lost = nbytes - self.target.get((obj, loc), 0)
            if lost > 0:
                leaving[(obj, self.p.gpus[loc.id].node)] += lost
        for (obj, node_id), nbytes in sorted(leaving.items(), key=lambda kv: (kv[0][0].kind != _WEIGHTS, kv[0])):
            node = self.p.nodes[node_id]
            host, nvme = Location.host(node_id), Location.nvme(node_id)
            if obj.kind is _KV:
                if obj.model in invalid or _KV_OFFLOAD not in node.capabilities:
                    continue
                if obj.model in self.groups and self.target.get((obj, self._at[self.groups[obj.model].gpus[0].id])):
                    continue  # it stays on GPU elsewhere in the group
                have = self.target.get((obj, host), 0)
                if have >= self.p.size_of(obj) or self._kv_host_value(obj, node_id) <= 0:
                    continue
                room = node.host_bytes - host_used[node_id]
                add = min(nbytes, self.p.size_of(obj) - have, room)
                if add > 0:
                    self.target[(obj, host)] = have + add
                    host_used[node_id] += add
                continue
            if self._complete_below(obj, node_id):
                continue
            if (
                obj.model in self.groups
                and self.groups[obj.model].node == node_id
                and self._on_node_gpus(obj, node_id) >= self.p.size_of(obj)
            ):
                continue
            # the GPU copy is the node's last complete one: move it down
            to = (
                host
                if (_WEIGHTS_OFFLOAD in node.capabilities and node.host_bytes - host_used[node_id] >= nbytes)
                else nvme
            )
            if to.tier is _HOST:
                used = host_used
            else:
                if nvme_used is None:
                    nvme_used = _bytes_per_node(kept, _NVME)
                used = nvme_used
            if self.p.capacity_of(to) - used[node_id] < nbytes:
                raise PlanningError(
                    f"nvme capacity: node {node_id} has no room below GPU for the last copy of {obj.label()}"
                )
            self.target[(obj, to)] = self.target.get((obj, to), 0) + nbytes
            used[node_id] += nbytes
        self._prefetch_to_host(host_used)

    def _complete_below(self, obj: StateObject, node: str) -> bool:
        size = self.p.size_of(obj)
        return any(self.target.get((obj, t(node)), 0) >= size for t in (Location.host, Location.nvme))

    def _on_node_gpus(self, obj: StateObject, node_id: str) -> int:
        """Bytes of `obj` the target puts on the node's GPUs."""
        return sum(self.target.get((obj, self._at[g]), 0) for g in self.book.gpu_ids(node_id))

    def _invalidated_kv_models(self) -> set[str]:
        """Models whose serving precision changes: their sessions' KV no longer matches the weights."""
        out = set()
        for model_id, group in self.groups.items():
            current = self.now.serving.get(model_id)
            if current is not None and current.precision != group.precision:
                out.add(model_id)
        return out

    def _kv_host_value(self, obj: StateObject, node: str) -> float:
        model = self.p.models[obj.model]
        assert obj.session is not None  # a KV object
        w = self._weight(obj.session, obj.model)
        group = self.groups.get(obj.model)
        gpus = group.gpus if group else self._cold_group(model, model.preferred, node)
        if not gpus:
            return 0.0
        tokens = self.p.sessions[obj.session].context_tokens
        prefill = _reprefill(tokens, *self._prefill_rates(model, gpus))
        restore = costs.kv_ready_seconds(tokens, self.p.size_of(obj), model, gpus, _HOST, self.p.nodes[node], self.c)
        return w * (prefill - restore)

    def _prefetch_to_host(self, host_used: dict[str, int]) -> None:
        """Stage likely next models in host DRAM on the node a cold load would use."""
        waiting = [m for m in sorted(self.p.models) if m not in self.groups and self._demand(m) > 0]
        if not waiting:
            return
        index = ResidencyIndex.below_gpu(self.p, self.target)  # cold loads read copies below GPU only
        candidates = []
        staged: dict[StateObject, str] = {}
        for model_id in waiting:
            model = self.p.models[model_id]
            obj = StateObject.weights(model_id, model.preferred)
            cold = cold_load(self.p, index, model, self.now)
            if cold.node is None or cold.precision != model.preferred:
                continue
            node = self.p.nodes[cold.node]
            if _WEIGHTS_OFFLOAD not in node.capabilities or index.complete(obj, cold.node, _HOST):
                continue
            nbytes = model.weights_bytes[model.preferred]
            from_host = engine_costs.bring_up_seconds(
                self.p, self.now, model, model.preferred, cold.gpus, _HOST, node, after_leaving=True
            )
            saved = self._demand(model_id) * (cold.seconds - from_host)
            stage = nbytes / node.nvme_read_bytes_per_s * self.c.move_weight
            if saved - stage > 0:
                candidates.append((-(saved - stage) / nbytes, model_id, obj, cold.node, nbytes))
                staged[obj] = (
                    f"staged in host DRAM: a load from here takes {from_host:.1f} s instead of {cold.seconds:.1f} s "
                    f"from NVMe, for {self._demand(model_id):.2f} SLO-weighted predicted requests"
                )
        for _, _, obj, node_id, nbytes in sorted(candidates):
            have = self.target.get((obj, Location.host(node_id)), 0)
            if self.p.nodes[node_id].host_bytes - host_used[node_id] >= nbytes - have:
                self.target[(obj, Location.host(node_id))] = nbytes
                host_used[node_id] += nbytes - have
                self.reasons[obj] = staged[obj]

    # -- all together -----------------------------------------------------

    def plan(self) -> TargetPlan:
        self.serve_active()
        self.spend()
        self.settle_lower_tiers()
        if min(self.target.values(), default=1) > 0:
            placement = copy_placement(self.target)
        else:
            placement = {k: v for k, v in self.target.items() if v > 0}
        return TargetPlan(placement, dict(self.groups), dict(self.unserved), dict(self.reasons), self.now, self.demand)


def _reprefill(tokens: int, per_token: float, per_pair: float) -> float:
    """Seconds to re-prefill a history of `tokens` from scratch (`costs.prefill_seconds`)."""
    return tokens * per_token + costs.causal_pairs(tokens, 0) * per_pair


def _bytes_per_node(placement: Mapping[tuple[StateObject, Location], int], tier: Tier) -> dict[str, int]:
    used: dict[str, int] = defaultdict(int)
    for (_, loc), nbytes in placement.items():
        if loc.tier is tier:
            used[loc.id] += nbytes
    return used


# What the spend step offers for, as (template, numbers): most offers are never taken, so the words are
# made only for those that are.
_KEPT_WARM = (
    "kept warm: {:.2f} SLO-weighted predicted requests would each wait {:.1f} s for a cold load; "
    "saves {:.1f} s net of the {:.1f} GiB HBM price"
)
_KV_KEPT = "kept on GPU: spares {:.2f} SLO-weighted predicted requests {:.1f} s of KV restore or re-prefill"
_HOT_EXPERTS = (
    "hot experts on GPU up to {:.0%} of all routed experts (hit rate {:.0%}): MoE decode slowdown {:.1f} s "
    "per request for {:.2f} SLO-weighted requests"
)


def _words(why: _Why) -> str:
    template, numbers = why
    return template.format(*numbers)


def plan_greedy(
    problem: Problem, nodes: Mapping[str, str] | None = None, precisions: Mapping[str, str] | None = None
) -> TargetPlan:
    """The greedy's plan. Where the joint choice kept a model on a few of a node's cards that the models it
    put beside it want too (`GreedyPlanner.narrowing`), the greedy also plans with those staying models free
    to leave their cards, and returns the plan whose objective is lower: the choice's estimate can price the
    staying model's move dearer than the room its cards leave the others, whose groups then lack it
    (gap-study engine seed 31: a Qwen2.5-7B's engine kept on one of four A100s left GLM-4.5V three, where the
    oracle moves the 7B and gives GLM-4.5V four; seed 6: a Llama-3.3-70B on three cards beside a 7B)."""
    planner = GreedyPlanner(problem, nodes, precisions)
    target = planner.plan()
    narrowing = planner.narrowing()
    if not narrowing:
        return target
    other = GreedyPlanner(problem, nodes, precisions, leave=narrowing).plan()
    return other if _objective(problem, other) < _objective(problem, target) else target


def _objective(problem: Problem, target: TargetPlan) -> float:
    """The objective of the plan that reaches `target` (`plan.make_plan`'s, without its operations)."""
    placement = engine_target(problem, target.placement, confirmed_states(problem)).placement
    objective, _ = evaluate(problem, placement, target.now, ResidencyIndex.build(problem, placement), target.demand)
    return objective.total


def demand_by_model(problem: Problem) -> Mapping[str, float]:
    """Total SLO-weighted probability of the next request, per model (for explanations)."""
    out: dict[str, float] = defaultdict(float)
    for sid, row in problem.next_model.items():
        session = problem.sessions.get(sid)
        if session is None:
            continue
        for model, q in row.items():
            out[model] += problem.constants.slo_weights.of(session.slo) * q
    return dict(out)
