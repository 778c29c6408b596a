"""The engine steps of a plan (DESIGN.md §5, planner_service/domain/engines.py): `attach_steps` names the
engine step each weights, experts or KV move of the plan carries out: one transition per instance, priced
once, on the move of its group's first GPU (the shard moves of the other ranks are the same call); and
`engine_rows` lists every instance now and once a plan is done. `local` nodes and nodes that declare no kind
keep every move, with no step.

The states (`engine_instances`), what engines hold (`engine_holdings`), a session's KV on engine nodes
(`engine_kv`) and what a target may ask of them (`engine_targets`) are modules of their own.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from planner_service.domain.engines import (
    EngineState,
    GroupLinks,
    ReadFrom,
    Transition,
    holdings,
    may,
    transition_seconds,
)
from planner_service.domain.problem import Problem
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.planner.engine_holdings import expert_fractions, kv_pools
from planner_service.planner.engine_instances import (
    ENGINE_CONSTANTS,
    InstanceView,
    Key,
    confirmed_states,
    engine_instance,
    instance_from_ref,
    instance_ref,
    instance_states,
    transition_between,
)
from planner_service.planner.engine_targets import engine_target
from planner_service.planner.operations import Action, Operation, Unpair
from planner_service.planner.residency import ResidencyIndex
from planner_service.wire.operations import EngineStep
from planner_service.wire.operations import Operation as PlannedOperation


def group_links(problem: Problem, view: InstanceView) -> GroupLinks:
    """The slowest GPU link of the group (calibrated bandwidths) and the node's NVMe."""
    gpus = [problem.gpus[g] for g in (view.gpus or problem.nodes[view.node].gpus[:1])]
    return GroupLinks(
        h2d_bytes_per_s=min(g.h2d_bytes_per_s for g in gpus),
        d2h_bytes_per_s=min(g.d2h_bytes_per_s for g in gpus),
        nvme_read_bytes_per_s=problem.nodes[view.node].nvme_read_bytes_per_s,
    )


def step_seconds(problem: Problem, b: InstanceView, a: InstanceView, transition: Transition) -> float:
    """engines.transition_seconds for the step, from the calibrated links; a load reads the page cache where
    the confirmed placement holds the loaded precision's checkpoint in host RAM, else NVMe."""
    view = a if a.state is EngineState.RUNNING else b
    inst = engine_instance(problem, view)
    loaded = StateObject.weights(inst.model, inst.precision)
    cached = problem.residency.get((loaded, Location.host(view.node)), 0) >= problem.size_of(loaded)
    read_from = ReadFrom.PAGE_CACHE if cached else ReadFrom.NVME
    new = inst if transition is Transition.RESTART else None
    old = engine_instance(problem, b) if transition is Transition.RESTART else inst
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


def restart_unpairing(
    problem: Problem, before: Mapping[Key, InstanceView], after: Mapping[Key, InstanceView], now: ResidencyIndex
) -> Unpair:
    """How `operations.share_step_dependencies` turns a restart that no order makes safe into a stop of the old
    instance and a start of the new one: what an operator does where two engines trade GPUs (vLLM and SGLang
    take launch settings only at launch, so a restart is a stop and a start in any case, engines.py). Both
    halves are offered wherever the restart is (a managed engine: an adopted one is never restarted); they are
    priced by the engine model as the restart was, stop_fixed + cold start, each on its first move.

    The stop frees the old instance's whole shard and the start loads the new one's whole shard, as the engine
    calls do: on a GPU both groups share, the restart's one move there (the difference between the shards, or
    none where they are equal) becomes a drop of the old shard and a load of the new one (`_whole_shards`)."""

    def unpair(stop: list[Operation], start: list[Operation]) -> list[Operation] | None:
        step = stop[0].engine
        if step is None or step.transition is not Transition.RESTART or step.previous is None:
            return None
        key = (stop[0].node, step.instance.model)
        b, a = before[key], after[key]
        old, new = instance_from_ref(problem, step.previous), instance_from_ref(problem, step.instance)
        if not (may(old, b.state, Transition.STOP).allowed and may(new, EngineState.STOPPED, Transition.START).allowed):
            return None
        added = _whole_shards(problem, now, stop, start, b.gpus, a.gpus)
        if added is None:
            return None
        stopped = InstanceView(b.node, b.model, b.declared, EngineState.STOPPED, a.precision, ())
        halves = (
            (stop, Transition.STOP, step.previous, step.from_state, step_seconds(problem, b, stopped, Transition.STOP)),
            (start, Transition.START, step.instance, EngineState.STOPPED, step_seconds(problem, stopped, a, Transition.START)),
        )  # fmt: skip
        for moves, transition, instance, from_state, seconds in halves:
            half = EngineStep(transition=transition, instance=instance, from_state=from_state)
            ours = [*moves, *(op for op in added if (op.dest is None) is (transition is Transition.STOP))]
            for k, op in enumerate(ours):
                op.engine = half
                op.estimated_seconds = seconds if k == 0 else 0.0
        return added

    return unpair


