"""Engine instances on engine nodes (vLLM, SGLang): which exist and in which state, what a target placement
may ask of them, and which engine step each of a plan's moves is (DESIGN.md §5, planner_service/domain/engines.py).

Where the planner learns states: `instance_states` derives them from a placement and the nodes' declared
engines (one function, so that the heartbeat's per-engine states can be passed in as `observed`):

    weights complete on GPUs of the node           running on those GPUs, at that precision
    weights complete in host RAM, the group fixed  asleep_host, where the kind and launch features offer a
    (the scenario's engine GPUs) or observed       level-1 sleep (the host copy is its backup)
    otherwise                                      stopped (a host copy is the checkpoint in the page cache)

`engine_target` turns a solver's target into one the engines can reach: on engine nodes a session's KV is
predicted, not commanded (it stays where the engine's pool and LMCache's LRU keep it, and leaves the GPUs
only with its engine), a running engine's GPU expert share is its launch setting, a level-1 sleep keeps a
host copy only where it is offered and its residue fits, and a wake frees the backup. `attach_steps` names
the engine step each weights, experts or KV move of the plan carries out: one transition per instance,
priced once, on the move of its group's first GPU (the shard moves of the other ranks are the same call).
`local` nodes and nodes that declare no kind keep every move, with no step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planner_service.domain.engines import (
    DeclaredEngine,
    EngineFeature,
    EngineInstance,
    EngineKind,
    EngineState,
    GroupLinks,
    LaunchSettings,
    Management,
    ReadFrom,
    Transition,
    context_bytes_per_gpu,
    holdings,
    kv_held_in_pool,
    kv_pool_tokens,
    launch_kv_pool_bytes_per_gpu,
    may,
    min_kv_pool_bytes_per_gpu,
    transition_seconds,
)
from planner_service.domain.problem import Problem
from planner_service.domain.state import Kind, Location, Placement, StateObject, Tier
from planner_service.planner import engine_costs
from planner_service.planner.operations import Action, Operation, Unpair
from planner_service.wire.operations import EngineInstanceRef, EngineStep
from planner_service.wire.operations import Operation as PlannedOperation

# the kinds whose engines carry out transitions, not byte moves (`local` moves bytes itself)
ENGINE_NODE_KINDS = frozenset({EngineKind.VLLM, EngineKind.SGLANG})
ENGINE_CONSTANTS = engine_costs.ENGINE_CONSTANTS

Key = tuple[str, str]  # (node, model)


@dataclass(frozen=True, slots=True)
class InstanceView:
    """One model's engine on one engine node and the state it is in."""

    node: str
    model: str
    declared: DeclaredEngine
    state: EngineState
    precision: str | None  # None: stopped with nothing chosen yet
    gpus: tuple[str, ...]  # () where no group is known (stopped, or asleep on an unknown group)
    checkpoint_cached: bool = False  # a host copy of the weights is the checkpoint in the page cache

    def same_instance(self, other: InstanceView) -> bool:
        return self.precision == other.precision and self.gpus == other.gpus

    def to_json(self) -> dict[str, object]:
        return {
            "node": self.node,
            "model": self.model,
            "kind": self.declared.kind.value,
            "state": self.state.value,
            "precision": self.precision,
            "gpus": list(self.gpus),
            "features": sorted(f.value for f in self.declared.features),
            "management": self.declared.management.value,
        }


def engine_of(problem: Problem, node_id: str, model_id: str) -> DeclaredEngine | None:
    """The declared engine of `model_id` on the node, where it is one whose moves are engine transitions."""
    declared = problem.nodes[node_id].declared_engines.get(model_id)
    return declared if declared is not None and declared.kind in ENGINE_NODE_KINDS else None


