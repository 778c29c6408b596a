"""The evaluator: one objective for any plan, so every solver's numbers compare.

For a target placement T reached from the confirmed placement C:

    objective = sum over active requests  w_s * (L_now(s) + V * [L_now(s) > target_s])
              + sum over sessions s, models m  w_s * q(s,m) * (L_T(s,m) + V * [L_T(s,m) > target_s])
              + sum over requests (active and predicted)  w_s * q * (decode slowdown + degraded precision)
              + price * GiB held on GPU in T
              + move_weight * seconds spent promoting C -> T (engine transitions included)
              + U * active requests T cannot serve

  w_s       SLO weight of the session's class; target_s its switch-latency target
  q(s,m)    predicted probability that s's next request goes to m
  L_T(s,m)  switch latency in T: weights ready (0 if served, else the cheapest
            cold load from a complete copy: the copy plus the engine transition
            that brings the model up, a wake where its engine sleeps, else a
            cold start; planner/engine_costs.py) + KV ready (restore or re-prefill)
  L_now(s)  latency of the request being served now: the time to bring its
            model's weights (and its engine: a wake, start or restart) and its
            KV from C to where T puts them
  V, U      violation and unserved penalties

Everything is in seconds. `evaluate` also reports the predicted metrics
(P95 switch latency over the predicted requests, GPU bytes, ...).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass
from itertools import repeat
from typing import cast

import numpy as np

from planner_service.domain.engines import kv_split_ways
from planner_service.domain.problem import Gpu, ModelSpec, Problem, Session
from planner_service.domain.scenario import CostConstants, Slo
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.planner import costs, engine_costs
from planner_service.planner.residency import ResidencyIndex, Serving

# bound once: on Python 3.11 an `Enum.MEMBER` lookup costs about ten global reads
_GPU, _HOST, _NVME = Tier.GPU, Tier.HOST, Tier.NVME
_KV = Kind.KV


@dataclass(frozen=True, slots=True)
class Objective:
    total: float
    switch_latency: float
    violations: float
    decode_slowdown: float
    degraded_precision: float
    gpu_memory: float
    moves: float
    unserved: float
    # the part every feasible plan pays no matter what it decides is not separable here;
    # `total` is what solvers minimize and compare.

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Predicted:
    switch_latency_p50_seconds: float
    switch_latency_p95_seconds: float
    switch_latency_mean_seconds: float
    slo_violation_rate: float
    gpu_bytes: int
    unserved_sessions: tuple[str, ...]

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["unserved_sessions"] = list(self.unserved_sessions)
        return out


@dataclass(frozen=True)
class Demand:
    """The predicted next requests as arrays: q(s, m) and each session's SLO weight and target.

    Rows of `q` are models (in problem order), columns sessions (in problem
    order), so each model's row is contiguous. Sessions without a prediction
    have q = 0 everywhere.
    """

    sessions: list[Session]
    position: dict[str, int]  # session id -> column
    row: dict[str, int]  # model id -> row
    q: np.ndarray  # [models x sessions] probability of the session's next request going to the model
    slo_weight: np.ndarray  # [sessions] w_s
    slo_target: np.ndarray  # [sessions] target_s, seconds
    context: np.ndarray  # [sessions] context tokens (what a re-prefill processes), as floats

    @classmethod
    def of(cls, problem: Problem) -> Demand:
        c = problem.constants
        weight = {slo: c.slo_weights.of(slo) for slo in Slo}
        target = {slo: c.slo_targets_seconds.of(slo) for slo in Slo}
        sessions = list(problem.sessions.values())
        row = {m: i for i, m in enumerate(problem.models)}
        # The predictor hands every session on a model the same row object: turn each distinct row
        # into a vector once, then gather (by the rows' ids, without a Python step per session). The
        # vectors are lists, made one array at the end: numpy costs a microsecond or so per call.
        vectors: list[list[float]] = [[0.0] * len(row)]  # 0: no prediction
        vector_of: dict[int, int] = {}
        probs_of = list(map(problem.next_model.get, problem.sessions))
        ids = list(map(id, probs_of))
        for key, probs in dict(zip(ids, probs_of, strict=True)).items():
            if not probs:
                vector_of[key] = 0
                continue
            vector_of[key] = len(vectors)
            vector = [0.0] * len(row)
            for model, q in probs.items():
                if model in row:
                    vector[row[model]] = q
            vectors.append(vector)
        which = list(map(vector_of.__getitem__, ids))
        slos = [s.slo for s in sessions]
        return cls(
            sessions=sessions,
            position=dict(zip(problem.sessions, range(len(sessions)), strict=True)),
            row=row,
            q=np.array(vectors).T.take(np.array(which, dtype=np.intp), axis=1),  # a fresh array, rows contiguous
            slo_weight=np.array(list(map(weight.__getitem__, slos))),
            slo_target=np.array(list(map(target.__getitem__, slos))),
            context=np.array([s.context_tokens for s in sessions], dtype=float),
        )

    def of_model(self, model: str) -> np.ndarray:
        """q(s, model) for every session."""
        q: np.ndarray = self.q[self.row[model]]  # (a row of the 2-D array)
        return q


@dataclass(frozen=True, slots=True)
class ColdLoad:
    """Where a model not on GPU would be loaded from, and how long that takes."""

    seconds: float  # weights copy + its engine's transition (+ degraded-precision cost)
    node: str | None
    gpus: tuple[Gpu, ...]
    precision: str | None


def cold_load(problem: Problem, index: ResidencyIndex, model: ModelSpec, now: ResidencyIndex) -> ColdLoad:
    """The cheapest way to bring a model onto GPUs from a complete copy below GPU in `index`, its engine's
    transition priced from its state in the confirmed placement `now` once it has left its GPUs
    (`engine_costs`: a wake where it sleeps, on the group it sleeps on, else a cold start)."""
    best = ColdLoad(float("inf"), None, (), None)
    for rank, precision in enumerate(model.precisions):
        obj = StateObject.weights(model.id, precision)
        for node_id in sorted(problem.nodes):
            node = problem.nodes[node_id]
            source = index.complete_source(obj, node_id)
            if source is None:
                continue
            group = costs.cold_group(problem, model, precision, node)
            if group is None:
                continue
            own = engine_costs.own_group(problem, now, model, precision, node)
            for gpus in (group,) if own is None or own == group else (group, own):
                seconds = engine_costs.bring_up_seconds(
                    problem, now, model, precision, gpus, source, node, after_leaving=True
                )
                if rank:
                    seconds += problem.constants.degraded_precision_seconds
                if seconds < best.seconds:
                    best = ColdLoad(seconds, node_id, gpus, precision)
    return best


def kv_ready(
    problem: Problem,
    index: ResidencyIndex,
    model: ModelSpec,
    session: str,
    node: str,
    gpus: tuple[Gpu, ...],
    gpu_kv: int,
    share: tuple[float, bool] | None = None,
) -> float:
    """Seconds to make `session`'s KV for `model` ready on `gpus`, given `gpu_kv` bytes already there; a MoE's
    re-prefill at `share` (`expert_share`: its experts' GPU share on the node, all in host DRAM; default:
    what `index` puts there)."""
    kv_per_token = model.kv_bytes_per_token
    if kv_per_token == 0:
        return 0.0
    needed_tokens = problem.sessions[session].context_tokens
    held = gpu_kv // kv_per_token
    missing = needed_tokens - held
    if missing <= 0:
        return 0.0
    obj = StateObject.kv(model.id, session)
    host = index.on(obj, node, _HOST)
    nvme = index.on(obj, node, _NVME)
    source, restorable = (_HOST, host) if host >= nvme else (_NVME, nvme)
    fraction, in_dram = expert_share(index, model, node) if share is None else share
    return costs.kv_ready_seconds(
        missing, restorable, model, gpus, source, problem.nodes[node], problem.constants, held, fraction, in_dram
    )


# `costs.expert_prefill_rates`: (seconds per pass of the experts off GPU, CPU seconds per token, chunk, k / E)
_Rates = tuple[float, float, int, float]
_DENSE: _Rates = (0.0, 0.0, 1, 0.0)


def expert_share(index: ResidencyIndex, model: ModelSpec, node: str) -> tuple[float, bool]:
    """The share of a MoE's routed experts `index` puts on the node's GPUs (1 for a dense model), and whether
    its host DRAM holds them all: what the replay prefills at (`SimState.expert_share`)."""
    if not model.is_moe:
        return 1.0, False
    obj = StateObject.experts(model.id)
    return index.on(obj, node, _GPU) / model.experts_bytes, index.complete_source(obj, node) is _HOST


def expert_rates(index: ResidencyIndex, model: ModelSpec, node: str, gpus: tuple[Gpu, ...], c: CostConstants) -> _Rates:
    """`costs.expert_prefill_rates` of the model on `gpus` at the expert share `index` gives the node."""
    if not model.is_moe:
        return _DENSE
    fraction, in_dram = expert_share(index, model, node)
    return costs.expert_prefill_rates(model, fraction, gpus, c, in_dram)


# one model's sessions for `_kv_ready_of`: (index, row, model, node, gpus, on_gpus, per_token, experts, sessions)
_KvGroup = tuple[ResidencyIndex, int, ModelSpec, str, tuple[Gpu, ...], bool, float, _Rates, Collection[str]]


def _kv_ready_of(
    problem: Problem, position: Mapping[str, int], groups: Iterable[_KvGroup]
) -> tuple[list[int], list[int], np.ndarray]:
    """`kv_ready` for the given sessions of several models, all at once.

    `groups` holds (index, row, model, node, gpus, on_gpus, per_token, experts, sessions) per model: the
    placement the KV is readied from, where the requests would run (`on_gpus`: KV already on those GPUs
    in `index` counts), the prefill seconds per token there, a MoE's expert rates there
    (`costs.expert_prefill_rates`), and the sessions. Returns (rows, session columns, seconds), the
    sessions of each group in id order.
    """
    rows: list[int] = []
    columns: list[int] = []
    tokens: list[int] = []
    held: list[int] = []
    host: list[int] = []
    nvme: list[int] = []
    counts, sizes, links = [], [], []  # per model: its sessions, and what `kv_ready_seconds_grouped` takes of it
    rates: list[_Rates] = []
    for index, row, model, node, gpus, on_gpus, group_per_token, group_rates, holders in groups:
        ids = sorted(holders)
        # the sessions' KV objects as plain tuples, which equal (and hash as) `StateObject.kv(model.id, sid)`:
        # typed as the keys they look up
        objs = cast(list[StateObject], list(zip(repeat(_KV), repeat(model.id), repeat(None), ids)))
        columns += map(position.__getitem__, ids)
        if model.kv_bytes_per_token:
            tokens += [problem.sessions[sid].context_tokens for sid in ids]
        else:  # no KV per token: nothing is missing
            tokens += repeat(0, len(ids))
        if on_gpus:
            held += map(index.gpu_bytes.get, zip(objs, repeat(node)), repeat(0))
        else:
            held += repeat(0, len(ids))
        host += map(index.placement.get, zip(objs, repeat(Location.host(node))), repeat(0))
        nvme += map(index.placement.get, zip(objs, repeat(Location.nvme(node))), repeat(0))
        rows += repeat(row, len(ids))
        counts.append(len(ids))
        sizes.append((model.kv_bytes_per_token or 1, len(gpus), kv_split_ways(model.kv_heads, len(gpus))))
        group_h2d = min(g.h2d_bytes_per_s for g in gpus)
        group_per_pair = costs.attention_seconds_per_pair(model, gpus, problem.constants)
        links.append((group_h2d, problem.nodes[node].nvme_read_bytes_per_s, group_per_token, group_per_pair))
        rates.append(group_rates)
    # one entry per session (integers and rates repeated apart: bytes stay integers)
    # (array methods rather than numpy's module functions, which add a Python call each: same results)
    kv_per_token, group_size, split_ways = np.array(sizes).repeat(counts, axis=0).T
    slowest_h2d, nvme_read, per_token, per_pair = np.array(links, dtype=float).repeat(counts, axis=0).T
    prefix = np.array(held) // kv_per_token
    missing = np.array(tokens) - prefix
    host_bytes, nvme_bytes = np.maximum(np.array(host), 0), np.maximum(np.array(nvme), 0)
    from_host = host_bytes >= nvme_bytes
    restorable = np.where(from_host, host_bytes, nvme_bytes)
    experts = None
    if any(r[0] > 0 for r in rates):  # a MoE with experts off GPU among them
        per_pass, cpu, chunk, share = np.array(rates, dtype=float).repeat(counts, axis=0).T
        experts = (per_pass, cpu, chunk, share)
    seconds = costs.kv_ready_seconds_grouped(
        missing,
        restorable,
        from_host,
        kv_per_token,
        group_size,
        slowest_h2d,
        nvme_read,
        per_token,
        per_pair,
        prefix,
        experts,
        split_ways,
    )
    return rows, columns, np.where(missing > 0, seconds, 0.0)


def _gpu_kv(index: ResidencyIndex, model: str, session: str, serving: Serving) -> int:
    return index.on(StateObject.kv(model, session), serving.node, _GPU)


def evaluate(
    problem: Problem,
    target: Mapping[tuple[StateObject, Location], int],
    now: ResidencyIndex | None = None,
    then: ResidencyIndex | None = None,
    demand: Demand | None = None,
) -> tuple[Objective, Predicted]:
    """The objective of reaching `target` from the confirmed placement, and its predicted metrics.

    `now` and `then` index the confirmed placement and the target, and `demand` is `Demand.of(problem)`,
    when the caller has them already.
    """
    c = problem.constants
    now = now or ResidencyIndex.build(problem, problem.residency)
    then = then or ResidencyIndex.build(problem, target)

    latency_terms: list[np.ndarray] = []
    weight_terms: list[np.ndarray] = []
    target_terms: list[np.ndarray] = []
    switch = violations = decode = degraded = unserved_cost = 0.0
    unserved: list[str] = []
    demand = demand or Demand.of(problem)
    sessions, position = demand.sessions, demand.position
    slo_weight, slo_target, context = demand.slo_weight, demand.slo_target, demand.context

    # Requests being served now: the time to bring their state from C to T (their KV is readied below,
    # in one batch with the predicted requests').
    arrival_latency: list[float] = []
    arrival_target: list[float] = []
    weights_arrival: dict[str, float] = {}  # model -> seconds until its weights are on their GPUs
    arrival_slowdown: dict[str, float] = {}  # model -> decode slowdown of its requests
    arriving: list[tuple[Session, ModelSpec, Serving, float, float]] = []  # (session, model, serving, w, target)
    arriving_on: dict[str, list[str]] = {}  # model -> its sessions in `arriving`
    weight_of, target_of = slo_weight.tolist(), slo_target.tolist()  # read per active session: floats
    for s in sessions:
        if not s.active:
            continue
        model = problem.models[s.model]
        w, target_s = weight_of[position[s.id]], target_of[position[s.id]]
        serving = then.serving.get(s.model)
        kv_obj = StateObject.kv(s.model, s.id)
        if serving is None or then.on(kv_obj, serving.node, _GPU) < problem.size_of(kv_obj):
            # the model is not served, or this session's KV has no room beside it: the request waits
            unserved.append(s.id)
            unserved_cost += c.unserved_penalty_seconds * w
            continue
        if s.model not in weights_arrival:
            weights_arrival[s.model] = _weights_arrival(problem, now, then, model, serving)
            arrival_slowdown[s.model] = _decode(problem, then, model, serving)
            arriving_on[s.model] = []
        arriving.append((s, model, serving, w, target_s))
        arriving_on[s.model].append(s.id)

    # Predicted next requests: where each predicted model would run, then the latencies of all of them
    # as one [models x sessions] array (the sessions holding some KV priced for all models at once).
    predicted: list[bool] = np.any(demand.q, axis=1).tolist()
    rows: list[int] = []  # rows of `demand.q` predicted
    ready: list[float] = []  # per predicted model: seconds until its weights are ready
    per_token: list[float] = []  # prefill seconds per token where it would run (0: nowhere)
    per_pair: list[float] = []  # prefill seconds per attention pair there (0: nowhere)
    moe: list[tuple[int, _Rates]] = []  # (entry of `rows`, expert rates) of MoEs prefilling with experts off GPU
    slowdowns: list[float] = []
    degrades: list[float] = []
    # for `_kv_ready_of`: the active requests' KV first (`arrivals` entries), then the predicted ones'
    held = [_arrival_kv(now, problem.models[m], then.serving[m], ids, c) for m, ids in arriving_on.items()]
    arrivals = sum(map(len, arriving_on.values()))
    for model in problem.models.values():
        row = demand.row[model.id]
        if not predicted[row]:
            continue
        serving = then.serving.get(model.id)
        if serving is not None:
            node, gpus, weights_ready = serving.node, serving.gpus, 0.0
            slowdown = arrival_slowdown.get(model.id)  # its requests in flight have it already
            if slowdown is None:
                slowdown = _decode(problem, then, model, serving)
            degrade = c.degraded_precision_seconds * (serving.precision != model.preferred)
        else:
            cold = cold_load(problem, then, model, now)
            if cold.node is None:  # no copy anywhere: nothing can serve it
                weights_ready, node, gpus = c.unserved_penalty_seconds, None, ()
            else:
                weights_ready, node, gpus = cold.seconds, cold.node, cold.gpus
            slowdown = costs.decode_slowdown_seconds(model, 0.0, gpus, c) if gpus else 0.0
            degrade = 0.0  # already inside cold.seconds
        seconds = pair = 0.0  # no node: no KV to ready either
        if node is not None:
            # no KV anywhere: re-prefill the whole history; sessions holding some KV are priced below
            seconds = costs.prefill_seconds_per_token(model, gpus, c)
            pair = costs.attention_seconds_per_pair(model, gpus, c)
            # the plan's own expert share on the node's GPUs: predicted requests come once its moves are done
            rates = expert_rates(then, model, node, gpus, c)
            if rates[0] > 0:
                moe.append((len(rows), rates))
            holders = then.kv_sessions.get(model.id)
            if holders:
                held.append((then, len(rows), model, node, gpus, serving is not None, seconds, rates, holders))
        rows.append(row)
        ready.append(weights_ready)
        per_token.append(seconds)
        per_pair.append(pair)
        slowdowns.append(slowdown)
        degrades.append(degrade)
    at, columns, kv_seconds = _kv_ready_of(problem, position, held) if held else ([], [], np.zeros(0))
    kv_arrival = dict(zip(columns[:arrivals], kv_seconds[:arrivals].tolist(), strict=True))  # session column -> seconds
    for s, model, serving, w, target_s in arriving:
        latency = weights_arrival[s.model] + kv_arrival[position[s.id]]
        switch += w * latency
        violations += w * c.violation_penalty_seconds * (latency > target_s)
        decode += w * arrival_slowdown[s.model]
        degraded += w * c.degraded_precision_seconds * (serving.precision != model.preferred)
        arrival_latency.append(latency)
        arrival_target.append(target_s)
    latency_terms.append(np.array(arrival_latency))
    weight_terms.append(np.ones(len(arrival_latency)))
    target_terms.append(np.array(arrival_target))

    if rows:
        kv = np.multiply.outer(per_token, context) + np.multiply.outer(per_pair, costs.causal_pairs(context, 0))
        for k, rates in moe:
            kv[k] += costs.expert_prefill_seconds_many(context, *rates)
        if len(columns) > arrivals:  # sessions holding some KV of predicted models
            kv[at[arrivals:], columns[arrivals:]] = kv_seconds[arrivals:]
        latency = np.array(ready)[:, None] + kv
        late = latency > slo_target
        q = demand.q[rows]
        wq = slo_weight * q
        weights = wq.sum(axis=1).tolist()  # each row summed on its own, as `wq[k].sum()` would
        # model by model, in problem order: the sums add up as they always have
        for wq_k, latency_k, late_k, weight, slowdown, degrade in zip(
            wq, latency, late, weights, slowdowns, degrades, strict=True
        ):
            switch += float(wq_k @ latency_k)
            violations += float(wq_k @ late_k) * c.violation_penalty_seconds
            decode += weight * slowdown
            degraded += weight * degrade
        latency_terms.append(latency.ravel())
        weight_terms.append(q.ravel())
        target_terms.append(np.tile(slo_target, len(rows)))

    gpu_bytes = sum(then.on_gpus.values())
    memory = costs.gpu_hold_cost(gpu_bytes, c)
    moves = c.move_weight * promote_seconds(problem, now, then.on_gpus)
    total = switch + violations + decode + degraded + memory + moves + unserved_cost
    objective = Objective(total, switch, violations, decode, degraded, memory, moves, unserved_cost)
    return objective, _predicted(latency_terms, weight_terms, target_terms, gpu_bytes, unserved)


def _decode(problem: Problem, index: ResidencyIndex, model: ModelSpec, serving: Serving) -> float:
    if not model.is_moe:
        return 0.0
    fraction = index.on(StateObject.experts(model.id), serving.node, _GPU) / model.experts_bytes
    return costs.decode_slowdown_seconds(model, fraction, serving.gpus, problem.constants)


def _arrival_latency(
    problem: Problem,
    now: ResidencyIndex,
    then: ResidencyIndex,
    model: ModelSpec,
    session: str,
    serving: Serving,
    share: tuple[float, bool] | None = None,
) -> float:
    """Latency of a request waiting now: copy its model's missing shards, then ready its KV (a MoE's at the
    expert `share`, default the one on the node's GPUs now: `expert_share`)."""
    return _weights_arrival(problem, now, then, model, serving) + _kv_arrival(
        problem, now, model, session, serving, share
    )