def _whole_shards(
    problem: Problem,
    now: ResidencyIndex,
    stop: list[Operation],
    start: list[Operation],
    old_gpus: Sequence[str],
    new_gpus: Sequence[str],
) -> list[Operation] | None:
    """Make a restart's moves, split into its stop and its start, take each weights and experts shard of the
    old group whole off its GPU and put each of the new group whole on its GPU, in place: a drop or load is
    enlarged, or one is added (answered; None where no copy on the node could load it). A restart moves only
    the difference on a GPU both groups hold: the SRV would otherwise keep the old shard there through the
    stop, on an engine that holds nothing, and count the new shard loaded by the difference alone."""
    model, node = stop[0].object.model, stop[0].node
    gained: dict[tuple[StateObject, str], int] = defaultdict(int)
    freed: dict[tuple[StateObject, str], int] = defaultdict(int)
    for op in (*stop, *start):
        if op.dest is not None and op.dest.tier is Tier.GPU:
            gained[(op.object, op.dest.id)] += op.bytes
        if op.source is not None and op.source.tier is Tier.GPU and not op.keep_source:
            freed[(op.object, op.source.id)] += op.bytes
    shards = {
        obj
        for (obj, loc) in problem.residency
        if obj.model == model and obj.kind is not Kind.KV and loc.tier is Tier.GPU and loc.id in old_gpus
    } | {obj for (obj, _g) in gained if obj.kind is not Kind.KV}
    added: list[Operation] = []
    for obj in sorted(shards, key=StateObject.label):
        for g in old_gpus:
            left = problem.residency.get((obj, Location.gpu(g)), 0) - freed[(obj, g)]
            if left <= 0:
                continue
            drop = next((op for op in stop if op.action is Action.DROP and op.object == obj and op.source == Location.gpu(g)), None)  # fmt: skip
            if drop is not None:
                drop.bytes += left
            else:
                added.append(_move(Action.DROP, obj, Location.gpu(g), None, left, stop[0]))
        for g in new_gpus:
            shard = problem.residency.get((obj, Location.gpu(g)), 0) + gained[(obj, g)] - freed[(obj, g)]
            loads = [op for op in start if op.object == obj and op.dest == Location.gpu(g)]
            missing = shard - sum(op.bytes for op in loads)
            if missing > 0 and loads:
                loads[0].bytes += missing
            elif missing > 0:
                tier = now.complete_source(obj, node)
                if tier is None:
                    return None
                added.append(_move(Action.PROMOTE, obj, Location(tier, node), Location.gpu(g), missing, start[0]))
    return added


def _move(
    action: Action, obj: StateObject, source: Location, dest: Location | None, nbytes: int, like: Operation
) -> Operation:
    """A move of a stop or start half on `like`'s node and as urgent (tagged and priced by the caller)."""
    why = "its engine stops: the whole shard leaves" if dest is None else "its engine starts: the whole shard loads"
    return Operation("", action, obj, source, dest, nbytes, dest is not None, like.priority, [], 0.0, like.node, why)


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
            engine_instance(problem, view, pools.get(key, 0), fractions.get(key, 1.0)), view.state, ENGINE_CONSTANTS
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