def _weights_where(
    problem: Problem, placement: Mapping[tuple[StateObject, Location], int]
) -> tuple[dict[tuple[str, str, str], list[str]], dict[tuple[str, str, str], int], set[tuple[str, str, str]]]:
    """(node, model, precision) -> GPUs holding weights, bytes on them; the triples complete in host RAM."""
    gpus: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    on_gpus: dict[tuple[str, str, str], int] = defaultdict(int)
    on_host: set[tuple[str, str, str]] = set()
    for (obj, loc), nbytes in placement.items():
        if obj.kind is not Kind.WEIGHTS or nbytes <= 0 or loc.tier is Tier.NVME:
            continue
        assert obj.precision is not None  # a weights object
        if loc.tier is Tier.GPU:
            key = (problem.gpus[loc.id].node, obj.model, obj.precision)
            gpus[key].append(loc.id)
            on_gpus[key] += nbytes
        elif nbytes >= problem.size_of(obj):
            on_host.add((loc.id, obj.model, obj.precision))
    return gpus, on_gpus, on_host


def offers_level_1(declared: DeclaredEngine) -> bool:
    """Whether the declared engine's kind and launch features offer a level-1 sleep (weights kept in host RAM)."""
    return may(declared.probe(), EngineState.RUNNING, Transition.SLEEP_LEVEL_1).allowed


def instance_states(
    problem: Problem,
    placement: Mapping[tuple[StateObject, Location], int],
    observed: Mapping[Key, tuple[EngineState, tuple[str, ...]]] | None = None,
) -> dict[Key, InstanceView]:
    """Every engine node's instances and their states in `placement` (see the module's docstring);
    `observed`: (node, model) -> a state and group that a node reported, which wins over the derivation."""
    if not any(d.kind in ENGINE_NODE_KINDS for n in problem.nodes.values() for d in n.declared_engines.values()):
        return {}
    gpus, on_gpus, on_host = _weights_where(problem, placement)
    out: dict[Key, InstanceView] = {}
    for node in problem.nodes.values():
        for model_id, declared in node.declared_engines.items():
            if declared.kind not in ENGINE_NODE_KINDS:
                continue
            spec = problem.models[model_id]
            key = (node.id, model_id)
            view: InstanceView | None = None
            for precision in spec.precisions:
                triple = (node.id, model_id, precision)
                if on_gpus.get(triple, 0) >= spec.weights_bytes[precision] > 0:
                    cached = triple in on_host
                    group = tuple(sorted(gpus[triple]))
                    view = InstanceView(node.id, model_id, declared, EngineState.RUNNING, precision, group, cached)
                    break
            if view is None:
                cached_at = next((p for p in spec.precisions if (node.id, model_id, p) in on_host), None)
                fixed = node.engine_gpus.get(model_id, ())
                asleep = cached_at is not None and bool(fixed) and offers_level_1(declared)
                state = EngineState.ASLEEP_HOST if asleep else EngineState.STOPPED
                view = InstanceView(node.id, model_id, declared, state, cached_at, fixed, cached_at is not None)
            seen = (observed or {}).get(key)
            if seen is not None:
                view = InstanceView(node.id, model_id, declared, seen[0], view.precision, seen[1] or view.gpus)
            out[key] = view
    return out


def can_leave(view: InstanceView) -> bool:
    """Whether a running instance can leave its GPUs at all: a stop (managed) or a sleep its kind offers."""
    probe = view.declared.probe()
    leaving = (Transition.STOP, Transition.SLEEP_LEVEL_2, Transition.SLEEP_LEVEL_1)
    return any(may(probe, EngineState.RUNNING, t).allowed for t in leaving)


def immovable(problem: Problem) -> dict[str, tuple[str, str]]:
    """model -> (node, precision) of running instances that cannot leave their GPUs (an adopted engine
    launched without sleep mode): the solver must plan around them (the greedy's pins)."""
    return {
        view.model: (view.node, view.precision)
        for view in confirmed_states(problem).values()
        if view.state is EngineState.RUNNING and view.precision is not None and not can_leave(view)
    }


