"""Engine instances on engine nodes (vLLM, SGLang): which exist, in which state, and what each may be asked
(DESIGN.md §5, planner_service/domain/engines.py).

Where the planner learns states: `instance_states` derives them from a placement and the nodes' declared
engines (one function, so that the heartbeat's per-engine states can be passed in as `observed`):

    weights complete on GPUs of the node           running on those GPUs, at that precision
    weights complete in host RAM, the group fixed  asleep_host, where the kind and launch features offer a
    (the scenario's engine GPUs) or observed       level-1 sleep (the host copy is its backup)
    otherwise                                      stopped (a host copy is the checkpoint in the page cache)

`local` nodes and nodes that declare no kind have no instances here: their moves keep their bytes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from planner_service.domain.engines import (
    DeclaredEngine,
    EngineFeature,
    EngineInstance,
    EngineKind,
    EngineState,
    LaunchSettings,
    Transition,
    kv_pool_tokens,
    may,
)
from planner_service.domain.problem import Problem
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.planner import engine_costs
from planner_service.wire.operations import EngineInstanceRef

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


def confirmed_states(problem: Problem) -> dict[Key, InstanceView]:
    """The instances' states now: derived from the confirmed placement, with what the nodes reported."""
    return instance_states(problem, problem.residency, problem.observed_engines)


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
        probe = engine_instance(problem, view)
        if may(probe, view.state, Transition.RESTART).allowed or may(probe, view.state, Transition.START).allowed:
            continue
        runs = view.state is EngineState.RUNNING or may(probe, view.state, Transition.WAKE).allowed
        out[key] = (view.precision, view.gpus) if runs and view.precision is not None and view.gpus else None
    return out


def has_lmcache(view: InstanceView) -> bool:
    return EngineFeature.LMCACHE in view.declared.features


def engine_instance(
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
        spec.kv_heads,
    )


def instance_ref(
    problem: Problem, view: InstanceView, kv_pool_bytes_per_gpu: int = 0, gpu_expert_fraction: float = 1.0
) -> EngineInstanceRef:
    """The wire's name and settings of the instance `view` is (or would be)."""
    inst = engine_instance(problem, view, kv_pool_bytes_per_gpu, gpu_expert_fraction)
    return EngineInstanceRef(
        id=EngineInstanceRef.instance_id(inst.model, inst.precision, inst.gpus),
        node=view.node,
        kind=inst.kind,
        model=inst.model,
        precision=inst.precision,
        gpus=list(inst.gpus),
        kv_pool_bytes_per_gpu=kv_pool_bytes_per_gpu,
        kv_pool_tokens=kv_pool_tokens(
            problem.models[view.model].kv_bytes_per_token, kv_pool_bytes_per_gpu, len(inst.gpus), inst.kv_heads
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
        spec.kv_heads,
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