def _weights_arrival(
    problem: Problem, now: ResidencyIndex, then: ResidencyIndex, model: ModelSpec, serving: Serving
) -> float:
    """Seconds to copy the shards of the model's weights that `serving`'s GPUs lack now, plus the fixed part
    of its engine's transition onto them (`engine_costs.up_fixed_seconds`: a wake, restart or cold start)."""
    obj = StateObject.weights(model.id, serving.precision)
    node = problem.nodes[serving.node]
    keys = [(obj, Location.gpu(g.id)) for g in serving.gpus]
    shards = [max(0, then.placement.get(key, 0) - now.placement.get(key, 0)) for key in keys]
    if not any(shards):
        return 0.0
    source = now.complete_source(obj, serving.node) or _NVME
    fixed = engine_costs.up_fixed_seconds(
        problem, now, serving.node, model.id, serving.precision, [g.id for g in serving.gpus], host_copy=source is _HOST
    )
    return costs.copy_seconds(shards, serving.gpus, source, node) + fixed


def _arrival_kv(
    now: ResidencyIndex, model: ModelSpec, serving: Serving, sessions: list[str], c: CostConstants
) -> _KvGroup:
    """`_kv_ready_of`'s group for the sessions of the model being served now: their KV readied from C on
    `serving`'s GPUs, what is there now at the same precision counting, a MoE's re-prefill at the expert
    share on the node's GPUs now (as `_kv_arrival`)."""
    current = now.serving.get(model.id)
    on_gpus = current is not None and current.node == serving.node and current.precision == serving.precision
    per_token = costs.prefill_seconds_per_token(model, serving.gpus, c)
    rates = expert_rates(now, model, serving.node, serving.gpus, c)
    return (now, -1, model, serving.node, serving.gpus, on_gpus, per_token, rates, sessions)