def pinned_instances(
    problem: Problem, states: Mapping[Key, InstanceView] | None = None
) -> dict[Key, tuple[str, tuple[str, ...]] | None]:
    """(node, model) -> the one instance (precision, GPUs) its engine can run as after a plan, where it cannot
    be started or restarted (an adopted engine: only someone else launches it): its present one where it
    runs or can wake, None where it cannot run on the node at all. A solver that gives the model another
    group or precision there plans a restart the engine does not offer; absent keys may run as anything."""
    out: dict[Key, tuple[str, tuple[str, ...]] | None] = {}
    for key, view in (confirmed_states(problem) if states is None else states).items():
        probe = _instance(problem, view)
        if may(probe, view.state, Transition.RESTART).allowed or may(probe, view.state, Transition.START).allowed:
            continue
        runs = view.state is EngineState.RUNNING or may(probe, view.state, Transition.WAKE).allowed
        out[key] = (view.precision, view.gpus) if runs and view.precision is not None and view.gpus else None
    return out


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
    return min_kv_pool_bytes_per_gpu(spec.kv_bytes_per_token, context, tp)


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


def confirmed_states(problem: Problem) -> dict[Key, InstanceView]:
    """The instances' states now: derived from the confirmed placement, with what the nodes reported."""
    return instance_states(problem, problem.residency, problem.observed_engines)


# --- what a target may ask of the engines ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineTarget:
    """A target the engines can reach, the instances' states in it, and the (model, node) pairs whose GPU
    copies may not be demoted to host RAM (no level-1 sleep there: the host copy is read ahead instead)."""

    placement: Placement
    after: dict[Key, InstanceView]
    no_backup: frozenset[tuple[str, str]]
    kv_prefill_only: frozenset[tuple[str, str]] = frozenset()  # engines without LMCache: no KV loaded back


def residue_bytes(problem: Problem, view: InstanceView) -> int:
    """GPU bytes per GPU a sleeping instance keeps (its CUDA context; engines.holdings)."""
    if view.state not in (EngineState.ASLEEP_HOST, EngineState.ASLEEP_DISCARDED) or not view.gpus:
        return 0
    return holdings(_instance(problem, view), view.state, ENGINE_CONSTANTS).gpu_bytes[view.gpus[0]]


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
    _kv_predicted(problem, out, before, derived)
    _kv_within_pools(problem, out, before, derived)
    _expert_share_fixed(problem, out, before, derived)
    after: dict[Key, InstanceView] = {}
    used = _gpu_used(problem, out)
    # a running engine's pool takes its room whole, the KV in it or not, and its context is there too:
    # sleeping residue fits beside them
    for g, nbytes in up_contexts({k: a for k, a in derived.items() if a.state is EngineState.RUNNING}).items():
        used[g] += nbytes
    kv_on = kv_per_gpu(out)
    for key, pool in kv_pools(problem, out, derived, before).items():
        for g in derived[key].gpus:
            used[g] += max(0, pool - kv_on.get((key[1], g), 0))
    for key, b in before.items():
        a = derived[key]
        if b.state is EngineState.RUNNING and a.state is not EngineState.RUNNING:
            a = _sleep_or_stop(problem, b, a, out, used)
        elif b.state in (EngineState.ASLEEP_HOST, EngineState.ASLEEP_DISCARDED) and a.state is not EngineState.RUNNING:
            a = _stays_asleep_or_stops(problem, b, a, out, used)
        after[key] = a
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
    return may(_instance(problem, b if transition is Transition.WAKE else a), b.state, transition).allowed


def _keep_on_gpus(problem: Problem, out: Placement, view: InstanceView) -> None:
    """The weights and experts of an instance stay exactly where they are (none where it is stopped)."""
    node_gpus = set(problem.nodes[view.node].gpus)
    for key in [k for k in out if k[0].model == view.model and k[0].kind is not Kind.KV and k[1].tier is Tier.GPU]:
        if key[1].id in node_gpus:
            del out[key]
    for (obj, loc), nbytes in problem.residency.items():
        if obj.model == view.model and obj.kind is not Kind.KV and loc.tier is Tier.GPU and loc.id in view.gpus:
            out[(obj, loc)] = nbytes


