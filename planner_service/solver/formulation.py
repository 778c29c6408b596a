"""The MILP oracle's model, built from a `Problem` with no solver attached.

Pure Python and numpy: every coefficient is priced with the evaluator's own
functions (`objective.py`, `costs.py`), so for any assignment the model's
value equals `objective.evaluate` of the placement it decodes to, up to the
lower-tier approximation stated in `planner_service/solver/milp.py`. The
formulation itself (sets, variables, constraints, objective) is written out
in that module's docstring; the comments here name the family each row
belongs to.

Everything is integer: binaries, expert units per GPU and promoted expert
MiB. Constraint coefficients are whole bytes, so CP-SAT can take the rows as
they are; only objective coefficients are floats (seconds).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from planner_service.domain.engines import EngineState, Transition, may, tensor_parallel_ok
from planner_service.domain.problem import Gpu, ModelSpec, Problem, Session
from planner_service.domain.scenario import Capability
from planner_service.domain.state import Location, Placement, StateObject, Tier
from planner_service.domain.units import MIB
from planner_service.planner import costs, engine_holdings, engine_instances
from planner_service.planner.errors import PlanningError
from planner_service.planner.greedy import EXPERT_CHUNKS, GreedyPlanner, Group, TargetPlan, split_evenly
from planner_service.planner.objective import _arrival_latency, cold_load, expert_share, kv_ready, promote_seconds
from planner_service.planner.residency import ResidencyIndex, Serving
from planner_service.solver.backends import IntModel

# seconds per unit of a `PrefillOverlap`'s variable (the model's rows take integer coefficients): the model
# prices a request both its KV and its experts on GPU spare to within half of one
PREFILL_STEP = 0.001
MAX_SUBSET_GPUS = 4  # nodes with at most this many GPUs offer every subset as a group; larger ones offer windows


# -- what the variables stand for -------------------------------------------


@dataclass(frozen=True, slots=True)
class Option:
    """One way to serve a model: its weights at `precision`, split evenly over `gpus` of `node`."""

    var: int
    model: str
    node: str
    precision: str
    gpus: tuple[Gpu, ...]
    shards: tuple[int, ...]
    decode_class: int  # options on a node with the same sum of h2d bandwidth decode alike
    # the running engine instance of a vLLM / SGLang node, kept as launched: its KV pool and GPU expert share
    # per GPU of `gpus` are fixed (DESIGN.md §5); both are () for every other option but a sleeping instance
    # woken as it is, whose pool its node reported (engine_holdings.woken_pools): that pool is fixed (its expert
    # share, where reported, is its one w: `_engine_experts`)
    launched: bool = False
    kv_pool: tuple[int, ...] = ()
    experts: tuple[int, ...] = ()

    def group(self) -> Group:
        return Group(self.node, self.precision, self.gpus)


@dataclass(frozen=True, slots=True)
class KvChoice:
    var: int
    session: str
    option: Option
    nbytes: int


@dataclass(frozen=True, slots=True)
class ExpertCombo:
    """`regular` chunks plus (`last` = 1) the short tail chunk of a MoE's routed experts on the node's GPUs."""

    var: int
    model: str
    node: str
    decode_class: int
    regular: int
    last: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class EngineExperts:
    """`nbytes` of a MoE's routed experts on the GPUs of `option`, in equal shares: under a vLLM or SGLang
    engine the GPU expert share is one launch setting of the instance (domain/engines.py)."""

    var: int
    option: Option
    nbytes: int


@dataclass(frozen=True, slots=True)
class PrefillOverlap:
    """What a predicted request's KV on the GPUs (`kv`) and its MoE's experts there (`fractions`: expert variable
    -> the request's prefill seconds they save, in `PREFILL_STEP`s) both claim to save: its prefill happens
    once, so `var` >= sum saved * y - most * (1 - sum kv) takes the second claim back."""

    var: int
    kv: tuple[int, ...]  # the request's KV on one of the options the expert variables serve (one at most chosen)
    fractions: dict[int, int]
    most: int


@dataclass(frozen=True, slots=True)
class KvPool:
    """The room of a new engine's KV pool on one GPU beyond the sessions' KV chosen there: `var` MiB, so that
    the pool takes max(its minimum, the KV) (engines.launch_kv_pool_bytes_per_gpu)."""

    var: int
    option: Option
    gpu: str
    pool_bytes: int


@dataclass
class Formulation:
    problem: Problem
    ilp: IntModel
    options: dict[str, list[Option]]
    off: dict[str, int]  # model -> 1 when no GPU group serves it
    kv: dict[tuple[str, str], list[KvChoice]]  # (model, session) -> one choice per option that may hold it
    combos: list[ExpertCombo]
    expert_vars: dict[tuple[str, str], tuple[int, int]]  # (model, gpu) -> (var, unit): units of routed experts there
    engine_experts: list[EngineExperts]  # on engine nodes, in place of combos and expert_vars
    gain_vars: dict[tuple[str, str], int]  # (model, gpu) -> MiB of experts promoted there
    pools: list[KvPool]
    overlaps: list[PrefillOverlap]
    lower: ResidencyIndex  # lower tiers when no model is on GPU (the approximation)
    unavoidable: float  # sum over models of their best cost with unlimited HBM: a lower bound of every plan

    def hint(self, target: TargetPlan) -> list[int]:
        """The assignment that reproduces the greedy's target GPU placement, as far as the model can express it."""
        values = [0] * len(self.ilp.names)
        chosen: dict[str, Option] = {}
        for model_id, options in self.options.items():
            group = target.groups.get(model_id)
            match = next(
                (
                    o
                    for o in options
                    if group and (o.node, o.precision, _ids(o.gpus)) == (group.node, group.precision, _ids(group.gpus))
                ),
                None,
            )
            if match is None:
                values[self.off[model_id]] = 1
            else:
                values[match.var] = 1
                chosen[model_id] = match
        gpu_bytes: dict[tuple[StateObject, str], int] = defaultdict(int)
        for (obj, loc), nbytes in target.placement.items():
            if loc.tier is Tier.GPU:
                gpu_bytes[(obj, loc.id)] += nbytes
        for (model_id, sid), choices in self.kv.items():
            for choice in choices:
                if chosen.get(model_id) is choice.option:
                    obj = StateObject.kv(model_id, sid)
                    values[choice.var] = int(
                        sum(gpu_bytes.get((obj, g.id), 0) for g in choice.option.gpus) >= choice.nbytes
                    )
        for pool in self.pools:
            if chosen.get(pool.option.model) is pool.option:
                kv = sum(
                    b
                    for (model_id, _), choices in self.kv.items()
                    for ch in choices
                    if ch.option is pool.option and values[ch.var]
                    for g, b in zip(ch.option.gpus, split_evenly(ch.nbytes, len(ch.option.gpus)), strict=True)
                    if g.id == pool.gpu
                )
                values[pool.var] = -(-max(0, pool.pool_bytes - kv) // MIB)
        for (model_id, gpu_id), (var, unit) in self.expert_vars.items():
            if (
                (option := chosen.get(model_id)) is not None
                and option.launched
                and option.node == self.problem.gpus[gpu_id].node
            ):
                continue  # a launched engine keeps its share: no v, no y
            values[var] = min(gpu_bytes.get((StateObject.experts(model_id), gpu_id), 0) // unit, self.ilp.ub[var])
            now = self.problem.residency.get((StateObject.experts(model_id), Location.gpu(gpu_id)), 0)
            values[self.gain_vars[(model_id, gpu_id)]] = -(-max(0, values[var] * unit - now) // MIB)
        for fraction in self.engine_experts:
            on = fraction.option
            if chosen.get(on.model) is not on:
                continue
            experts = StateObject.experts(on.model)
            shares = [gpu_bytes.get((experts, g.id), 0) for g in on.gpus]
            if shares != split_evenly(fraction.nbytes, len(on.gpus)):
                continue
            values[fraction.var] = 1
            for g, b in zip(on.gpus, shares, strict=True):
                was = self.problem.residency.get((experts, Location.gpu(g.id)), 0)
                values[self.gain_vars[(on.model, g.id)]] = -(-max(0, b - was) // MIB)
        for combo in self.combos:
            option = chosen.get(combo.model)
            if (
                option is None
                or option.launched
                or (option.node, option.decode_class) != (combo.node, combo.decode_class)
            ):
                continue
            held = sum(
                gpu_bytes.get((StateObject.experts(combo.model), g), 0) for g in self.problem.nodes[combo.node].gpus
            )
            values[combo.var] = int(held == combo.nbytes)
        for overlap in self.overlaps:
            saved = sum(d * values[v] for v, d in overlap.fractions.items())
            kept = sum(values[k] for k in overlap.kv)
            values[overlap.var] = max(0, saved - overlap.most * (1 - kept))
        return values


def _ids(gpus: Sequence[Gpu]) -> tuple[str, ...]:
    return tuple(g.id for g in gpus)


# -- building ---------------------------------------------------------------


def build_formulation(
    problem: Problem, extra_groups: Mapping[str, Group] | None = None, *, symmetry: bool = True
) -> Formulation:
    """The model over every candidate group (plus `extra_groups`, e.g. the greedy's, so its plan is a solution)."""
    return _Builder(problem, extra_groups or {}, symmetry).build()


class _Builder:
    def __init__(self, problem: Problem, extra_groups: Mapping[str, Group], symmetry: bool) -> None:
        self.p = problem
        self.symmetry = symmetry
        self.c = problem.constants
        self.extra = extra_groups
        self.now = ResidencyIndex.build(problem, problem.residency)
        self.lower = lower_tiers_with_gpus_empty(problem)
        self.ilp = IntModel()
        self.options: dict[str, list[Option]] = {}
        self.off: dict[str, int] = {}
        self.kv: dict[tuple[str, str], list[KvChoice]] = {}
        self.combos: list[ExpertCombo] = []
        self.expert_vars: dict[tuple[str, str], tuple[int, int]] = {}
        self.engine_experts: list[EngineExperts] = []
        self.gain_vars: dict[tuple[str, str], int] = {}
        self.pools: list[KvPool] = []
        self.overlaps: list[PrefillOverlap] = []
        # option var -> a MoE's predicted requests' seconds at expert shares 0 and 1 there, and their pricing
        self.prefill_ends: dict[int, tuple[np.ndarray, np.ndarray, Callable[[np.ndarray], np.ndarray]]] = {}
        # engine instances on vLLM / SGLang nodes as they are now (planner/engine_instances.py)
        self.states = engine_instances.confirmed_states(problem)
        self.launched_pools = engine_holdings.launched_pools(problem, self.states)
        # (node, model) -> the pool a sleeping engine's node reported: its wake as it is maps that pool back
        self.woken_pools = {
            key: problem.engine_pools[key]
            for key, view in self.states.items()
            if view.state in (EngineState.ASLEEP_HOST, EngineState.ASLEEP_DISCARDED) and key in problem.engine_pools
        }
        # (node, model) -> the routed-expert bytes a sleeping MoE engine was launched with, whose node reported
        # its share: its wake as it is maps them back (engine_holdings.launched_experts)
        self.woken_experts = {
            key: sum(held.values())
            for key, (_, _, held) in engine_holdings.launched_experts(problem, self.states).items()
            if self.states[key].state in (EngineState.ASLEEP_HOST, EngineState.ASLEEP_DISCARDED)
        }
        self.pinned = engine_instances.immovable(problem)  # model -> (node, precision): running, cannot leave
        self.gpu_terms: dict[str, dict[int, int]] = {g: defaultdict(int) for g in problem.gpus}
        self.model_gpu_terms: dict[tuple[str, str], dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.unavoidable = 0.0
        self.demand = self._demand()
        self.active: dict[str, list[Session]] = defaultdict(list)
        for s in sorted(problem.sessions.values(), key=lambda s: s.id):
            if s.active:
                self.active[s.model].append(s)

    def _demand(self) -> dict[str, list[tuple[Session, float]]]:
        """model -> [(session, probability of its next request there)], q > 0, in session order."""
        out: dict[str, list[tuple[Session, float]]] = defaultdict(list)
        for sid in sorted(self.p.next_model):
            session = self.p.sessions.get(sid)
            if session is None:
                continue
            for model_id, q in sorted(self.p.next_model[sid].items()):
                if q > 0 and model_id in self.p.models:
                    out[model_id].append((session, q))
        return out

    def build(self) -> Formulation:
        for model_id in sorted(self.p.models):
            self._model(self.p.models[model_id])
        # (C10) an engine that keeps its context (adopted, or asleep: engine_holdings.keeps_context)
        # holds it on every GPU of its group until woken: R * (1 - x_{m,o_inst})
        residue = self._residue()
        # (C1) HBM capacity of every GPU: weights shards + KV shards (or a launched engine's pool) + expert bytes
        # + the contexts of the engines running (C13) + the residue of those engines left asleep
        for gpu_id, terms in sorted(self.gpu_terms.items()):
            self.ilp.row(terms, hi=self.p.gpus[gpu_id].capacity_bytes - residue.get(gpu_id, 0))
        # (C9) one model's bytes on a GPU fit the card only while a group of that node serves the model: implied
        # by C1-C7 for integer values, it keeps the LP from spreading a fractional model's experts and KV over
        # whole cards (an optional row: the "plain" CBC variant drops it)
        for (model_id, gpu_id), terms in sorted(self.model_gpu_terms.items()):
            gpu = self.p.gpus[gpu_id]
            row = defaultdict(int, terms)
            for o in self.options[model_id]:
                if o.node == gpu.node:
                    row[o.var] -= gpu.capacity_bytes
            self.ilp.row(row, hi=0, optional=True)
        # (C8) symmetry: of two interchangeable GPUs (same node and card, nothing on either now), the first holds more
        if self.symmetry:
            for a, b in _interchangeable_pairs(self.p, self.now, self.states):
                difference = defaultdict(int, self.gpu_terms[a])
                for i, c in self.gpu_terms[b].items():
                    difference[i] -= c
                self.ilp.row(difference, lo=0)
        return Formulation(
            self.p,
            self.ilp,
            self.options,
            self.off,
            self.kv,
            self.combos,
            self.expert_vars,
            self.engine_experts,
            self.gain_vars,
            self.pools,
            self.overlaps,
            self.lower,
            self.unavoidable,
        )

    # -- one model ------------------------------------------------------------

    def _model(self, model: ModelSpec) -> None:
        c = self.c
        demand = self.demand.get(model.id, [])
        sessions = [s for s, _ in demand]
        q = np.array([q for _, q in demand], dtype=float)
        weight = np.array([c.slo_weights.of(s.slo) for s in sessions], dtype=float)
        wq = weight * q
        target = np.array([c.slo_targets_seconds.of(s.slo) for s in sessions], dtype=float)
        context = np.array([s.context_tokens for s in sessions], dtype=float)
        position = {s.id: i for i, s in enumerate(sessions)}
        active = self.active.get(model.id, [])
        active_weight = sum(c.slo_weights.of(s.slo) for s in active)

        def request_costs(latency: np.ndarray) -> np.ndarray:
            """Each predicted request's w*q*(latency + V*[latency > target]), as the evaluator sums them."""
            seconds: np.ndarray = wq * (latency + c.violation_penalty_seconds * (latency > target))
            return seconds

        holders_low = self.lower.kv_sessions.get(model.id, set())
        # -- x_off: no group serves the model; its requests cold-load from the lower tiers
        cold = cold_load(self.p, self.lower, model, self.now)
        if cold.node is None:
            latency = np.full(len(sessions), c.unserved_penalty_seconds)
            slowdown = 0.0
        else:
            share = self._plan_share(model, cold.node, 0.0)  # the plan puts none of its experts on GPU
            kv = self._predicted_kv(model, cold.node, cold.gpus, share, context, position, holders_low)
            latency = cold.seconds + kv
            slowdown = costs.decode_slowdown_seconds(model, 0.0, cold.gpus, c)
        off_cost = float(request_costs(latency).sum()) + float(wq.sum()) * slowdown
        off_cost += c.unserved_penalty_seconds * active_weight  # (every active request waits)
        self.off[model.id] = self.ilp.var(f"off[{model.id}]", cost=off_cost)
        best = off_cost

        options = self._options(model)
        self.options[model.id] = options
        # (C2) one choice per model: a group at a precision, or off
        self.ilp.row({self.off[model.id]: 1, **{o.var: 1 for o in options}}, lo=1, hi=1)

        served_weight = float(wq.sum()) + active_weight  # requests that decode on the serving group
        current = self.now.serving.get(model.id)
        holders_now = self.now.kv_sessions.get(model.id, set())
        by_class: dict[tuple[str, int], list[Option]] = defaultdict(list)
        if model.id in self.pinned:
            # (C2') an adopted engine launched without sleep mode cannot leave its GPUs: its instance is chosen
            pinned = [o.var for o in options if o.launched]
            if pinned:
                self.ilp.row({pinned[0]: 1}, lo=1, hi=1)
        for o in options:
            if not o.launched:  # a launched engine's expert share is fixed: it takes no y
                by_class[(o.node, o.decode_class)].append(o)
            obj = StateObject.weights(model.id, o.precision)
            degraded = c.degraded_precision_seconds * (o.precision != model.preferred)
            cost = 0.0
            # weights: the warm memory tax and the seconds spent promoting shards (the evaluator's move price)
            cost += costs.gpu_hold_cost(model.weights_bytes[o.precision], c)
            shard_target = {(obj, Location.gpu(g.id)): b for g, b in zip(o.gpus, o.shards, strict=True) if b}
            cost += c.move_weight * promote_seconds(self.p, self.now, shard_target)
            for g, shard in zip(o.gpus, o.shards, strict=True):
                if shard:
                    self.gpu_terms[g.id][o.var] += shard
                    self.model_gpu_terms[(model.id, g.id)][o.var] += shard
            if engine_instances.engine_of(self.p, o.node, model.id) is not None:
                # (C13) the instance's CUDA context on each of its GPUs, beside its shard and pool
                for g in o.gpus:
                    self.gpu_terms[g.id][o.var] += engine_instances.ENGINE_CONSTANTS.context_bytes_per_gpu
            if not o.launched and o.kv_pool:
                # (C11w) a woken engine maps its reported pool back whole on each of its GPUs
                for g, pool in zip(o.gpus, o.kv_pool, strict=True):
                    self.gpu_terms[g.id][o.var] += pool
                    self.model_gpu_terms[(model.id, g.id)][o.var] += pool
            if o.launched:
                # (C11) a launched engine keeps its KV pool and its GPU expert share on each of its GPUs; the
                # warm tax is the evaluator's, on the bytes placed: the experts here, the KV on its k below
                cost += costs.gpu_hold_cost(sum(o.experts), c)
                for g, pool, experts in zip(o.gpus, o.kv_pool, o.experts, strict=True):
                    self.gpu_terms[g.id][o.var] += pool + experts
                    self.model_gpu_terms[(model.id, g.id)][o.var] += pool + experts
            # requests in flight: the time to bring their state from C to T, charged on k below (without
            # its KV beside the weights the request waits instead)
            then = ResidencyIndex(
                self.p, {(obj, Location.gpu(g.id)): b for g, b in zip(o.gpus, o.shards, strict=True) if b}
            )
            serving = Serving(o.node, o.precision, o.gpus)
            now_share = expert_share(self.now, model, o.node)  # requests in flight prefill at the share now
            arrival_cost = {}
            for s in active:
                w = c.slo_weights.of(s.slo)
                arrival = _arrival_latency(self.p, self.now, then, model, s.id, serving, now_share)
                arrival_cost[s.id] = w * (
                    arrival + c.violation_penalty_seconds * (arrival > c.slo_targets_seconds.of(s.slo)) + degraded
                )
            # predicted requests: weights ready; KV ready from the lower tiers unless k puts it on GPU; a MoE's
            # prefill at the plan's expert share: a launched engine's, else none here, what its expert
            # variables add changing their cost (`_prefill_gain`)
            invalidated = current is not None and current.precision != o.precision
            restorable = set() if invalidated else holders_low
            launched_share = sum(o.experts) / model.experts_bytes if o.launched and model.is_moe else 0.0
            share = self._plan_share(model, o.node, launched_share)
            kv = self._predicted_kv(model, o.node, o.gpus, share, context, position, restorable)
            if model.is_moe and not o.launched:
                every = self._predicted_kv(model, o.node, o.gpus, (1.0, share[1]), context, position, restorable)
                self.prefill_ends[o.var] = (kv, every, request_costs)
            without_kv = request_costs(kv)
            cost += float(without_kv.sum()) + float(wq.sum()) * degraded
            fraction = sum(o.experts) / model.experts_bytes if o.launched and model.experts_bytes else 0.0
            cost += served_weight * costs.decode_slowdown_seconds(model, fraction, o.gpus, c)
            self.ilp.cost[o.var] += cost
            relaxed = cost
            # k: KV of a session on this group's GPUs (whole, split evenly)
            candidates = [(s, True) for s in active] + [
                (s, False)
                for s in sessions
                if s.id in holders_now
                and not (s.active and s.model == model.id)
                and not invalidated
                and self._kv_on_node(model.id, s.id, o.node)
            ]
            pool_terms: dict[str, dict[int, int]] = defaultdict(dict)  # an engine option's KV, per GPU
            # a new engine's pool is at least one request of the model's maximum context (engine_holdings)
            least = (
                engine_holdings.min_pool_bytes_per_gpu(self.p, model.id, len(o.gpus))
                if not o.kv_pool and engine_instances.engine_of(self.p, o.node, model.id) is not None
                else 0
            )
            for s, is_active in candidates:
                nbytes = s.context_tokens * model.kv_bytes_per_token
                saved = float(without_kv[position[s.id]]) if s.id in position else 0.0
                k_cost = costs.gpu_hold_cost(nbytes, c) - saved
                if is_active:
                    # (C3) an active request whose KV is not on the serving GPUs waits: the unserved penalty
                    unserved = c.unserved_penalty_seconds * c.slo_weights.of(s.slo)
                    self.ilp.cost[o.var] += unserved
                    relaxed += unserved
                    k_cost += arrival_cost[s.id] - unserved
                elif nbytes == 0:
                    continue  # nothing to hold
                var = self.ilp.var(f"k[{model.id},{s.id},{o.var}]", cost=k_cost)
                # (C4) KV only on the GPUs of the chosen group
                self.ilp.row({var: 1, o.var: -1}, hi=0)
                for g, b in zip(o.gpus, split_evenly(nbytes, len(o.gpus)), strict=True):
                    if b and (o.kv_pool or least):
                        pool_terms[g.id][var] = b  # a new engine's: on the GPUs once its pool is known
                    elif b:
                        self.gpu_terms[g.id][var] += b
                        self.model_gpu_terms[(model.id, g.id)][var] += b
                self.kv.setdefault((model.id, s.id), []).append(KvChoice(var, s.id, o, nbytes))
                relaxed += min(0.0, k_cost)
            if o.kv_pool:
                self._pool_rows(o, pool_terms)
            elif least:
                self._min_pool_rows(o, pool_terms, least)
            o_best = relaxed + (
                self._best_combo_cost(model, o, served_weight) if model.is_moe and not o.launched else 0.0
            )
            best = min(best, o_best)
        if model.is_moe:
            self._experts(model, by_class, served_weight)
        self.unavoidable += best

    def _plan_share(self, model: ModelSpec, node: str, fraction: float) -> tuple[float, bool]:
        """`expert_share` of a MoE with `fraction` of its experts on the node's GPUs in the plan (its host DRAM's
        copy as now); a dense model's."""
        now = expert_share(self.now, model, node)
        return (fraction, now[1]) if model.is_moe else now

    def _predicted_kv(
        self,
        model: ModelSpec,
        node: str,
        gpus: Sequence[Gpu],
        share: tuple[float, bool],
        context: np.ndarray,
        position: Mapping[str, int],
        holders: Collection[str],
    ) -> np.ndarray:
        """Seconds to ready each predicted request's KV on `gpus` of the node with nothing of it there: restored
        from the lower tiers for `holders`, else re-prefilled, a MoE at expert share `share` (`kv_ready`)."""
        c = self.c
        kv: np.ndarray = (
            context * costs.prefill_seconds_per_token(model, gpus, c)
            + costs.causal_pairs(context, 0) * costs.attention_seconds_per_pair(model, gpus, c)
            + costs.expert_prefill_seconds_many(
                context, *costs.expert_prefill_rates(model, share[0], gpus, c, share[1])
            )
        )
        for sid in holders:
            if sid in position:
                kv[position[sid]] = kv_ready(self.p, self.lower, model, sid, node, tuple(gpus), 0, share)
        return kv

    def _residue(self) -> dict[str, int]:
        """GPU -> bytes of the contexts of engines that keep theirs (`engine_holdings.keeps_context`) when none of
        them wakes; the wake's x is put into gpu_terms with -R, so the row reads used + R * (1 - x) <= cap. Any
        other engine stops instead where its context does not fit (engine_targets.sleep_or_stop): it needs no row."""
        out: dict[str, int] = defaultdict(int)
        for (node, model_id), view in sorted(self.states.items()):
            if not engine_holdings.keeps_context(view) or model_id in self.pinned:
                continue  # (one asleep at an unknown precision keeps its context too: no wake option matches it)
            asleep = engine_instances.InstanceView(
                node, model_id, view.declared, EngineState.ASLEEP_DISCARDED, view.precision, view.gpus
            )
            bytes_per_gpu = engine_holdings.residue_bytes(self.p, asleep)
            wake = next((o for o in self.options.get(model_id, []) if self._is_instance(o, view)), None)
            for g in view.gpus:
                out[g] += bytes_per_gpu
                if wake is not None:
                    self.gpu_terms[g][wake.var] -= bytes_per_gpu
        return out

    @staticmethod
    def _is_instance(o: Option, view: engine_instances.InstanceView) -> bool:
        return (o.node, o.precision, tuple(sorted(_ids(o.gpus)))) == (view.node, view.precision, tuple(view.gpus))

    def _offered(self, model_id: str, node_id: str, precision: str, group: Sequence[Gpu]) -> bool:
        """Whether the node's engine of the model can come to run on `group` at `precision` from its state now
        (engines.may: no start, restart or stop of an adopted engine; a wake keeps the instance)."""
        view = self.states.get((node_id, model_id))
        if view is None or engine_instances.engine_of(self.p, node_id, model_id) is None:
            return True
        ids = tuple(sorted(_ids(group)))
        running = engine_instances.InstanceView(
            node_id, model_id, view.declared, EngineState.RUNNING, precision, ids
        )  # fmt: skip
        transition = engine_instances.transition_between(view, running)
        if transition is None:
            return True
        subject = view if transition is Transition.WAKE else running
        inst = engine_instances.instance_from_ref(self.p, engine_instances.instance_ref(self.p, subject))
        return may(inst, view.state, transition).allowed

    def _launched(self, model: ModelSpec, node_id: str, precision: str, group: Sequence[Gpu]) -> bool:
        """Whether `group` at `precision` is the model's engine running on a vLLM / SGLang node now."""
        view = self.states.get((node_id, model.id))
        return (
            view is not None
            and engine_instances.engine_of(self.p, node_id, model.id) is not None
            and view.state is EngineState.RUNNING
            and (view.precision, view.gpus) == (precision, tuple(sorted(_ids(group))))
        )

    def _asleep_as(self, model: ModelSpec, node_id: str, precision: str, group: Sequence[Gpu]) -> bool:
        """Whether `group` at `precision` is the model's sleeping engine on a vLLM / SGLang node: a wake."""
        view = self.states.get((node_id, model.id))
        return (
            view is not None
            and engine_instances.engine_of(self.p, node_id, model.id) is not None
            and view.state in (EngineState.ASLEEP_HOST, EngineState.ASLEEP_DISCARDED)
            and (view.precision, view.gpus) == (precision, tuple(sorted(_ids(group))))
        )

    def _pool_rows(self, o: Option, pool_terms: Mapping[str, Mapping[int, int]]) -> None:
        """A launched or woken engine's pool is fixed: the sessions' KV chosen on each GPU stays within it (its
        room is held by C11 or C11w; the engine's LRU keeps the rest out)."""
        for g, pool in zip(o.gpus, o.kv_pool, strict=True):
            terms = pool_terms.get(g.id, {})
            if terms:
                # (C12) sum_s kvshard_{s,g} k_{m,s,o} <= pool_g x_{m,o}
                self.ilp.row({o.var: -pool, **terms}, hi=0)

    def _min_pool_rows(self, o: Option, pool_terms: Mapping[str, Mapping[int, int]], least: int) -> None:
        """A new engine's pool takes max(its minimum, the sessions' KV chosen) on each GPU. Where all the KV it
        may hold fits in the minimum, that is the minimum whenever the option is chosen (no variable); else z
        MiB of room beyond the KV, one for the group (the KV splits evenly: its shards differ by a byte)."""
        most = max((sum(terms.values()) for terms in pool_terms.values()), default=0)
        if most <= least:
            for g in o.gpus:
                self.gpu_terms[g.id][o.var] += least
                self.model_gpu_terms[(o.model, g.id)][o.var] += least
            return
        for g in o.gpus:
            for var, b in pool_terms.get(g.id, {}).items():
                self.gpu_terms[g.id][var] += b
                self.model_gpu_terms[(o.model, g.id)][var] += b
        least_mib = -(-least // MIB)
        z = self.ilp.var(f"z[{o.model},{o.var}]", ub=least_mib)
        first = o.gpus[0]  # split_evenly puts the larger shards first
        self.pools.append(KvPool(z, o, first.id, least))
        for g in o.gpus:
            self.gpu_terms[g.id][z] += MIB
            self.model_gpu_terms[(o.model, g.id)][z] += MIB
        # (C12') MiB * z + sum_s kvshard_{s,g0} k_{m,s,o} >= pool_min x_{m,o};  z only with x_{m,o}
        self.ilp.row({z: MIB, o.var: -least, **pool_terms.get(first.id, {})}, lo=0)
        self.ilp.row({z: 1, o.var: -least_mib}, hi=0)

    def _kv_on_node(self, model: str, session: str, node: str) -> bool:
        obj = StateObject.kv(model, session)
        return any(self.now.on(obj, node, t) for t in Tier)

    # -- candidate groups ---------------------------------------------------

    def _options(self, model: ModelSpec) -> list[Option]:
        out: list[Option] = []
        seen: set[tuple[str, str, tuple[str, ...]]] = set()
        current = self.now.serving.get(model.id)
        extra = self.extra.get(model.id)
        classes: dict[tuple[str, float], int] = {}  # (node, sum of h2d) -> decode class, shared by precisions
        for precision in model.precisions:
            obj = StateObject.weights(model.id, precision)
            nbytes = model.weights_bytes[precision]
            for node_id in sorted(self.p.nodes):
                node = self.p.nodes[node_id]
                if not node.can_serve(model.id):
                    continue
                fixed = node.engine_gpus.get(model.id)
                if fixed is not None:  # its engine runs on fixed GPUs here: that group or none on this node
                    groups = [tuple(self.p.gpus[g] for g in fixed)]
                else:
                    gpus = sorted((self.p.gpus[g] for g in node.gpus), key=lambda g: g.id)
                    groups = list(_subsets(gpus))
                    if current and current.node == node_id and current.precision == precision:
                        groups.append(tuple(current.gpus))
                    if extra and extra.node == node_id and extra.precision == precision:
                        groups.append(tuple(extra.gpus))
                has_source = _weights_source(self.p, self.now, obj, node_id) is not None
                for group in groups:
                    key = (node_id, precision, _ids(group))
                    if key in seen:
                        continue
                    if len(group) < max(model.min_gpus.get(g.type, 1) for g in group):
                        continue
                    if not tensor_parallel_ok(node.engine_kind(model.id), model.attention_heads, len(group)) and not (
                        current and current.node == node_id and _ids(group) == _ids(current.gpus)
                    ):
                        continue  # (a group running now stays on offer: it runs, whatever launched it)
                    shards = tuple(split_evenly(nbytes, len(group)))
                    if any(b > g.capacity_bytes for g, b in zip(group, shards, strict=True)):
                        continue
                    moves = any(
                        b > self.now.placement.get((obj, Location.gpu(g.id)), 0)
                        for g, b in zip(group, shards, strict=True)
                    )
                    if moves and not has_source:
                        continue  # nothing on the node to load the shards from
                    if not self._offered(model.id, node_id, precision, group):
                        continue  # a transition the node's engine does not offer (e.g. a restart of an adopted one)
                    seen.add(key)
                    h2d = round(sum(g.h2d_bytes_per_s for g in group), -3)
                    cls = classes.setdefault((node_id, h2d), len(classes))
                    var = self.ilp.var(f"x[{model.id},{node_id},{precision},{'+'.join(_ids(group))}]")
                    launched = self._launched(model, node_id, precision, group)
                    woken = (
                        self.woken_pools.get((node_id, model.id))
                        if self._asleep_as(model, node_id, precision, group)
                        else None
                    )
                    if launched:
                        pool = (self.launched_pools[(node_id, model.id)],) * len(group)
                    else:
                        pool = (woken,) * len(group) if woken is not None else ()
                    experts_obj = StateObject.experts(model.id)
                    experts = (
                        tuple(self.now.placement.get((experts_obj, Location.gpu(g.id)), 0) for g in group)
                        if launched
                        else ()
                    )
                    option = Option(
                        var, model.id, node_id, precision, tuple(group), shards, cls, launched, pool, experts
                    )
                    out.append(option)
        return out

    # -- routed experts ---------------------------------------------------------

    def _chunks(self, model: ModelSpec, node_id: str) -> tuple[int, int, int]:
        """(regular chunk bytes, regular chunks, tail bytes): the greedy's breakpoints on this node."""
        partial = Capability.PARTIAL_EXPERTS in self.p.nodes[node_id].capabilities
        chunks = EXPERT_CHUNKS if partial else 1
        unit = model.expert_bytes if partial else model.experts_bytes
        chunk = max(unit, (model.experts_bytes // chunks) // unit * unit)
        regular = model.experts_bytes // chunk
        return chunk, regular, model.experts_bytes - regular * chunk

    def _unit(self, model: ModelSpec, node_id: str) -> int:
        """Expert bytes per GPU are counted in this unit: every breakpoint is a whole number of them.

        With partial_experts a chunk may split over the node's cards in whole experts (as the greedy splits
        it); without, the only breakpoint is all experts on one card.
        """
        chunk, _, tail = self._chunks(model, node_id)
        if Capability.PARTIAL_EXPERTS in self.p.nodes[node_id].capabilities:
            return math.gcd(chunk, tail, model.expert_bytes)
        return math.gcd(chunk, tail)

    def _combo_terms(self, model: ModelSpec, node_id: str) -> list[tuple[int, int, int]]:
        """Every (regular, last, bytes) the node could hold: the fraction on GPU takes the exact hit rate there."""
        chunk, regular, tail = self._chunks(model, node_id)
        room = sum(self.p.gpus[g].capacity_bytes for g in _expert_gpus(self.p, model.id, node_id))
        if not _experts_source(self.p, self.now, model.id, node_id):
            room = min(room, self.now.on(StateObject.experts(model.id), node_id, Tier.GPU))
        out = []
        for r in range(regular + 1):
            for last in (0, 1) if tail else (0,):
                nbytes = r * chunk + last * tail
                if 0 < nbytes <= room:
                    out.append((r, last, nbytes))
        return out

    def _combo_cost(self, model: ModelSpec, gpus: Sequence[Gpu], nbytes: int, served_weight: float) -> float:
        c = self.c
        fraction = nbytes / model.experts_bytes
        saved = costs.decode_slowdown_seconds(model, 0.0, gpus, c) - costs.decode_slowdown_seconds(
            model, fraction, gpus, c
        )
        return costs.gpu_hold_cost(nbytes, c) - served_weight * saved

    def _best_combo_cost(self, model: ModelSpec, option: Option, served_weight: float) -> float:
        costs_ = [
            self._combo_cost(model, option.gpus, n, served_weight) + float(self._prefill_gain(model, option, n).sum())
            for _, _, n in self._combo_terms(model, option.node)
        ]
        return min([0.0, *costs_])

    def _prefill_gain(self, model: ModelSpec, option: Option, nbytes: int) -> np.ndarray:
        """Per predicted request of the model on `option`, what `nbytes` of its routed experts on the option's
        GPUs change its cost (<= 0): its re-prefill streams or computes fewer experts. Exact at no expert and at
        all of them; linear in the share between, as the experts streamed over PCIe are (`costs.expert_prefill_
        seconds`), where the CPU's part and a restore's crossover are not."""
        ends = self.prefill_ends.get(option.var)
        if ends is None:
            return np.zeros(0)
        none, all_, price = ends
        off = 1.0 - nbytes / model.experts_bytes
        gain: np.ndarray = price(all_ + (none - all_) * off) - price(none)
        return gain

    def _overlap_rows(self, model: ModelSpec, options: Sequence[Option], fractions: Sequence[tuple[int, int]]) -> None:
        """For each predicted request of the model whose KV one of `options` may hold (at most one is chosen), a
        `PrefillOverlap` over the expert variables `fractions` ((var, bytes)) those options share, whose costs
        priced their prefill gains on the first option."""
        if not fractions or not options or options[0].var not in self.prefill_ends:
            return
        on = {o.var for o in options}
        position = {s.id: i for i, (s, _) in enumerate(self.demand.get(model.id, []))}
        gains = [(var, self._prefill_gain(model, options[0], nbytes)) for var, nbytes in fractions]
        for sid, i in position.items():
            kv = [choice.var for choice in self.kv.get((model.id, sid), []) if choice.option.var in on]
            if not kv:
                continue
            saved = {var: round(-gain[i] / PREFILL_STEP) for var, gain in gains}
            saved = {var: d for var, d in saved.items() if d > 0}
            if not saved:
                continue
            most = max(saved.values())
            var = self.ilp.var(f"t[{model.id},{sid},{options[0].var}]", ub=most, cost=PREFILL_STEP)
            self.overlaps.append(PrefillOverlap(var, tuple(kv), saved, most))
            # (C14) t >= sum_y saved_y * y - most * (1 - sum_o k_o)
            self.ilp.row({var: 1, **{v: -d for v, d in saved.items()}, **dict.fromkeys(kv, -most)}, lo=-most)

    def _experts(
        self, model: ModelSpec, by_class: Mapping[tuple[str, int], list[Option]], served_weight: float
    ) -> None:
        obj = StateObject.experts(model.id)
        nodes = sorted({node for node, _ in by_class})
        for node_id in nodes:
            terms = self._combo_terms(model, node_id)
            if self.p.nodes[node_id].engine_kind(model.id) is not None:
                options = [o for (n, _), of_class in sorted(by_class.items()) if n == node_id for o in of_class]
                self._engine_experts(model, node_id, options, terms, served_weight)
                continue
            if not terms:
                continue
            link: dict[int, int] = {}
            for (n, cls), options in sorted(by_class.items()):
                if n != node_id:
                    continue
                chosen = []
                fractions = []
                for r, last, nbytes in terms:
                    # the class's options decode alike; their prefill gains are priced on its first
                    gain = float(self._prefill_gain(model, options[0], nbytes).sum())
                    var = self.ilp.var(
                        f"y[{model.id},{node_id},{cls},{r},{last}]",
                        cost=self._combo_cost(model, options[0].gpus, nbytes, served_weight) + gain,
                    )
                    self.combos.append(ExpertCombo(var, model.id, node_id, cls, r, last, nbytes))
                    chosen.append(var)
                    fractions.append((var, nbytes))
                    link[var] = -nbytes // self._unit(model, node_id)
                self._overlap_rows(model, options, fractions)
                # (C5) at most one expert fraction, and only on a node whose group (of this decode class) serves the model
                self.ilp.row({**dict.fromkeys(chosen, 1), **{o.var: -1 for o in options}}, hi=0)
            has_source = _experts_source(self.p, self.now, model.id, node_id)
            unit = self._unit(model, node_id)
            for gpu_id in _expert_gpus(self.p, model.id, node_id):
                g = self.p.gpus[gpu_id]
                now = self.now.placement.get((obj, Location.gpu(gpu_id)), 0)
                ub = g.capacity_bytes // unit if has_source else min(g.capacity_bytes, now) // unit
                v = self.ilp.var(f"v[{model.id},{gpu_id}]", ub=min(ub, model.experts_bytes // unit))
                self.expert_vars[(model.id, gpu_id)] = (v, unit)
                self.gpu_terms[gpu_id][v] += unit
                self.model_gpu_terms[(model.id, gpu_id)][v] += unit
                link[v] = 1
                # (C6) promoted MiB: MiB * u >= unit * v - now, charged at the GPU's copy rate
                rate = self.c.move_weight * promote_seconds(self.p, self.now, {(obj, Location.gpu(gpu_id)): now + MIB})
                u = self.ilp.var(f"u[{model.id},{gpu_id}]", ub=-(-self.ilp.ub[v] * unit // MIB), cost=rate)
                self.gain_vars[(model.id, gpu_id)] = u
                self.ilp.row({u: MIB, v: -unit}, lo=-now)
            # (C7) the expert bytes spread over the node's GPUs add up to the chosen fraction
            self.ilp.row(link, lo=0, hi=0)

    def _engine_experts(
        self,
        model: ModelSpec,
        node_id: str,
        options: Sequence[Option],
        terms: Sequence[tuple[int, int, int]],
        served_weight: float,
    ) -> None:
        """On a vLLM / SGLang node each option's fraction of experts lies in equal shares on its own GPUs; the
        wake of a sleeping engine whose launched share its node reported brings back that share, no other."""
        obj = StateObject.experts(model.id)
        has_source = _experts_source(self.p, self.now, model.id, node_id)
        shares_on: dict[str, dict[int, int]] = defaultdict(dict)  # GPU -> {w: its share there}
        woken = self.woken_experts.get((node_id, model.id))
        for o in options:
            chosen: list[int] = []
            fractions: list[tuple[int, int]] = []
            wake = woken is not None and self._asleep_as(model, o.node, o.precision, o.gpus)
            for r, last, nbytes in [(0, 0, woken)] if wake and woken is not None else terms:
                shares = split_evenly(nbytes, len(o.gpus))
                held = [self.now.placement.get((obj, Location.gpu(g.id)), 0) for g in o.gpus]
                if not wake and not has_source and any(b > h for b, h in zip(shares, held, strict=True)):
                    continue  # nothing to fill more from
                cost = self._combo_cost(model, o.gpus, nbytes, served_weight)
                cost += float(self._prefill_gain(model, o, nbytes).sum())
                var = self.ilp.var(f"w[{model.id},{o.var},{r},{last}]", cost=cost)
                self.engine_experts.append(EngineExperts(var, o, nbytes))
                chosen.append(var)
                fractions.append((var, nbytes))
                for g, b in zip(o.gpus, shares, strict=True):
                    self.gpu_terms[g.id][var] += b
                    self.model_gpu_terms[(model.id, g.id)][var] += b
                    shares_on[g.id][var] = b
            # (C5e) at most one expert fraction, and only with the option it lies on; (C5w) a wake's is its
            # launched share, with the option whenever it is chosen
            if chosen:
                self.ilp.row({**dict.fromkeys(chosen, 1), o.var: -1}, lo=0 if wake else -math.inf, hi=0)
            self._overlap_rows(model, [o], fractions)
        for gpu_id, by_var in sorted(shares_on.items()):
            # (C6e) promoted MiB: MiB * u >= sum_w share * w - now, charged at the GPU's copy rate
            was = self.now.placement.get((obj, Location.gpu(gpu_id)), 0)
            rate = self.c.move_weight * promote_seconds(self.p, self.now, {(obj, Location.gpu(gpu_id)): was + MIB})
            u = self.ilp.var(f"u[{model.id},{gpu_id}]", ub=-(-max(by_var.values()) // MIB), cost=rate)
            self.gain_vars[(model.id, gpu_id)] = u
            self.ilp.row({u: MIB, **{w: -b for w, b in by_var.items()}}, lo=-was)


def _interchangeable_pairs(
    problem: Problem, now: ResidencyIndex, states: Mapping[engine_instances.Key, engine_instances.InstanceView]
) -> list[tuple[str, str]]:
    """Consecutive GPUs (in id order) of one node that no cost or constraint tells apart.

    Swapping two such cards maps every candidate group to another candidate
    (every subset is offered on nodes of up to MAX_SUBSET_GPUS cards) and
    every cost to itself, so some optimum holds more bytes on the first.
    """
    pairs = []
    for node in problem.nodes.values():
        if len(node.gpus) > MAX_SUBSET_GPUS:
            continue
        cards = sorted((problem.gpus[g] for g in node.gpus), key=lambda g: g.id)
        fixed = {g for gpus in node.engine_gpus.values() for g in gpus}  # an engine's cards are told apart
        fixed |= {g for view in states.values() if view.node == node.id for g in view.gpus}
        empty = [g for g in cards if now.used.get(Location.gpu(g.id), 0) == 0 and g.id not in fixed]
        for a, b in itertools.pairwise(empty):
            if (a.type, a.capacity_bytes, a.h2d_bytes_per_s, a.d2h_bytes_per_s, a.bf16_flops) == (
                b.type,
                b.capacity_bytes,
                b.h2d_bytes_per_s,
                b.d2h_bytes_per_s,
                b.bf16_flops,
            ):
                pairs.append((a.id, b.id))
    return pairs


def _expert_gpus(problem: Problem, model_id: str, node_id: str) -> list[str]:
    """The GPUs of the node that may hold the model's routed experts: its engine's, where it runs on fixed ones."""
    node = problem.nodes[node_id]
    return sorted(node.engine_gpus.get(model_id, node.gpus))


def _subsets(gpus: Sequence[Gpu]) -> Iterator[tuple[Gpu, ...]]:
    if len(gpus) <= MAX_SUBSET_GPUS:
        for k in range(1, len(gpus) + 1):
            yield from itertools.combinations(gpus, k)
        return
    # large nodes: for each k, the k largest cards and every window of k cards in id order
    by_size = sorted(gpus, key=lambda g: (-g.capacity_bytes, g.id))
    for k in range(1, len(gpus) + 1):
        yield tuple(sorted(by_size[:k], key=lambda g: g.id))
        for start in range(len(gpus) - k + 1):
            yield tuple(gpus[start : start + k])


def _weights_source(problem: Problem, now: ResidencyIndex, obj: StateObject, node: str) -> Tier | None:
    """Where operations can load weights from on the node (host DRAM only with the weights_offload capability)."""
    if now.complete(obj, node, Tier.HOST) and Capability.WEIGHTS_OFFLOAD in problem.nodes[node].capabilities:
        return Tier.HOST
    return Tier.NVME if now.complete(obj, node, Tier.NVME) else None


def _experts_source(problem: Problem, now: ResidencyIndex, model: str, node: str) -> bool:
    return now.complete_source(StateObject.experts(model), node) is not None


# -- lower tiers, settled like the greedy --------------------------------------


def lower_tiers_with_gpus_empty(problem: Problem) -> ResidencyIndex:
    """The greedy's lower-tier rule applied as if nothing stayed on GPU: where each model would cold-load from.

    What leaves the GPUs is demoted, the last complete copies are kept, likely
    next models are staged in host DRAM. Prices of a model that is off (and of
    KV left below GPU) are read from this placement.
    """
    planner = GreedyPlanner(problem)
    try:
        planner.settle_lower_tiers()
    except PlanningError:  # no room below for everything at once: fall back to what is below now
        planner.target = {k: v for k, v in problem.residency.items() if k[1].tier is not Tier.GPU}
    return ResidencyIndex.build(problem, {k: v for k, v in planner.target.items() if v > 0})


def settle(
    problem: Problem,
    gpu_target: Mapping[tuple[StateObject, Location], int],
    groups: Mapping[str, Group],
    unserved: Mapping[str, str],
    reasons: Mapping[StateObject, str],
) -> TargetPlan:
    """A full target from a GPU-tier decision: the lower tiers are settled exactly as the greedy settles them."""
    planner = GreedyPlanner(problem)
    planner.target = dict(gpu_target)
    planner.groups = dict(groups)
    planner.unserved = dict(unserved)
    planner.reasons = dict(reasons)
    for (_, loc), nbytes in gpu_target.items():
        planner.book.free[loc.id] -= nbytes
    planner.settle_lower_tiers()
    placement: Placement = {k: v for k, v in planner.target.items() if v > 0}
    return TargetPlan(placement, dict(planner.groups), dict(planner.unserved), dict(planner.reasons))


def decode(form: Formulation, values: Sequence[int]) -> TargetPlan:
    """Turn an assignment into a full target placement (GPU tier from the model, lower tiers by the greedy's rule)."""
    p = form.problem
    gpu_target: dict[tuple[StateObject, Location], int] = defaultdict(int)
    groups: dict[str, Group] = {}
    reasons: dict[StateObject, str] = {}
    unserved: dict[str, str] = {}
    for model_id, options in sorted(form.options.items()):
        for o in options:
            if values[o.var]:
                obj = StateObject.weights(model_id, o.precision)
                for g, b in zip(o.gpus, o.shards, strict=True):
                    if b:
                        gpu_target[(obj, Location.gpu(g.id))] += b
                for g, b in zip(o.gpus, o.experts, strict=False):  # a launched engine's fixed expert share (none else)
                    if b:
                        gpu_target[(StateObject.experts(model_id), Location.gpu(g.id))] += b
                groups[model_id] = o.group()
                reasons[obj] = "placed by the MILP oracle"
    for (model_id, sid), choices in sorted(form.kv.items()):
        for choice in choices:
            if values[choice.var]:
                obj = StateObject.kv(model_id, sid)
                for g, b in zip(choice.option.gpus, split_evenly(choice.nbytes, len(choice.option.gpus)), strict=True):
                    if b:
                        gpu_target[(obj, Location.gpu(g.id))] += b
    for (model_id, gpu_id), (var, unit) in sorted(form.expert_vars.items()):
        if values[var]:
            gpu_target[(StateObject.experts(model_id), Location.gpu(gpu_id))] += int(values[var]) * unit
    for fraction in form.engine_experts:
        if values[fraction.var]:
            on = fraction.option
            for g, b in zip(on.gpus, split_evenly(fraction.nbytes, len(on.gpus)), strict=True):
                if b:
                    gpu_target[(StateObject.experts(on.model), Location.gpu(g.id))] += b
    for s in sorted(p.sessions.values(), key=lambda s: s.id):
        if not s.active:
            continue
        group = groups.get(s.model)
        if group is None:
            unserved[s.id] = f"gpu capacity: the MILP found no group for {s.model} among the active models' needs"
        elif not any(values[c.var] for c in form.kv.get((s.model, s.id), [])):
            unserved[s.id] = (
                f"kv capacity: the KV of session {s.id} does not fit on node {group.node}'s GPUs beside {s.model}'s weights"
            )
    return settle(p, dict(gpu_target), groups, unserved, reasons)
