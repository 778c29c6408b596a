"""A session's KV on an engine node (vLLM, SGLang) is predicted, not commanded: it stays where the engine's
pool and LMCache's LRU keep it, leaves the GPUs only with its engine, and a running or woken engine holds
no more of it on a GPU than the pool it was launched with.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from planner_service.domain.engines import (
    EngineState,
    kv_held_in_pool,
)
from planner_service.domain.problem import Problem
from planner_service.domain.state import Kind, Location, Placement, StateObject, Tier
from planner_service.planner.engine_holdings import gpu_used, launched_pools, woken_pools
from planner_service.planner.engine_instances import InstanceView, Key


def kv_predicted(
    problem: Problem, out: Placement, before: Mapping[Key, InstanceView], after: Mapping[Key, InstanceView]
) -> None:
    """A session's KV on an engine node is not commanded: below the GPUs it stays where LMCache keeps it, on a
    GPU it stays while its engine runs there unchanged and leaves with its engine; new KV on the running
    engine's GPUs is its prefill, and where that KV needs the room, the engine's pool evicts (LRU) the KV
    the solver let go of on that GPU."""
    confirmed = problem.residency
    keys = {k for k in out if k[0].kind is Kind.KV} | {k for k in confirmed if k[0].kind is Kind.KV}
    kept: dict[str, list[tuple[tuple[StateObject, Location], int]]] = defaultdict(list)  # gpu -> (key, wanted)
    strays: dict[tuple[StateObject, str], int] = defaultdict(int)  # (KV, node) -> bytes planned off the group
    for key in sorted(keys):
        obj, loc = key
        node = problem.gpus[loc.id].node if loc.tier is Tier.GPU else loc.id
        b, a = before.get((node, obj.model)), after.get((node, obj.model))
        if b is None or a is None:
            continue
        was = confirmed.get(key, 0)
        if loc.tier is not Tier.GPU:
            set_bytes(out, key, was)
        elif a.state is not EngineState.RUNNING or loc.id not in a.gpus:
            if a.state is EngineState.RUNNING:
                strays[(obj, a.node)] += out.get(key, 0)  # planned beside a group the engine cannot leave
            set_bytes(out, key, 0)
        elif b.state is EngineState.RUNNING and b.same_instance(a) and was > out.get(key, 0):
            kept[loc.id].append((key, out.get(key, 0)))
            set_bytes(out, key, was)
    for (obj, node), nbytes in sorted(strays.items()):
        if nbytes:  # the session's KV follows its engine's group whole (never past its size), split evenly
            group = after[(node, obj.model)].gpus
            held = sum(out.get((obj, Location.gpu(g)), 0) for g in group)
            grow = min(nbytes, problem.size_of(obj) - held)
            for i, g in enumerate(group):
                add = grow // len(group) + (1 if i < grow % len(group) else 0)
                if add > 0:
                    set_bytes(out, (obj, Location.gpu(g)), out.get((obj, Location.gpu(g)), 0) + add)
    if not kept:
        return
    used = gpu_used(problem, out)
    for gpu_id, entries in kept.items():
        gains = {
            k[0].model for k, n in out.items() if k[1].id == gpu_id and k[0].kind is Kind.KV and n > confirmed.get(k, 0)
        }
        for key, wanted in entries:
            if used[gpu_id] <= problem.gpus[gpu_id].capacity_bytes:
                break
            if key[0].model in gains:  # the pool makes room for its own new KV
                used[gpu_id] -= out[key] - wanted
                set_bytes(out, key, wanted)


def kv_within_pools(
    problem: Problem, out: Placement, before: Mapping[Key, InstanceView], after: Mapping[Key, InstanceView]
) -> None:
    """A running engine that runs on as it is, or a sleeping one woken whose pool its node reported, holds no
    more KV on a GPU than the pool it was launched with (engines.kv_held_in_pool): the KV the target grows
    there beyond it is not on the GPU (its pool's LRU keeps it out; it is where LMCache keeps it below, or gone
    and re-prefilled)."""
    staying = {
        key: a
        for key, a in after.items()
        if a.state is EngineState.RUNNING and (b := before[key]).state is EngineState.RUNNING and b.same_instance(a)
    }
    woken = woken_pools(problem, before, after)
    if not staying and not woken:
        return
    # every instance up now counts in the room the pools were launched into, the ones the plan stops included
    pools = {key: pool for key, pool in launched_pools(problem, before).items() if key in staying} | woken
    staying |= {key: after[key] for key in woken}
    groups = {(a.model, g) for a in staying.values() for g in a.gpus}
    on: dict[tuple[str, str], list[tuple[tuple[StateObject, Location], int]]] = defaultdict(list)
    for k, n in out.items():
        if k[0].kind is Kind.KV and k[1].tier is Tier.GPU and (k[0].model, k[1].id) in groups:
            on[(k[0].model, k[1].id)].append((k, n))
    for key, a in staying.items():
        pool = pools[key]
        for g in a.gpus:
            held = on.get((a.model, g), [])
            total = sum(n for _, n in held)
            over = total - kv_held_in_pool(pool, total)
            if over <= 0:
                continue
            # the pool's LRU evicts what was used least recently: idle sessions' KV before the active ones',
            # the KV a plan would grow before what the engine holds now
            cuts = []
            for k, n in held:
                active = _active(problem, k[0])
                was = min(n, problem.residency.get(k, 0))
                cuts += [((active, 0, k), k, n - was), ((active, 1, k), k, was)]
            for _, k, nbytes in sorted(cuts, key=lambda c: c[0]):
                cut = min(over, nbytes)
                if cut > 0:
                    set_bytes(out, k, out.get(k, 0) - cut)
                    over -= cut
                if over <= 0:
                    break


def _active(problem: Problem, obj: StateObject) -> bool:
    session = problem.sessions.get(obj.session or "")
    return session is not None and session.active


def set_bytes(out: Placement, key: tuple[StateObject, Location], nbytes: int) -> None:
    if nbytes > 0:
        out[key] = nbytes
    else:
        out.pop(key, None)