def _gpu_used(problem: Problem, placement: Mapping[tuple[StateObject, Location], int]) -> dict[str, int]:
    used: dict[str, int] = defaultdict(int)
    for (_, loc), nbytes in placement.items():
        if loc.tier is Tier.GPU:
            used[loc.id] += nbytes
    return used


def _host_used(placement: Mapping[tuple[StateObject, Location], int], node: str) -> int:
    host = Location.host(node)
    return sum(nbytes for (_, loc), nbytes in placement.items() if loc == host)


def _fits(problem: Problem, gpus: Sequence[str], extra: int, used: Mapping[str, int]) -> bool:
    return all(used.get(g, 0) + extra <= problem.gpus[g].capacity_bytes for g in gpus)


def _sleep_or_stop(
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


def _stays_asleep_or_stops(
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


def _kv_predicted(
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
            _set(out, key, was)
        elif a.state is not EngineState.RUNNING or loc.id not in a.gpus:
            if a.state is EngineState.RUNNING:
                strays[(obj, a.node)] += out.get(key, 0)  # planned beside a group the engine cannot leave
            _set(out, key, 0)
        elif b.state is EngineState.RUNNING and b.same_instance(a) and was > out.get(key, 0):
            kept[loc.id].append((key, out.get(key, 0)))
            _set(out, key, was)
    for (obj, node), nbytes in sorted(strays.items()):
        if nbytes:  # the session's KV follows its engine's group whole (never past its size), split evenly
            group = after[(node, obj.model)].gpus
            held = sum(out.get((obj, Location.gpu(g)), 0) for g in group)
            grow = min(nbytes, problem.size_of(obj) - held)
            for i, g in enumerate(group):
                add = grow // len(group) + (1 if i < grow % len(group) else 0)
                if add > 0:
                    _set(out, (obj, Location.gpu(g)), out.get((obj, Location.gpu(g)), 0) + add)
    if not kept:
        return
    used = _gpu_used(problem, out)
    for gpu_id, entries in kept.items():
        gains = {
            k[0].model for k, n in out.items() if k[1].id == gpu_id and k[0].kind is Kind.KV and n > confirmed.get(k, 0)
        }
        for key, wanted in entries:
            if used[gpu_id] <= problem.gpus[gpu_id].capacity_bytes:
                break
            if key[0].model in gains:  # the pool makes room for its own new KV
                used[gpu_id] -= out[key] - wanted
                _set(out, key, wanted)


def _kv_within_pools(
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
    pools = launched_pools(problem, {key: before[key] for key in staying}) | woken
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
                    _set(out, k, out.get(k, 0) - cut)
                    over -= cut
                if over <= 0:
                    break


def _active(problem: Problem, obj: StateObject) -> bool:
    session = problem.sessions.get(obj.session or "")
    return session is not None and session.active


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
            _set(out, (obj, Location.gpu(g)), problem.residency.get((obj, Location.gpu(g)), 0))


def _set(out: Placement, key: tuple[StateObject, Location], nbytes: int) -> None:
    if nbytes > 0:
        out[key] = nbytes
    else:
        out.pop(key, None)


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


# --- the steps ----------------------------------------------------------------------------------------------


def _instance(
    problem: Problem, view: InstanceView, kv_pool_bytes_per_gpu: int = 0, gpu_expert_fraction: float = 1.0
) -> EngineInstance:
    spec = problem.models[view.model]
    precision = view.precision or spec.precisions[0]
    gpus = view.gpus or problem.nodes[view.node].gpus[:1]
    features = view.declared.features
    return EngineInstance(
        view.declared.kind,
        view.model,
        precision,
        gpus,
        spec.weights_bytes[precision],
        LaunchSettings(kv_pool_bytes_per_gpu, gpu_expert_fraction, features=features),
        spec.experts_bytes,
        view.declared.management,
        spec.kv_bytes_per_token,
        spec.max_context_tokens,
    )


def instance_ref(
    problem: Problem, view: InstanceView, kv_pool_bytes_per_gpu: int = 0, gpu_expert_fraction: float = 1.0
) -> EngineInstanceRef:
    """The wire's name and settings of the instance `view` is (or would be)."""
    inst = _instance(problem, view, kv_pool_bytes_per_gpu, gpu_expert_fraction)
    return EngineInstanceRef(
        id=EngineInstanceRef.instance_id(inst.model, inst.precision, inst.gpus),
        node=view.node,
        kind=inst.kind,
        model=inst.model,
        precision=inst.precision,
        gpus=list(inst.gpus),
        kv_pool_bytes_per_gpu=kv_pool_bytes_per_gpu,
        kv_pool_tokens=kv_pool_tokens(
            problem.models[view.model].kv_bytes_per_token, kv_pool_bytes_per_gpu, len(inst.gpus)
        ),
        # the longest request it serves (vLLM --max-model-len): its pool's minimum is one such request
        max_context_tokens=inst.max_context_tokens or None,
        gpu_expert_fraction=inst.launch.gpu_expert_fraction,
        features=sorted(inst.launch.features),
        management=inst.management,
    )


def instance_from_ref(problem: Problem, ref: EngineInstanceRef) -> EngineInstance:
    """The engine model's instance a wire reference names (sizes from the catalog)."""
    spec = problem.models[ref.model]
    return EngineInstance(
        ref.kind,
        ref.model,
        ref.precision,
        tuple(ref.gpus),
        spec.weights_bytes[ref.precision],
        LaunchSettings(
            ref.kv_pool_bytes_per_gpu, ref.gpu_expert_fraction, ref.max_context_tokens, frozenset(ref.features)
        ),
        spec.experts_bytes,
        ref.management,
        spec.kv_bytes_per_token,
        spec.max_context_tokens,
    )


def group_links(problem: Problem, view: InstanceView) -> GroupLinks:
    """The slowest GPU link of the group (calibrated bandwidths) and the node's NVMe."""
    gpus = [problem.gpus[g] for g in (view.gpus or problem.nodes[view.node].gpus[:1])]
    return GroupLinks(
        h2d_bytes_per_s=min(g.h2d_bytes_per_s for g in gpus),
        d2h_bytes_per_s=min(g.d2h_bytes_per_s for g in gpus),
        nvme_read_bytes_per_s=problem.nodes[view.node].nvme_read_bytes_per_s,
    )


def transition_between(b: InstanceView, a: InstanceView) -> Transition | None:
    """The one transition that takes the instance from `b` to `a` (None: nothing changes)."""
    running_b, running_a = b.state is EngineState.RUNNING, a.state is EngineState.RUNNING
    if running_a:
        if running_b:
            return None if b.same_instance(a) else Transition.RESTART
        if b.state is EngineState.STOPPED:
            return Transition.START
        return Transition.WAKE if b.same_instance(a) else Transition.RESTART
    if running_b:
        return {
            EngineState.ASLEEP_HOST: Transition.SLEEP_LEVEL_1,
            EngineState.ASLEEP_DISCARDED: Transition.SLEEP_LEVEL_2,
        }.get(a.state, Transition.STOP)
    if b.state is not EngineState.STOPPED and a.state is EngineState.STOPPED:
        return Transition.STOP
    return None


def step_seconds(problem: Problem, b: InstanceView, a: InstanceView, transition: Transition) -> float:
    """engines.transition_seconds for the step, from the calibrated links; a load reads the page cache where
    the confirmed placement holds the loaded precision's checkpoint in host RAM, else NVMe."""
    view = a if a.state is EngineState.RUNNING else b
    inst = _instance(problem, view)
    loaded = StateObject.weights(inst.model, inst.precision)
    cached = problem.residency.get((loaded, Location.host(view.node)), 0) >= problem.size_of(loaded)
    read_from = ReadFrom.PAGE_CACHE if cached else ReadFrom.NVME
    new = inst if transition is Transition.RESTART else None
    old = _instance(problem, b) if transition is Transition.RESTART else inst
    return transition_seconds(
        old, b.state, transition, group_links(problem, view), ENGINE_CONSTANTS, read_from=read_from, new=new
    )


def attach_steps(
    problem: Problem,
    ops: Sequence[Operation],
    before: Mapping[Key, InstanceView],
    after: Mapping[Key, InstanceView],
    kv_pool_bytes: Mapping[Key, int] | None = None,
    gpu_expert_fractions: Mapping[Key, float] | None = None,
) -> None:
    """Name the engine step of every weights, experts and KV move on an engine node, in place; the step is
    priced on its first move (its group's first GPU), the other ranks' moves are the same call (0 s)."""
    if not before:
        return
    steps: dict[Key, EngineStep | None] = {}
    priced: set[Key] = set()
    for op in ops:
        key = (op.node, op.object.model)
        b = before.get(key)
        if b is None:
            continue
        a = after[key]
        if key not in steps:
            fraction = (gpu_expert_fractions or {}).get(key, 1.0)
            steps[key] = _step(problem, b, a, (kv_pool_bytes or {}).get(key, 0), fraction)
        step = steps[key]
        if op.object.kind is Kind.KV:
            if step is not None and op.source is not None and op.source.tier is Tier.GPU and op.dest is None:
                op.engine = step  # the KV leaves the GPUs with its engine
            continue
        touches_gpu = (op.dest is not None and op.dest.tier is Tier.GPU) or (
            op.source is not None and op.source.tier is Tier.GPU
        )
        # a sleeping engine that stops has nothing on the GPUs to move: the drop of its host backup is the call
        stops_asleep = step is not None and step.transition is Transition.STOP and b.state is not EngineState.RUNNING
        if step is not None and (touches_gpu or stops_asleep):
            op.engine = step
            if key in priced:
                op.estimated_seconds = 0.0
            else:
                priced.add(key)
                op.estimated_seconds = step_seconds(problem, b, a, step.transition)
        elif op.action is Action.PROMOTE and op.dest is not None and op.dest.tier is Tier.HOST:
            cached = InstanceView(b.node, b.model, b.declared, b.state, op.object.precision, b.gpus or a.gpus)
            op.engine = EngineStep(  # the checkpoint into the page cache
                transition=Transition.READAHEAD, instance=instance_ref(problem, cached), from_state=b.state
            )
            op.estimated_seconds = step_seconds(problem, cached, cached, Transition.READAHEAD)
        # other host moves need no call: a wake or a stop freed the backup, a cached checkpoint is the kernel's


def restart_unpairing(
    problem: Problem, before: Mapping[Key, InstanceView], after: Mapping[Key, InstanceView]
) -> Unpair:
    """How `operations.share_step_dependencies` turns a restart that no order makes safe into a stop of the old
    instance and a start of the new one: what an operator does where two engines trade GPUs (vLLM and SGLang
    take launch settings only at launch, so a restart is a stop and a start in any case, engines.py). Both
    halves are offered wherever the restart is (a managed engine: an adopted one is never restarted); they are
    priced by the engine model as the restart was, stop_fixed + cold start, each on its first move."""

    def unpair(stop: list[Operation], start: list[Operation]) -> bool:
        step = stop[0].engine
        if step is None or step.transition is not Transition.RESTART or step.previous is None:
            return False
        key = (stop[0].node, step.instance.model)
        b, a = before[key], after[key]
        old, new = instance_from_ref(problem, step.previous), instance_from_ref(problem, step.instance)
        if not (may(old, b.state, Transition.STOP).allowed and may(new, EngineState.STOPPED, Transition.START).allowed):
            return False
        stopped = InstanceView(b.node, b.model, b.declared, EngineState.STOPPED, a.precision, ())
        halves = (
            (stop, Transition.STOP, step.previous, step.from_state, step_seconds(problem, b, stopped, Transition.STOP)),
            (start, Transition.START, step.instance, EngineState.STOPPED, step_seconds(problem, stopped, a, Transition.START)),
        )  # fmt: skip
        for moves, transition, instance, from_state, seconds in halves:
            half = EngineStep(transition=transition, instance=instance, from_state=from_state)
            for k, op in enumerate(moves):
                op.engine = half
                op.estimated_seconds = seconds if k == 0 else 0.0
        return True

    return unpair


def attach_derived_steps(
    problem: Problem, ops: Sequence[Operation], target: Mapping[tuple[StateObject, Location], int]
) -> None:
    """`attach_steps` with the states derived from the confirmed placement and `target` as they are (for
    operations built without `engine_target`)."""
    before = confirmed_states(problem)
    after = instance_states(problem, target)
    attach_steps(problem, ops, before, after, kv_pools(problem, target, after, before))


def _step(
    problem: Problem, b: InstanceView, a: InstanceView, kv_pool: int, gpu_expert_fraction: float = 1.0
) -> EngineStep | None:
    transition = transition_between(b, a)
    if transition is None:
        return None
    running = a if a.state is EngineState.RUNNING else b
    return EngineStep(
        transition=transition,
        instance=instance_ref(problem, running, kv_pool, gpu_expert_fraction),
        from_state=b.state,
        previous=instance_ref(problem, b) if transition is Transition.RESTART else None,
    )


def has_lmcache(view: InstanceView) -> bool:
    return EngineFeature.LMCACHE in view.declared.features


def unserved_by_engines(problem: Problem, serving: Mapping[str, object], unserved: Mapping[str, str]) -> dict[str, str]:
    """Active sessions left without a served model once the target is one the engines can reach."""
    return {
        s.id: f"engine: no engine of {s.model} can be brought up (an adopted engine is started only by its owner)"
        for s in problem.sessions.values()
        if s.active and s.id not in unserved and s.model not in serving
    }


def plan_steps(ops: Sequence[Operation | PlannedOperation]) -> dict[Key, list[Transition]]:
    """The engine calls a plan's operations carry out, per instance, in the plan's order (a restart no order
    makes safe is two: a stop, then a start; `restart_unpairing`)."""
    steps: dict[Key, list[Transition]] = defaultdict(list)
    for op in ops:
        if op.engine is not None:
            calls = steps[(op.node, op.object.model)]
            if not calls or calls[-1] is not op.engine.transition:
                calls.append(op.engine.transition)
    return dict(steps)


def engine_rows(
    problem: Problem,
    planned: Mapping[tuple[StateObject, Location], int] | None,
    steps: Mapping[Key, Sequence[Transition]] | None = None,
) -> list[dict[str, object]]:
    """Every engine node's instances now and once `planned` (a plan's placement) is reached, with the engine
    calls the plan's operations carry (`steps`, `plan_steps`): `EngineOut`."""
    now = confirmed_states(problem)
    then = engine_target(problem, planned, now).after if planned is not None else {}
    pools = kv_pools(problem, planned, then) if planned is not None else {}
    fractions = expert_fractions(problem, problem.residency, now)
    planned_fractions = expert_fractions(problem, planned, then) if planned is not None else {}
    rows: list[dict[str, object]] = []
    for key, view in sorted(now.items()):
        after = then.get(key)
        step = transition_between(view, after) if after is not None else None
        shown = after if after is not None and after.state is EngineState.RUNNING else view
        shown_fraction = (planned_fractions if shown is after else fractions).get(key, 1.0)
        ref = instance_ref(problem, shown, pools.get(key, 0), shown_fraction)
        held = holdings(
            _instance(problem, view, pools.get(key, 0), fractions.get(key, 1.0)), view.state, ENGINE_CONSTANTS
        )
        rows.append(
            {
                "id": ref.id,
                "node": view.node,
                "model": view.model,
                "kind": view.declared.kind.value,
                "state": view.state.value,
                "planned_state": None if after is None else after.state.value,
                "planned_step": None if step is None else step.value,
                "planned_steps": [t.value for t in (steps or {}).get(key, [])],
                "precision": view.precision,
                "gpus": list(view.gpus),
                "features": sorted(f.value for f in view.declared.features),
                "management": view.declared.management.value,
                "kv_pool_bytes_per_gpu": pools.get(key, 0),
                "gpu_bytes_per_gpu": max(held.gpu_bytes.values(), default=0) if view.gpus else 0,
                "host_bytes": held.host_bytes,
            }
        )
    return rows
