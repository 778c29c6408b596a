"""The gateway's directives, decided from the live state (pure): pins and warm-ups.

A **pin** keeps a session on the instance that holds its KV where the plan keeps that KV on the instance's GPUs:
the gateway routes the session there and, with an LMCache controller configured, pins its history in that engine's
LMCache by token ids (clients/gateway/pins.py).

A **warm-up** prefills a session's known history on the model it is predicted to hand off to, while the session
sits in a tool call (a 1-token request with prefix caching on), so the hand-off's prefill finds the prefix cached.
A warm-up competes with real prefills for the card: on a loaded trace, warm-ups queued ahead of real prefills made
the hand-off P95 fifty times worse in an earlier replay of the Alibaba trace. So a warm-up is only directed to an idle card:
no operation of the plan open on it, no request of any session running or waiting on it, room for the session's
KV beside what the card holds, and at most `max_per_instance` per instance. The gateway checks idleness again
against its own in-flight requests, and cancels a warm-up the moment a real request comes for the instance.

Which warm-ups are worth their room is the planner's objective's question (`DirectiveLimits.target`). The
`priced` target answers it with the objective's own terms (planner/objective.py; the greedy prices keeping a
session's KV on GPU the same way, `_push_followers`): a warm-up of session s on instance i of model m is worth

    value(s, m, i) = w_s * q(s, m) * (L + V * [L > target_s])  -  price * bytes / GiB     [SLO-weighted s]
    L     = tokens_s * prefill_seconds_per_token(m, gpus of i)                             [s]
    bytes = tokens_s * kv_bytes_per_token(m)                                               [B]

  w_s, target_s  the SLO weight and switch-latency target of s's class (CostConstants.slo_weights, _targets)
  q(s, m)        the switch predictor's probability of s's next request going to m
  L              the re-prefill of s's history on i that the hand-off is spared (costs.prefill_seconds_per_token)
  V              the violation penalty, where that re-prefill alone misses the target
  price          CostConstants.gpu_price_seconds_per_gib, the objective's price of a GiB held on GPU (the
                 warm memory tax, costs.gpu_hold_cost): the price the greedy weighs every kept byte against

Warm-ups of positive value are directed best first, one per session, each on an idle instance whose every
card has the room (its free bytes; on an engine that reported its KV pool, also the pool beyond the KV of the
model placed there) and under the per-instance cap. Where the session's KV of m sits below the GPUs, the
hand-off might restore it in less than L; the value still credits the warm-up with the whole re-prefill, which
is what the gateway's warm-up computes, so it overrates such warm-ups. The fixed targets `top` and `handoff`
stay selectable (the service's `warmup_target`) and are the replay's ablations (sim/gateway_study.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from planner_service.domain.problem import Gpu, ModelSpec
from planner_service.domain.scenario import CostConstants, Slo
from planner_service.planner import costs
from planner_service.wire.routes import PinDirective, WarmupDirective


class InstanceView(NamedTuple):
    id: str
    model: str
    gpus: tuple[str, ...]
    routable: bool  # running, with a URL the gateway can send to


class SessionView(NamedTuple):  # a tuple: the route table builds one per session under the state lock
    id: str
    model: str  # the model of its last request
    busy: bool  # a request of it runs or waits now
    in_tool_call: bool
    context_tokens: int
    holder: str | None  # the instance whose GPUs hold its KV of `model`
    kept: bool  # the current plan keeps that KV on the holder's GPUs
    slo: Slo = Slo.INTERACTIVE  # its class: the weight and target the priced target reads


Target = Literal["priced", "top", "handoff"]


@dataclass(frozen=True, slots=True)
class DirectiveLimits:
    max_warmups_per_instance: int
    # the fixed targets' threshold: their predicted next model must be at least this likely (`priced` reads none)
    min_probability: float
    # which warm-ups to direct: "priced", those the objective values above their HBM price (module doc), best
    # first; "top", the session's most likely next model (where that is the model it is on, whose instance holds
    # its KV, nothing is warmed); "handoff", the most likely model that holds none of its KV (the hand-off it
    # would have to prefill for), at least `min_probability` likely
    target: Target = "priced"


@dataclass(frozen=True, slots=True)
class WarmupPricing:
    """What the `priced` target reads of the planner's cost model.

    `pool_room_bytes`: instance -> bytes its engine's KV pool has free on each GPU of its group (the pool less
    the KV of its model placed on that GPU), for engines that reported their pool; others are bounded by
    their cards' free bytes only."""

    models: Mapping[str, ModelSpec]
    gpus: Mapping[str, Gpu]
    constants: CostConstants
    pool_room_bytes: Mapping[str, int] = field(default_factory=dict)


