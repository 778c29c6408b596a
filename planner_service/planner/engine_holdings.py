"""What engine instances hold on their GPUs beside the placement's bytes, for the solvers and the checker:
the CUDA context of every instance up, the KV pool a running engine was launched with (and the KV in it),
and the GPU expert share it was launched with (planner_service/domain/engines.py `holdings`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from planner_service.domain.engines import (
    EngineState,
    Management,
    context_bytes_per_gpu,
    holdings,
    launch_kv_pool_bytes_per_gpu,
    min_kv_pool_bytes_per_gpu,
)
from planner_service.domain.problem import Problem
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.planner.engine_instances import (
    ENGINE_CONSTANTS,
    InstanceView,
    Key,
    confirmed_states,
    engine_instance,
)


def keeps_context(view: InstanceView) -> bool:
    """Whether the instance keeps at least the CUDA context of a sleep on its GPUs whatever a plan does, until a
    plan wakes it (engines.holdings): an adopted engine (it only sleeps and wakes), and a managed one asleep. A
    plan's steps ride on the moves of the bytes they free, and a sleeping engine's stop frees nothing the SRV
    places on its GPUs (its host backup's drop carries it, and at level 2 nothing does), so no move that fills
    those GPUs would wait for it: its context is not the plan's to give."""
    if not view.gpus or view.state is EngineState.STOPPED:
        return False
    return view.declared.management is Management.ADOPTED or view.state in (
        EngineState.ASLEEP_HOST,
        EngineState.ASLEEP_DISCARDED,
    )


def kept_contexts(states: Mapping[Key, InstanceView]) -> dict[Key, tuple[tuple[str, ...], int]]:
    """(node, model) -> (GPUs, bytes on each) that an engine keeps on its GPUs whatever a plan does
    (`keeps_context`)."""
    return {
        key: (view.gpus, ENGINE_CONSTANTS.context_bytes_per_gpu) for key, view in states.items() if keeps_context(view)
    }


def context_bytes(view: InstanceView) -> int:
    """GPU bytes per GPU of its group that an instance up (running, or asleep) holds beside its weights and
    pool: its CUDA context (engines.holdings). Counted on every engine node; the GPU's `reserved_bytes` stays
    the operator's workspace (on the demo's n1, three TP-4 engines' contexts and a sleeping one's took more
    than its 2 GiB reserve, and a start ran out of memory)."""
    return context_bytes_per_gpu(view.state, ENGINE_CONSTANTS) if view.gpus else 0


def up_contexts(states: Mapping[Key, InstanceView]) -> dict[str, int]:
    """GPU -> the bytes of the CUDA contexts of the instances up on it (`context_bytes`)."""
    out: dict[str, int] = defaultdict(int)
    for view in states.values():
        for g in view.gpus if context_bytes(view) else ():
            out[g] += context_bytes(view)
    return out


def residue_bytes(problem: Problem, view: InstanceView) -> int:
    """GPU bytes per GPU a sleeping instance keeps (its CUDA context; engines.holdings)."""
    if view.state not in (EngineState.ASLEEP_HOST, EngineState.ASLEEP_DISCARDED) or not view.gpus:
        return 0
    return holdings(engine_instance(problem, view), view.state, ENGINE_CONSTANTS).gpu_bytes[view.gpus[0]]


def pooled_kv(
    problem: Problem, states: Mapping[Key, InstanceView]
) -> dict[Key, tuple[str, tuple[str, ...], dict[tuple[StateObject, Location], int]]]:
    """(node, model) -> (precision, GPUs, the sessions' KV on them) of each running engine: while it runs as
    it is, that KV stays in its fixed pool (vLLM and SGLang free no one request's KV; only the pool's LRU
    evicts, for the same model's new KV), so its room is that instance's, not another model's."""
    running = {
        (view.node, view.model): view
        for view in states.values()
        if view.state is EngineState.RUNNING and view.precision is not None and view.gpus
    }
    out: dict[Key, tuple[str, tuple[str, ...], dict[tuple[StateObject, Location], int]]] = {}
    for (obj, loc), nbytes in problem.residency.items():
        if obj.kind is not Kind.KV or loc.tier is not Tier.GPU or nbytes <= 0:
            continue
        view = running.get((problem.gpus[loc.id].node, obj.model))
        if view is not None and loc.id in view.gpus:
            assert view.precision is not None  # a running instance
            entry = out.setdefault((view.node, view.model), (view.precision, view.gpus, {}))
            entry[2][(obj, loc)] = nbytes
    return out


def min_pool_bytes_per_gpu(problem: Problem, model_id: str, tp: int) -> int:
    """The smallest KV pool, per GPU, an engine of the model on `tp` GPUs starts with: one request of the
    model's maximum context (engines.min_kv_pool_bytes_per_gpu). Where the catalog does not know that
    context, the longest any of the model's sessions holds stands in: the engine serves it, so its limit is
    no shorter."""
    spec = problem.models[model_id]
    context = spec.max_context_tokens or _longest_contexts(problem).get(model_id, 0)
    return min_kv_pool_bytes_per_gpu(spec.kv_bytes_per_token, context, tp, spec.kv_heads)


_LONGEST: list[tuple[Problem, dict[str, int]]] = []  # the last problems' longest session context per model


def _longest_contexts(problem: Problem) -> dict[str, int]:
    for seen, longest in _LONGEST:
        if seen is problem:
            return longest
    longest = {}
    for s in problem.sessions.values():
        longest[s.model] = max(longest.get(s.model, 0), s.context_tokens)
    _LONGEST.insert(0, (problem, longest))
    del _LONGEST[4:]
    return longest


def kv_per_gpu(
    placement: Mapping[tuple[StateObject, Location], int], model_id: str | None = None
) -> dict[tuple[str, str], int]:
    """(model, GPU) -> the sessions' KV bytes the placement puts there (of one model, where given)."""
    out: dict[tuple[str, str], int] = defaultdict(int)
    for (obj, loc), nbytes in placement.items():
        if obj.kind is Kind.KV and loc.tier is Tier.GPU and nbytes > 0 and (model_id is None or obj.model == model_id):
            out[(obj.model, loc.id)] += nbytes
    return out


def launched_pools(
    problem: Problem, states: Mapping[Key, InstanceView], kv_now: Mapping[tuple[str, str], int] | None = None
) -> dict[Key, int]:
    """(node, model) -> the KV pool per GPU each running engine holds now: the one its node reported
    (`Problem.engine_pools`), else the pool the launch rule (engines.launch_kv_pool_bytes_per_gpu) gives for
    the most KV it holds on one GPU of its group, no larger than the room its GPUs have beside everything
    else confirmed there and the contexts of the instances up in `states` (the engine runs, so its pool fit)
    and never below the KV it holds. A pool that LRU has since emptied below its launch size reads smaller:
    the planner then keeps less KV there than the engine could, never more. `kv_now`: the (model, GPU) KV bytes to derive from, where not the confirmed
    placement's."""
    now = kv_per_gpu(problem.residency) if kv_now is None else kv_now
    used: dict[str, int] = up_contexts(states)  # the contexts of the instances up: the pool fit beside them
    for (_, loc), nbytes in problem.residency.items():
        if loc.tier is Tier.GPU:
            used[loc.id] += nbytes
    out = {}
    for key, view in states.items():
        if view.state is not EngineState.RUNNING or not view.gpus:
            continue
        reported = problem.engine_pools.get(key)
        if reported is not None:
            out[key] = reported
            continue
        held = max((now.get((view.model, g), 0) for g in view.gpus), default=0)
        room = min(problem.gpus[g].capacity_bytes - used.get(g, 0) + now.get((view.model, g), 0) for g in view.gpus)
        rule = launch_kv_pool_bytes_per_gpu(min_pool_bytes_per_gpu(problem, view.model, len(view.gpus)), held)
        out[key] = max(held, min(rule, room))
    return out


def launched_experts(
    problem: Problem, states: Mapping[Key, InstanceView]
) -> dict[Key, tuple[str, tuple[str, ...], dict[str, int]]]:
    """(node, model) -> (precision, GPUs, routed-expert bytes on each of the node's GPUs) of each running MoE
    instance that holds experts there: its GPU expert share is a launch setting, so while it runs as it is
    they stay exactly as they are (`engine_target` holds them there), and their room is not another's. A
    sleeping one whose node reported its launched share (`Problem.asleep_expert_fractions`) holds that share
    of the experts, split evenly over its group, once a plan wakes it as it is: its wake maps them back."""
    out: dict[Key, tuple[str, tuple[str, ...], dict[str, int]]] = {}
    for (node, model), view in states.items():
        experts_bytes = problem.models[model].experts_bytes
        if view.precision is None or not experts_bytes or not view.gpus:
            continue
        if view.state is EngineState.RUNNING:
            obj = StateObject.experts(model)
            on = problem.nodes[node].gpus
            held = {g: n for g in on if (n := problem.residency.get((obj, Location.gpu(g)), 0))}
        elif view.state in (EngineState.ASLEEP_HOST, EngineState.ASLEEP_DISCARDED):
            share = int(problem.asleep_expert_fractions.get((node, model), 0.0) * experts_bytes)
            base, extra = divmod(share, len(view.gpus))  # as the greedy shards: the remainder on the first
            held = {g: n for i, g in enumerate(view.gpus) if (n := base + (i < extra))}
        else:
            continue
        if held:
            out[(node, model)] = (view.precision, view.gpus, held)
    return out


def woken_pools(
    problem: Problem, before: Mapping[Key, InstanceView], after: Mapping[Key, InstanceView]
) -> dict[Key, int]:
    """(node, model) -> the KV pool per GPU of each sleeping instance `after` wakes as it is, where its node
    reported the pool it was launched with (`Problem.engine_pools`): a wake maps the pool back at its launched
    size (vllm/device_allocator/cumem.py `CuMemAllocator.wake_up`), whatever KV the plan means to put there."""
    out = {}
    for key, a in after.items():
        b = before.get(key)
        if (
            b is not None
            and b.state in (EngineState.ASLEEP_HOST, EngineState.ASLEEP_DISCARDED)
            and a.state is EngineState.RUNNING
            and b.same_instance(a)
            and key in problem.engine_pools
        ):
            out[key] = problem.engine_pools[key]
    return out


def kv_pools(
    problem: Problem,
    placement: Mapping[tuple[StateObject, Location], int],
    after: Mapping[Key, InstanceView],
    before: Mapping[Key, InstanceView] | None = None,
) -> dict[Key, int]:
    """(node, model) -> the KV pool per GPU of each instance running after the plan: an instance that runs on
    as it is keeps the pool it was launched with (`launched_pools`), and so does one the plan wakes where its
    node reported that pool (`woken_pools`); one the plan starts or restarts, or wakes with its pool unknown,
    is launched with engines.launch_kv_pool_bytes_per_gpu(its minimum, the most KV the placement puts on
    one GPU of its group)."""
    before = confirmed_states(problem) if before is None else before
    kept = launched_pools(problem, before) | woken_pools(problem, before, after)
    per_gpu = kv_per_gpu(placement)
    out = {}
    for key, view in after.items():
        if view.state is not EngineState.RUNNING:
            continue
        b = before.get(key)
        if b is not None and b.same_instance(view) and key in kept:
            out[key] = kept[key]
            continue
        planned = max((per_gpu.get((view.model, g), 0) for g in view.gpus), default=0)
        out[key] = launch_kv_pool_bytes_per_gpu(min_pool_bytes_per_gpu(problem, view.model, len(view.gpus)), planned)
    return out


def expert_fractions(
    problem: Problem, placement: Mapping[tuple[StateObject, Location], int], states: Mapping[Key, InstanceView]
) -> dict[Key, float]:
    """(node, model) -> the share of a MoE's routed experts a running instance holds on its group: what the
    placement puts there (a launch setting: the experts of a running instance stay as they are)."""
    out = {}
    for key, view in states.items():
        experts_bytes = problem.models[view.model].experts_bytes
        if view.state is not EngineState.RUNNING or not experts_bytes:
            continue
        obj = StateObject.experts(view.model)
        on_group = sum(placement.get((obj, Location.gpu(g)), 0) for g in view.gpus)
        out[key] = min(on_group / experts_bytes, 1.0)
    return out


def gpu_used(problem: Problem, placement: Mapping[tuple[StateObject, Location], int]) -> dict[str, int]:
    used: dict[str, int] = defaultdict(int)
    for (_, loc), nbytes in placement.items():
        if loc.tier is Tier.GPU:
            used[loc.id] += nbytes
    return used
