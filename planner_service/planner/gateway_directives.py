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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

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


@dataclass(frozen=True, slots=True)
class DirectiveLimits:
    max_warmups_per_instance: int
    min_probability: float  # the predicted next model must be at least this likely
    # which model a warm-up is for: "top", the session's most likely next model (where that is the model it is on,
    # whose instance holds its KV, nothing is warmed); "handoff", the most likely model that holds none of its KV
    # (the hand-off it would have to prefill for), at least `min_probability` likely
    target: Literal["top", "handoff"] = "top"


def decide_directives(
    instances: Iterable[InstanceView],
    sessions: Iterable[SessionView],
    next_model: Mapping[str, Mapping[str, float]],
    kv_holders: Mapping[tuple[str, str], frozenset[str]],
    queued_gpus: frozenset[str],
    free_bytes: Mapping[str, int],
    kv_bytes_per_token: Mapping[str, int],
    limits: DirectiveLimits,
) -> tuple[list[PinDirective], list[WarmupDirective]]:
    """Pins, then warm-ups, each sorted by session.

    `next_model`: session -> model -> probability of its next request going there (the switch predictor).
    `kv_holders`: (session, model) -> instances whose GPUs hold that KV. `queued_gpus`: GPUs an open operation
    of the plan touches. `free_bytes`: GPU -> its capacity less what is resident on it.
    """
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
