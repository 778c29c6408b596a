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

    value(s, m, i) = w_s * q(s, m) * u_s * (R + V * share(R_j > target_s))  -  price * GiB * hold_s / H
    R     = mean over the running instances j of m of R_j                                  [s]
    R_j   = costs.kv_ready_seconds(tokens_s, restorable on j's node, m, gpus of j)          [s]

  w_s, target_s  the SLO weight and switch-latency target of s's class (CostConstants.slo_weights, _targets)
  q(s, m)        the switch predictor's probability that s's next request, whenever it comes, goes to m
  u_s, hold_s    `SwitchPredictor.next_turn` over the objective's horizon H (CostConstants.horizon_seconds): the
                 chance that next request comes within H at all (the session may end instead), and how long
                 the warm-up's KV is expected to be held until it comes, used or not (H where it never does)
  R_j            what the hand-off would pay to ready the history without the warm-up on instance j: re-prefill
                 it, or restore it from host DRAM or NVMe where that node holds it, the cheaper (the
                 restore-or-prefill rule). Without a KV holder, the gateway sends the session to the running
                 instance its id hashes to (clients/gateway/table.py `choose`), evenly over them: R is the mean
                 over those instances, not the candidate's own re-prefill, so a slower candidate is not worth
                 more. With the warm-up the hand-off goes to i and finds the history computed.
  V              the violation penalty, for the share of those instances where R_j misses the target
  price          CostConstants.gpu_price_seconds_per_gib, the objective's price of a GiB held on GPU over H (the
                 warm memory tax, costs.gpu_hold_cost), charged for the hold_s seconds of H the KV is expected
                 to be held

