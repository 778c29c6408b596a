"""What a target may ask of the engines: `engine_target` turns a solver's target into one the engines can
reach (DESIGN.md §5). On engine nodes a session's KV is predicted, not commanded (`engine_kv`), a running
engine's GPU expert share is its launch setting, an engine the target takes off its GPUs sleeps or stops as
its kind allows (a level-1 sleep keeps a host copy only where it is offered and its residue fits), and a
wake frees the backup.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planner_service.domain.engines import (
    EngineState,
    Management,
    Transition,
    may,
)
from planner_service.domain.problem import Problem
from planner_service.domain.state import Kind, Location, Placement, StateObject, Tier
from planner_service.planner.engine_holdings import gpu_used, kv_per_gpu, kv_pools, residue_bytes, up_contexts
from planner_service.planner.engine_instances import (
    ENGINE_CONSTANTS,
    InstanceView,
    Key,
    can_leave,
    engine_instance,
    has_lmcache,
    instance_states,
    offers_level_1,
    transition_between,
)
from planner_service.planner.engine_kv import kv_predicted, kv_within_pools, set_bytes


@dataclass(frozen=True, slots=True)
class EngineTarget:
    """A target the engines can reach, the instances' states in it, and the (model, node) pairs whose GPU
    copies may not be demoted to host RAM (no level-1 sleep there: the host copy is read ahead instead)."""

    placement: Placement
    after: dict[Key, InstanceView]
    no_backup: frozenset[tuple[str, str]]
    kv_prefill_only: frozenset[tuple[str, str]] = frozenset()  # engines without LMCache: no KV loaded back


def engine_target(
    problem: Problem,
    target: Mapping[tuple[StateObject, Location], int],
    before: Mapping[Key, InstanceView],
) -> EngineTarget:
    """`target` with what the engines cannot be asked taken out (the module's docstring), and its states."""
    if not before:
        return EngineTarget(dict(target), {}, frozenset())
    out: Placement = dict(target)
    for b in before.values():
        if b.state is EngineState.RUNNING and not can_leave(b):
            _keep_on_gpus(problem, out, b)
    derived = instance_states(problem, out)
    for key, b in before.items():
        a = derived[key]
        if a.state is EngineState.RUNNING and not b.same_instance(a) and not _reachable(problem, b, a):
            _keep_on_gpus(problem, out, b)  # only someone else starts an adopted engine
    derived = instance_states(problem, out)
    # which instances run is the solver's; KV and expert shares follow them, then the rest sleep or stop
    kv_predicted(problem, out, before, derived)
    kv_within_pools(problem, out, before, derived)
    _expert_share_fixed(problem, out, before, derived)
    after: dict[Key, InstanceView] = {}
    used = gpu_used(problem, out)
    # a running engine's pool takes its room whole, the KV in it or not, and its context is there too:
    # sleeping residue fits beside them
    for g, nbytes in up_contexts({k: a for k, a in derived.items() if a.state is EngineState.RUNNING}).items():
        used[g] += nbytes
    kv_on = kv_per_gpu(out)
    for key, pool in kv_pools(problem, out, derived, before).items():
        for g in derived[key].gpus:
            used[g] += max(0, pool - kv_on.get((key[1], g), 0))
    # the sleepers left asleep first: their contexts stay whatever, and a sleep of a running one fits beside them
    for key, b in before.items():
        a = derived[key]
        if b.state in (EngineState.ASLEEP_HOST, EngineState.ASLEEP_DISCARDED) and a.state is not EngineState.RUNNING:
            after[key] = stays_asleep_or_stops(problem, b, a, out, used)
    for key, b in before.items():
        a = derived[key]
        if b.state is EngineState.RUNNING and a.state is not EngineState.RUNNING:
            a = sleep_or_stop(problem, b, a, out, used)
        after.setdefault(key, a)
    after = {key: after[key] for key in before}
    for key, a in after.items():
        b = before[key]
        if b.state is EngineState.ASLEEP_HOST and a.state is EngineState.RUNNING and b.same_instance(a):
            _drop_host_weights(problem, out, key)  # the wake frees the backup (vllm/device_allocator/cumem.py)
    no_backup = frozenset(
        (model, node)
        for (node, model), a in after.items()
        if not (a.state is EngineState.ASLEEP_HOST and before[(node, model)].state is EngineState.RUNNING)
    )
    prefill_only = frozenset((model, node) for (node, model), a in after.items() if not has_lmcache(a))
    return EngineTarget(out, after, no_backup, prefill_only)


def _reachable(problem: Problem, b: InstanceView, a: InstanceView) -> bool:
    transition = transition_between(b, a)
    if transition is None:
        return True
    return may(engine_instance(problem, b if transition is Transition.WAKE else a), b.state, transition).allowed


def _keep_on_gpus(problem: Problem, out: Placement, view: InstanceView) -> None:
    """The weights and experts of an instance stay exactly where they are (none where it is stopped)."""
    node_gpus = set(problem.nodes[view.node].gpus)
    for key in [k for k in out if k[0].model == view.model and k[0].kind is not Kind.KV and k[1].tier is Tier.GPU]:
        if key[1].id in node_gpus:
            del out[key]
    for (obj, loc), nbytes in problem.residency.items():
        if obj.model == view.model and obj.kind is not Kind.KV and loc.tier is Tier.GPU and loc.id in view.gpus:
            out[(obj, loc)] = nbytes


def _host_used(placement: Mapping[tuple[StateObject, Location], int], node: str) -> int:
    host = Location.host(node)
    return sum(nbytes for (_, loc), nbytes in placement.items() if loc == host)


def _fits(problem: Problem, gpus: Sequence[str], extra: int, used: Mapping[str, int]) -> bool:
    return all(used.get(g, 0) + extra <= problem.gpus[g].capacity_bytes for g in gpus)


def sleep_or_stop(
    problem: Problem, b: InstanceView, a: InstanceView, out: Placement, used: dict[str, int]
) -> InstanceView:
    """A running instance the target takes off its GPUs: a level-1 sleep where the kind offers one, its
    context fits beside the target on its GPUs and its weights fit in the node's host RAM (a wake from host
    costs wake_fixed + shard / h2d, a start from the page cache cold_start_fixed more: engines.py), the
    weights' host copy added to the target; else a stop (managed) or a level-2 sleep (adopted)."""
    residue = ENGINE_CONSTANTS.context_bytes_per_gpu
    managed = b.declared.management is Management.MANAGED
    assert b.precision is not None  # a running instance
    backup = (StateObject.weights(b.model, b.precision), Location.host(b.node))
    room = out.get(backup, 0) + problem.nodes[b.node].host_bytes - _host_used(out, b.node)
    size = problem.models[b.model].weights_bytes[b.precision]
    level_1 = offers_level_1(b.declared) and size <= room
    # an adopted engine cannot stop: it sleeps whether or not its context fits (the checker tells)
    if level_1 and (_fits(problem, b.gpus, residue, used) or not managed):
        for g in b.gpus:
            used[g] += residue
        out[backup] = size
        return InstanceView(b.node, b.model, b.declared, EngineState.ASLEEP_HOST, b.precision, b.gpus)
    if managed:
        return InstanceView(b.node, b.model, b.declared, EngineState.STOPPED, a.precision, (), a.checkpoint_cached)
    for g in b.gpus:
        used[g] += residue
    return InstanceView(b.node, b.model, b.declared, EngineState.ASLEEP_DISCARDED, b.precision, b.gpus)


def stays_asleep_or_stops(
    problem: Problem, b: InstanceView, a: InstanceView, out: Placement, used: dict[str, int]
) -> InstanceView:
    """A sleeping instance the target does not wake keeps sleeping, its context held by the solvers
    (`keeps_context`); a managed one asleep at level 1 whose host backup the target drops stops (the drop
    carries the stop: the backup goes only with the engine)."""
    residue = residue_bytes(problem, b)
    backup_kept = b.state is EngineState.ASLEEP_DISCARDED or (a.checkpoint_cached and a.precision == b.precision)
    if backup_kept or b.declared.management is Management.ADOPTED:
        for g in b.gpus:
            used[g] += residue
        return b
    if b.state is EngineState.ASLEEP_HOST:
        _drop_host_weights(problem, out, (b.node, b.model))
    return InstanceView(b.node, b.model, b.declared, EngineState.STOPPED, a.precision, ())


def _drop_host_weights(problem: Problem, out: Placement, key: Key) -> None:
    node, model = key
    for precision in problem.models[model].precisions:
        out.pop((StateObject.weights(model, precision), Location.host(node)), None)


def _expert_share_fixed(
    problem: Problem, out: Placement, before: Mapping[Key, InstanceView], after: Mapping[Key, InstanceView]
) -> None:
    """A running engine's GPU expert share is a launch setting: unchanged while it runs unchanged."""
    for key, a in after.items():
        b = before[key]
        spec = problem.models[key[1]]
        if not spec.experts_bytes or not (b.state is a.state is EngineState.RUNNING and b.same_instance(a)):
            continue
        obj = StateObject.experts(key[1])
        for g in problem.nodes[key[0]].gpus:  # its group's and none beside it: the engine's experts are its own
            set_bytes(out, (obj, Location.gpu(g)), problem.residency.get((obj, Location.gpu(g)), 0))


def unserved_by_engines(problem: Problem, serving: Mapping[str, object], unserved: Mapping[str, str]) -> dict[str, str]:
    """Active sessions left without a served model once the target is one the engines can reach."""
    return {
        s.id: f"engine: no engine of {s.model} can be brought up (an adopted engine is started only by its owner)"
        for s in problem.sessions.values()
        if s.active and s.id not in unserved and s.model not in serving
    }