def _kv_arrival(
    problem: Problem,
    now: ResidencyIndex,
    model: ModelSpec,
    session: str,
    serving: Serving,
    share: tuple[float, bool] | None = None,
) -> float:
    """Seconds to ready the session's KV on `serving`'s GPUs (what is there now at the same precision counts;
    a MoE's re-prefill at `share`, default the expert share on the node's GPUs now)."""
    current = now.serving.get(model.id)
    kv_now = 0
    if current is not None and current.node == serving.node and current.precision == serving.precision:
        kv_now = _gpu_kv(now, model.id, session, current)
    return kv_ready(
        problem,
        now,
        model,
        session,
        serving.node,
        serving.gpus,
        kv_now,
        share,
    )


def promote_seconds(problem: Problem, now: ResidencyIndex, target: Mapping[tuple[StateObject, Location], int]) -> float:
    """Seconds the plan spends bringing state up to GPUs: the copies (each GPU's link on its own), plus the
    fixed part of each engine transition that brings weights onto a group (`engine_costs.up_fixed_seconds`:
    a start, restart or wake must pay for itself as its copies do)."""
    total = 0.0
    kv_kind, weights_kind, before, gpus, nodes = Kind.KV, Kind.WEIGHTS, now.placement, problem.gpus, problem.nodes
    groups: dict[tuple[StateObject, str], list[str]] = {}  # (weights, node) -> the target's GPUs holding them
    raised: dict[tuple[StateObject, str], None] = {}  # (weights, node) whose shards grow, in order: a transition
    for key, nbytes in target.items():
        obj, loc = key
        if loc.tier is not _GPU or obj.kind is kv_kind:
            continue
        gpu = gpus[loc.id]
        if obj.kind is weights_kind and nbytes > 0:
            groups.setdefault((obj, gpu.node), []).append(loc.id)
        gain = nbytes - before.get(key, 0)
        if gain <= 0:
            continue
        source = now.complete_source(obj, gpu.node) or _NVME
        total += costs.even_copy_seconds(gain, (gpu,), source, nodes[gpu.node])
        if obj.kind is weights_kind:
            raised[(obj, gpu.node)] = None
    for obj, node_id in raised:
        assert obj.precision is not None  # a weights object
        below = now.complete_source(obj, node_id)
        total += engine_costs.up_fixed_seconds(
            problem, now, node_id, obj.model, obj.precision, groups[(obj, node_id)], host_copy=below is _HOST
        )
    return total