Where the predictor's timing is not given (`WarmupPricing.next_turn`), u = 1 and the KV is charged for the whole
horizon. Warm-ups of positive value are directed best first (ties: the faster instance, where the hand-off's new
tokens prefill), one per session, each on an idle instance whose every card has the room (its free bytes; on an
engine that reported its KV pool, also the pool beyond the KV of the model placed there) and under the
per-instance cap. What the value leaves out: a warm-up the gateway cancels for a real request (it holds its KV
only while it runs); the time the session has already sat in its tool call (the gap is taken from its start); and
the KV of a warm-up whose session's next request went elsewhere, which stays until evicted: past that request,
keeping it is the greedy's ordinary choice for a session's KV, priced there, but a policy that does not evict it
(the replay's LRU baselines) holds it longer than the value charged for.
The fixed targets `top` and `handoff` stay selectable (the service's `warmup_target`) and are the replay's
ablations (sim/gateway_study.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from planner_service.domain.problem import Gpu, ModelSpec, Node
from planner_service.domain.scenario import CostConstants, Slo
from planner_service.domain.state import Tier
from planner_service.planner import costs
from planner_service.planner.predictor import NextTurn
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
    their cards' free bytes only. `restorable`: (session, model) -> node -> (tier, bytes) of that KV below the
    node's GPUs where the node can load it back (a node missing from `nodes` restores nothing). `next_turn`: the
    model a session's last request went to -> `SwitchPredictor.next_turn` over the horizon."""

    models: Mapping[str, ModelSpec]
    gpus: Mapping[str, Gpu]
    constants: CostConstants
    pool_room_bytes: Mapping[str, int] = field(default_factory=dict)
    nodes: Mapping[str, Node] = field(default_factory=dict)
    restorable: Mapping[tuple[str, str], Mapping[str, tuple[Tier, int]]] = field(default_factory=dict)
    next_turn: Mapping[str, NextTurn] = field(default_factory=dict)


def warmup_value(
    probability: float,
    slo: Slo,
    ready_seconds: Sequence[float],
    kv_bytes: int,
    constants: CostConstants,
    turn: NextTurn | None = None,
) -> float:
    """value(s, m, i) of the module doc, in SLO-weighted seconds: the expected readying of the history (and
    violation penalty) the warm-up spares the hand-off, less the HBM price of its KV for as long as it is held.
    `ready_seconds`: R_j on each instance the hand-off would otherwise go to; `turn`: u and hold (None: 1, H)."""
    c = constants
    weight, target = c.slo_weights.of(slo), c.slo_targets_seconds.of(slo)
    n = len(ready_seconds)
    saved = sum(ready_seconds) / n
    late = c.violation_penalty_seconds * sum(1 for r in ready_seconds if r > target) / n
    within, held = (1.0, c.horizon_seconds) if turn is None else turn
    return weight * probability * within * (saved + late) - costs.gpu_hold_cost(kv_bytes, c) * (
        held / c.horizon_seconds
    )


def handoff_ready_seconds(
    tokens: int,
    model: ModelSpec,
    gpus: Sequence[Gpu],
    restorable: tuple[Tier, int] | None,
    node: Node | None,
    c: CostConstants,
) -> float:
    """R_j: ready `tokens` of history on `gpus` without a warm-up (`costs.kv_ready_seconds`: restore what the
    node holds below its GPUs, or re-prefill, the cheaper)."""
    if restorable is None or node is None:
        return costs.prefill_seconds(tokens, 0, model, gpus, c)
    tier, nbytes = restorable
    return costs.kv_ready_seconds(tokens, nbytes, model, gpus, tier, node, c)


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
        routable = {m: [i for i in row if i.routable and i.gpus] for m, row in by_model.items()}
        priced = _priced_warmups(sessions, next_model, kv_holders, idle, routable, free_bytes, limits, pricing)
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
    routable: Mapping[str, list[InstanceView]],
    free_bytes: Mapping[str, int],
    limits: DirectiveLimits,
    pricing: WarmupPricing,
) -> list[WarmupDirective]:
    """The `priced` target (module doc): every (session, model, idle instance) of positive value, best first,
    one per session, within the cards' and pools' room and the per-instance cap."""
    c = pricing.constants
    # model -> (prefill seconds per token, instance) of each idle instance, the faster first, once per table
    speeds = {
        m: sorted(
            (costs.prefill_seconds_per_token(pricing.models[m], [pricing.gpus[g] for g in i.gpus], c), i.id)
            for i in row
        )
        for m, row in idle.items()
        if m in pricing.models
    }
    # model -> (GPUs, node) of each instance a hand-off without a KV holder may be sent to (the gateway's hash)
    served = {
        m: [([pricing.gpus[g] for g in i.gpus], pricing.gpus[i.gpus[0]].node) for i in routable[m]] for m in speeds
    }
    candidates: list[tuple[float, str, float, str, str, int, float]] = []  # (-value, session, s/token, instance, ...)
    for s in sessions:
        if not s.in_tool_call or s.busy or s.context_tokens <= 0:
            continue
        turn = pricing.next_turn.get(s.model)
        for model_id, probability in (next_model.get(s.id) or {}).items():  # (the sort below breaks ties by id)
            if probability <= 0 or model_id not in speeds or kv_holders.get((s.id, model_id)):
                continue  # not predicted, no idle instance, or an instance of the model holds its KV already
            model = pricing.models[model_id]
            below = pricing.restorable.get((s.id, model_id), {})
            ready = [
                handoff_ready_seconds(s.context_tokens, model, gpus, below.get(n), pricing.nodes.get(n), c)
                for gpus, n in served[model_id]
            ]
            value = warmup_value(probability, s.slo, ready, s.context_tokens * model.kv_bytes_per_token, c, turn)
            if value > 0:  # the same on every idle instance of the model: the faster is tried first
                for per_token, iid in speeds[model_id]:
                    candidates.append((-value, s.id, per_token, iid, model_id, s.context_tokens, probability))
    candidates.sort()

    by_id = {i.id: i for row in idle.values() for i in row}
    free = dict(free_bytes)
    pool = dict(pricing.pool_room_bytes)
    per_instance: dict[str, int] = {}
    warmed: set[str] = set()
    warmups: list[WarmupDirective] = []
    open_instances = len(by_id)  # those under the cap: none left, nothing more can be directed
    for neg_value, sid, _, iid, model_id, tokens, probability in candidates:
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
