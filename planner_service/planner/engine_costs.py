"""What bringing a model up on a GPU group costs the planner: the copy of its weights plus the fixed part of
the engine transition that brings its instance there (DESIGN.md §5, `engines.bring_up_fixed_seconds`).

The simulator charges the same fixed part on top of the copies it simulates (sim/instances.py), so a
plan's predicted switch latency and the replay's agree (tests/sim/test_one_cost_model.py). Every node runs
its models in engine instances: the declared kind, or on a node that declares none, the node agent's own
`local` executor, which offers every transition.

The instance's state before the bring-up is read from the confirmed placement (`now`) and what the nodes
reported, with the rule of `engine_instances.instance_states`:

    weights complete on GPUs of the node     running on those GPUs, at that precision
    reported asleep (a heartbeat)            asleep on the reported group, at the precision of its host
                                             copy (else the model's preferred one)
    weights complete in host RAM, the group  asleep_host where its kind offers a level-1 sleep (the host
    fixed (the scenario's engine GPUs)       copy is its backup)
    otherwise                                stopped

A plan that keeps the model on GPU pays nothing for a group it keeps; a new group or precision of a
running engine is a restart; a wake, a cold start as the state says. A *cold load* prices a request to a
model that the placement leaves off GPU (`after_leaving`): a model running now has left its GPUs by then
the way its engine leaves them (`engines.leaving_transition`: a level-1 sleep where host RAM keeps its
copy, else level 2, else a stop), so its next request wakes it there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from planner_service.domain import engines
from planner_service.domain.engines import DeclaredEngine, EngineKind, EngineState, Management
from planner_service.domain.problem import Gpu, ModelSpec, Node, Problem
from planner_service.domain.state import StateObject, Tier
from planner_service.planner import costs
from planner_service.planner.residency import ResidencyIndex

# the engine model's constants the planner prices with: the simulator's defaults (sim/state.py)
ENGINE_CONSTANTS = engines.EngineConstants()
# a node that declares no engine for a model: the node agent's own executor, every transition offered
UNDECLARED = DeclaredEngine(EngineKind.LOCAL, frozenset(engines.EngineFeature), Management.MANAGED)

_RUNNING, _STOPPED = EngineState.RUNNING, EngineState.STOPPED
_ASLEEP = frozenset({EngineState.ASLEEP_HOST, EngineState.ASLEEP_DISCARDED})
_AFTER_LEAVING: Mapping[engines.Transition | None, EngineState] = MappingProxyType(
    {
        engines.Transition.SLEEP_LEVEL_1: EngineState.ASLEEP_HOST,
        engines.Transition.SLEEP_LEVEL_2: EngineState.ASLEEP_DISCARDED,
        None: EngineState.STOPPED,
    }
)


def declared_engine(problem: Problem, node_id: str, model_id: str) -> DeclaredEngine:
    return problem.nodes[node_id].declared_engines.get(model_id, UNDECLARED)


def instance_now(
    problem: Problem, now: ResidencyIndex, node_id: str, model_id: str
) -> tuple[EngineState, str | None, tuple[str, ...]]:
    """(state, precision, GPU ids) of the model's instance on the node in the confirmed placement `now`
    (the module's docstring); a stopped one has no group."""
    serving = now.serving.get(model_id)
    if serving is not None and serving.node == node_id:
        return _RUNNING, serving.precision, tuple(sorted(g.id for g in serving.gpus))
    spec = problem.models[model_id]
    cached = next(
        (p for p in spec.precisions if now.complete(StateObject.weights(model_id, p), node_id, Tier.HOST)), None
    )
    seen = problem.observed_engines.get((node_id, model_id))
    if seen is not None and seen[0] in _ASLEEP and seen[1]:
        return seen[0], cached or spec.preferred, tuple(sorted(seen[1]))
    fixed = problem.nodes[node_id].engine_gpus.get(model_id)
    if cached is not None and fixed and seen is None:
        level = engines.leaving_transition(declared_engine(problem, node_id, model_id).probe(), host_copy=True)
        if level is engines.Transition.SLEEP_LEVEL_1:
            return EngineState.ASLEEP_HOST, cached, fixed
    return _STOPPED, cached, ()


def up_fixed_seconds(
    problem: Problem,
    now: ResidencyIndex,
    node_id: str,
    model_id: str,
    precision: str,
    gpu_ids: Sequence[str],
    *,
    host_copy: bool,
    after_leaving: bool = False,
) -> float:
    """The fixed part of the transition that has the model's instance run at `precision` on `gpu_ids`
    (`engines.bring_up_fixed_seconds`), from its state now, or, `after_leaving`, from the state its engine
    leaves it in once off its GPUs (`host_copy`: host RAM holds its weights then)."""
    state, precision_now, group = instance_now(problem, now, node_id, model_id)
    if state is _RUNNING and after_leaving:
        state = _AFTER_LEAVING[
            engines.leaving_transition(declared_engine(problem, node_id, model_id).probe(), host_copy)
        ]
    if state is EngineState.ASLEEP_HOST and not host_copy:
        state = _STOPPED  # its backup is gone: the engine stopped (engine_targets.stays_asleep_or_stops)
    same = precision_now == precision and group == tuple(sorted(gpu_ids))
    return engines.bring_up_fixed_seconds(state, same, ENGINE_CONSTANTS)


def bring_up_seconds(
    problem: Problem,
    now: ResidencyIndex,
    model: ModelSpec,
    precision: str,
    gpus: Sequence[Gpu],
    source: Tier,
    node: Node,
    *,
    after_leaving: bool = False,
) -> float:
    """The model's weights at `precision` copied from `source` onto `gpus` (one even shard each) plus the
    fixed part of its engine's transition there (`up_fixed_seconds`):

        t = copy(ceil(weights_bytes / |gpus|) per GPU, source) + fixed(state -> running on gpus)
    """
    shard = math.ceil(model.weights_bytes[precision] / len(gpus))
    fixed = up_fixed_seconds(
        problem,
        now,
        node.id,
        model.id,
        precision,
        [g.id for g in gpus],
        host_copy=source is Tier.HOST,
        after_leaving=after_leaving,
    )
    return costs.even_copy_seconds(shard, gpus, source, node) + fixed


def own_group(
    problem: Problem, now: ResidencyIndex, model: ModelSpec, precision: str, node: Node
) -> tuple[Gpu, ...] | None:
    """The GPUs the model's instance on the node runs or sleeps on now at `precision`, where it has them and
    they hold the weights: where a wake brings it back."""
    state, precision_now, group = instance_now(problem, now, node.id, model.id)
    if state is _STOPPED or precision_now != precision or not group:
        return None
    gpus = tuple(problem.gpus[g] for g in group)
    return gpus if costs.holds_evenly(gpus, model, model.weights_bytes[precision]) else None