def _predicted(
    latency_terms: list[np.ndarray],
    weight_terms: list[np.ndarray],
    target_terms: list[np.ndarray],
    gpu_bytes: int,
    unserved: list[str],
) -> Predicted:
    """Probability-weighted statistics of the switch latencies of active and predicted requests."""
    if not latency_terms:
        return Predicted(0.0, 0.0, 0.0, 0.0, int(gpu_bytes), tuple(unserved))
    latency, weight, target = (np.concatenate(t) for t in (latency_terms, weight_terms, target_terms))
    keep = weight > 0
    if not keep.all():
        latency, weight, target = latency[keep], weight[keep], target[keep]
    if latency.size == 0:
        return Predicted(0.0, 0.0, 0.0, 0.0, int(gpu_bytes), tuple(unserved))
    total = weight.sum()
    # element-wise sums rather than `@`: a BLAS dot this long may start threads
    mean = float((latency * weight).sum() / total)
    violation_rate = float(weight[latency > target].sum() / total)
    order = latency.argsort()  # equal latencies may come in any order: the quantiles read their value
    cdf = weight[order].cumsum() / total

    def quantile(p: float) -> float:
        return float(latency[order[min(int(cdf.searchsorted(p)), latency.size - 1)]])

    return Predicted(
        switch_latency_p50_seconds=quantile(0.5),
        switch_latency_p95_seconds=quantile(0.95),
        switch_latency_mean_seconds=mean,
        slo_violation_rate=violation_rate,
        gpu_bytes=int(gpu_bytes),
        unserved_sessions=tuple(unserved),
    )