def warmup_value(
    tokens: int, probability: float, slo: Slo, model: ModelSpec, gpus: Sequence[Gpu], constants: CostConstants
) -> float:
    """value(s, m, i) of the module doc, in SLO-weighted seconds: the expected re-prefill (and violation
    penalty) the warm-up spares the hand-off, less the HBM price of the KV it makes."""
    per_token = costs.prefill_seconds_per_token(model, gpus, constants)
    weight, target = constants.slo_weights.of(slo), constants.slo_targets_seconds.of(slo)
    return _value(tokens, probability, weight, target, per_token, tokens * model.kv_bytes_per_token, constants)


def _value(
    tokens: int, probability: float, weight: float, target: float, per_token: float, kv_bytes: int, c: CostConstants
) -> float:
    """`warmup_value` from its parts: the SLO class's weight and target, the instance's prefill seconds a token."""
    reprefill_seconds = tokens * per_token  # L
    late = c.violation_penalty_seconds if reprefill_seconds > target else 0.0
    return weight * probability * (reprefill_seconds + late) - costs.gpu_hold_cost(kv_bytes, c)


def decide_directives(
    instances: Iterable[InstanceView],
    sessions: Iterable[SessionView],
    next_model: Mapping[str, Mapping[str, float]],
    kv_holders: Mapping[tuple[str, str], frozenset[str]],
    queued_gpus: frozenset[str],
    free_bytes: Mapping[str, int],
    kv_bytes_per_token: Mapping[str, int],
    limits: DirectiveLimits,
    pricing: WarmupPricing | None = None,
) -> tuple[list[PinDirective], list[WarmupDirective]]:
    """Pins, then warm-ups, each sorted by session.

    `next_model`: session -> model -> probability of its next request going there (the switch predictor).
    `kv_holders`: (session, model) -> instances whose GPUs hold that KV. `queued_gpus`: GPUs an open operation
    of the plan touches. `free_bytes`: GPU -> its capacity less what is resident on it. `pricing`: what the
    `priced` target reads (required by it).
    """
    if limits.target == "priced" and pricing is None:
        raise ValueError("the priced warm-up target needs the cost model (pricing)")
    instances = list(instances)
    sessions = list(sessions)
    by_id = {i.id: i for i in instances}
    by_model: dict[str, list[InstanceView]] = {}
    for i in instances:
        by_model.setdefault(i.model, []).append(i)

    pins = sorted(
        (
            PinDirective(session=s.id, instance=s.holder, tokens=s.context_tokens)
            for s in sessions
            if s.holder is not None and s.kept and s.holder in by_id and by_id[s.holder].routable
        ),
        key=lambda p: p.session,
    )

    # a busy session occupies its KV holder's cards, or where it has none, every card of its model
    busy_gpus = set(queued_gpus)
    for s in sessions:
        if not s.busy:
            continue
        serving = [by_id[s.holder]] if s.holder in by_id else by_model.get(s.model, [])
        for i in serving:
            busy_gpus.update(i.gpus)
    idle: dict[str, list[InstanceView]] = {}  # model -> its routable instances on idle cards, by id
    for i in sorted(instances, key=lambda i: i.id):
        if i.routable and i.gpus and limits.max_warmups_per_instance > 0 and not busy_gpus.intersection(i.gpus):
            idle.setdefault(i.model, []).append(i)
    if not idle:
        return pins, []

    if limits.target == "priced":
        assert pricing is not None
        priced = _priced_warmups(sessions, next_model, kv_holders, idle, free_bytes, limits, pricing)
        return pins, sorted(priced, key=lambda w: w.session)

    # sessions on one model share their prediction row (the predictor is first-order): its best model once per row
    best: dict[int, tuple[str, float]] = {}
    candidates: list[tuple[float, int, str, str]] = []  # (-probability, -tokens, session, model)
    for s in sessions:
        if not s.in_tool_call or s.busy or s.context_tokens <= 0:
            continue
        row = next_model.get(s.id)
        if not row:
            continue
        if limits.target == "handoff":
            cold = [(p, m) for m, p in row.items() if m != s.model and not kv_holders.get((s.id, m))]
            if not cold:
                continue
            probability, model = max(cold)
        else:
            top = best.get(id(row))
            if top is None:
                top = best[id(row)] = max(row.items(), key=lambda kv: (kv[1], kv[0]))
            model, probability = top
        if probability < limits.min_probability or model not in idle or model not in kv_bytes_per_token:
            continue
        if kv_holders.get((s.id, model)):
            continue  # an instance of that model holds the session's KV already: nothing to warm
        candidates.append((-probability, -s.context_tokens, s.id, model))
    candidates.sort()

    free = dict(free_bytes)
    per_instance: dict[str, int] = {}
    warmups: list[WarmupDirective] = []
    for neg_p, neg_tokens, sid, model in candidates:
        tokens = -neg_tokens
        for i in idle[model]:
            if per_instance.get(i.id, 0) >= limits.max_warmups_per_instance:
                continue
            share = -(-tokens * kv_bytes_per_token[model] // len(i.gpus))  # the KV is sharded over the group
            if any(free.get(g, 0) < share for g in i.gpus):
                continue
            for g in i.gpus:
                free[g] -= share
            per_instance[i.id] = per_instance.get(i.id, 0) + 1
            warmups.append(
                WarmupDirective(session=sid, model=model, instance=i.id, tokens=tokens, probability=round(-neg_p, 2))
            )
            break
    warmups.sort(key=lambda w: w.session)
    return pins, warmups


def _priced_warmups(
    sessions: list[SessionView],
    next_model: Mapping[str, Mapping[str, float]],
    kv_holders: Mapping[tuple[str, str], frozenset[str]],
    idle: Mapping[str, list[InstanceView]],
    free_bytes: Mapping[str, int],
    limits: DirectiveLimits,
    pricing: WarmupPricing,
) -> list[WarmupDirective]:
    """The `priced` target (module doc): every (session, model, idle instance) of positive value, best first,
    one per session, within the cards' and pools' room and the per-instance cap."""
    c = pricing.constants
    # model -> (instance, its prefill seconds per token) of each idle instance, computed once per table
    speeds = {
        m: [
            (i.id, costs.prefill_seconds_per_token(pricing.models[m], [pricing.gpus[g] for g in i.gpus], c))
            for i in row
        ]
        for m, row in idle.items()
        if m in pricing.models
    }
    classes = {slo: (c.slo_weights.of(slo), c.slo_targets_seconds.of(slo)) for slo in Slo}
    candidates: list[tuple[float, str, str, str, int, float]] = []  # (-value, session, instance, model, tokens, p)
    for s in sessions:
        if not s.in_tool_call or s.busy or s.context_tokens <= 0:
            continue
        weight, target = classes[s.slo]
        for model_id, probability in (next_model.get(s.id) or {}).items():  # (the sort below breaks ties by id)
            if probability <= 0 or model_id not in speeds or kv_holders.get((s.id, model_id)):
                continue  # not predicted, no idle instance, or an instance of the model holds its KV already
            kv_bytes = s.context_tokens * pricing.models[model_id].kv_bytes_per_token
            for iid, per_token in speeds[model_id]:
                value = _value(s.context_tokens, probability, weight, target, per_token, kv_bytes, c)
                if value > 0:
                    candidates.append((-value, s.id, iid, model_id, s.context_tokens, probability))
    candidates.sort()

    by_id = {i.id: i for row in idle.values() for i in row}
    free = dict(free_bytes)
    pool = dict(pricing.pool_room_bytes)
    per_instance: dict[str, int] = {}
    warmed: set[str] = set()
    warmups: list[WarmupDirective] = []
    open_instances = len(by_id)  # those under the cap: none left, nothing more can be directed
    for neg_value, sid, iid, model_id, tokens, probability in candidates:
        if not open_instances:
            break
        if sid in warmed or per_instance.get(iid, 0) >= limits.max_warmups_per_instance:
            continue
        i = by_id[iid]
        share = -(-tokens * pricing.models[model_id].kv_bytes_per_token // len(i.gpus))  # sharded over the group
        if any(free.get(g, 0) < share for g in i.gpus) or pool.get(iid, share) < share:
            continue
        for g in i.gpus:
            free[g] -= share
        if iid in pool:
            pool[iid] -= share
        per_instance[iid] = per_instance.get(iid, 0) + 1
        if per_instance[iid] == limits.max_warmups_per_instance:
            open_instances -= 1
        warmed.add(sid)
        warmups.append(
            WarmupDirective(
                session=sid,
                model=model_id,
                instance=iid,
                tokens=tokens,
                probability=round(probability, 2),
                value_seconds=round(-neg_value, 3),
            )
        )
    return warmups
