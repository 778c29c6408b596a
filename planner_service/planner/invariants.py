"""The invariant checker every plan passes through, whichever solver made it.

`check_plan` returns the broken invariants as sentences (empty when the plan
is sound):
  * capacities hold in the target and at every moment of every order of the
    operations that respects `depends_on`;
  * active requests that the plan serves have their model's weights complete
    on GPUs of one node and their session's whole KV on those GPUs;
  * no node loses its last complete copy of a model's weights (at a precision
    it had one) or routed experts, at any step;
  * the operations replay from the confirmed placement to the target, stay
    inside one node, come in a topological order, and free a copy only after
    the operations reading it;
  * nodes are only asked for moves their engines can carry out: a model
    gains no weights or experts on the GPUs of a node that has no engine for
    it, nor outside its engine's GPUs where those are fixed;
  * where a node declares its engine's kind, no operation asks the engine for
    a run-time move its kind does not offer (`engines.offers`; vLLM and SGLang
    offer none): moving or freeing one session's KV (creating it by prefill
    is the engine serving the request), changing how many routed experts sit
    on GPU while the model stays served there at its precision, or bringing
    weights at another precision to the GPUs while the model is served there;
  * on an engine node (vLLM, SGLang) every weights or experts move on a GPU
    carries an engine step (`engine_plan.py`); each step is one its kind
    offers, leaving from the state the instance is in (`engines.may`: the
    kind's rule, its source states and preconditions), one transition per
    instance so that it holds in any order; a session's KV leaves the GPUs
    only with its engine's step, and reaches them by prefill or from LMCache;
  * where a node declares its engine's kind, a MoE's routed experts that the
    plan puts on GPU lie in equal shares on the GPUs of its weights there,
    none beside them (the GPU share is one launch setting of the engine);
    a sleeping engine woken brings back the share it was launched with,
    where its node reported it;
  * a vLLM instance the plan places anew runs on a group whose size divides
    its model's attention heads (`engines.tensor_parallel_ok`);
  * GPU capacities hold with the KV pools of the instances the plan launches
    and the CUDA contexts of every instance up, running or asleep
    (`engines.holdings`), in the target and in every order (a step's pool
    and context arrive or leave with the first of its moves to run).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence

from planner_service.domain.engines import (
    AFTER,
    RUNTIME_REFUSALS,
    EngineFeature,
    EngineKind,
    EngineState,
    RuntimeMove,
    Transition,
    may,
    offers,
    tensor_parallel_ok,
)
from planner_service.domain.problem import Problem
from planner_service.domain.scenario import Capability
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.planner import engine_holdings, engine_instances
from planner_service.planner.operations import Action, Operation, apply_operations
from planner_service.planner.residency import ResidencyIndex


def check_plan(
    problem: Problem,
    target: Mapping[tuple[StateObject, Location], int],
    ops: Sequence[Operation],
    unserved: Collection[str] = (),
) -> list[str]:
    errors: list[str] = []
    errors += _target_capacity(problem, target)
    errors += _active_served(problem, target, unserved)
    errors += _last_copies_kept(problem, target)
    errors += _replay(problem, target, ops)
    errors += _order_and_locality(problem, ops)
    errors += _every_order_safe(problem, target, ops)
    errors += _capabilities(problem, ops, target)
    errors += _engine_groups(problem, target)
    errors += _engine_expert_shares(problem, target)
    errors += _woken_expert_shares(problem, target, ops)
    errors += _tensor_parallel_groups(problem, target)
    refused = _engine_moves(problem, ops, target)
    errors += refused
    errors += _engine_steps(problem, ops, {e.split()[1] for e in refused})
    errors += _whole_shards(problem, target, ops)
    errors += _engine_capacity(problem, target, ops)
    return errors


def _target_capacity(problem: Problem, target: Mapping[tuple[StateObject, Location], int]) -> list[str]:
    errors = []
    used: dict[Location, int] = defaultdict(int)
    for (obj, loc), nbytes in target.items():
        used[loc] += nbytes
        if nbytes > problem.size_of(obj):
            errors.append(f"{obj.label()} at {loc.label()} holds {nbytes} bytes, more than its size")
    for loc, nbytes in sorted(used.items()):
        if nbytes > problem.capacity_of(loc):
            errors.append(f"capacity: {loc.label()} holds {nbytes} bytes > {problem.capacity_of(loc)}")
    return errors


def _active_served(
    problem: Problem, target: Mapping[tuple[StateObject, Location], int], unserved: Collection[str]
) -> list[str]:
    errors = []
    index = ResidencyIndex.build(problem, target)
    for s in problem.sessions.values():
        if not s.active or s.id in unserved:
            continue
        serving = index.serving.get(s.model)
        if serving is None:
            errors.append(f"active session {s.id}: {s.model}'s weights are not complete on one node's GPUs")
            continue
        kv = StateObject.kv(s.model, s.id)
        on_gpus = sum(target.get((kv, Location.gpu(g.id)), 0) for g in serving.gpus)
        if on_gpus < problem.size_of(kv):
            errors.append(f"active session {s.id}: its KV is not whole on the GPUs serving {s.model}")
    return errors


def _complete_tiers(
    problem: Problem, placement: Mapping[tuple[StateObject, Location], int]
) -> dict[tuple[StateObject, str], set[Tier]]:
    index = ResidencyIndex.build(problem, placement)
    out: dict[tuple[StateObject, str], set[Tier]] = defaultdict(set)
    for (obj, node, tier), nbytes in index.by_tier.items():
        if obj.kind is not Kind.KV and nbytes >= problem.size_of(obj) > 0:
            out[(obj, node)].add(tier)
    return out


def _last_copies_kept(problem: Problem, target: Mapping[tuple[StateObject, Location], int]) -> list[str]:
    before = _complete_tiers(problem, problem.residency)
    after = _complete_tiers(problem, target)
    return [
        f"last copy: node {node} loses every complete copy of {obj.label()}"
        for (obj, node) in sorted(before)
        if not after.get((obj, node))
    ]


def _replay(
    problem: Problem, target: Mapping[tuple[StateObject, Location], int], ops: Sequence[Operation]
) -> list[str]:
    replayed = {k: v for k, v in apply_operations(problem.residency, ops).items() if v > 0}
    wanted = {k: v for k, v in target.items() if v > 0}
    if replayed == wanted:
        return []
    diff = sorted(set(replayed.items()) ^ set(wanted.items()))[:3]
    return [f"replay: operations do not reproduce the target placement (first differences: {diff})"]


def _order_and_locality(problem: Problem, ops: Sequence[Operation]) -> list[str]:
    errors = []
    seen: set[str] = set()
    for op in ops:
        missing = [d for d in op.depends_on if d not in seen]
        if missing:
            errors.append(f"order: {op.id} comes before its dependencies {missing}")
        seen.add(op.id)
        if op.source is not None and op.dest is not None and problem.node_of(op.source) != problem.node_of(op.dest):
            errors.append(f"locality: {op.id} moves between nodes")
        if op.source is None and (op.object.kind is not Kind.KV or op.dest is None or op.dest.tier is not Tier.GPU):
            errors.append(f"source: {op.id} creates {op.object.label()} from nothing")
        if op.bytes <= 0:
            errors.append(f"bytes: {op.id} moves no bytes")
    return errors


def _ancestors(ops: Sequence[Operation]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for op in ops:  # topological order: dependencies are already done
        acc: set[str] = set()
        for d in op.depends_on:
            acc.add(d)
            acc |= out.get(d, set())
        out[op.id] = acc
    return out


def _every_order_safe(
    problem: Problem, target: Mapping[tuple[StateObject, Location], int], ops: Sequence[Operation]
) -> list[str]:
    """Worst cases over all orders that respect `depends_on`.

    Capacity: once any add to L has run, every free of L that is an ancestor
    of all adds to L has run too, so occupancy never exceeds
    C(L) + sum(adds to L) - sum(frees of L that precede every add to L).
    On an engine node's GPU, C counts the CUDA contexts of the instances up
    now, and an engine step adds or frees what its instance holds beside
    the bytes moved (`_engine_step_bytes`): the KV pool it launches is
    mapped whole with the call, and the KV the plan then puts in it takes
    no more room. A step is one call, made on the first of its moves to
    run, so it has run before an add once any of its moves is an ancestor
    of that add, and its own adds come after the frees its moves make (a
    restart stops the old instance, then starts).
    """
    errors = []
    anc = _ancestors(ops)
    # (bytes, the ids that have run before it: an add's ancestors) and (bytes, the ids any of which frees it)
    adds: dict[Location, list[tuple[int, set[str]]]] = defaultdict(list)
    frees: dict[Location, list[tuple[int, set[str]]]] = defaultdict(list)
    before = engine_instances.confirmed_states(problem)
    steps, pooled = _engine_step_bytes(target, ops, before)
    for op in ops:
        if op.dest is not None and not (op.object.kind is Kind.KV and (op.object.model, op.dest.id) in pooled):
            adds[op.dest].append((op.bytes, anc[op.id]))
        if op.source is not None and not op.keep_source:
            frees[op.source].append((op.bytes, {op.id}))
    used: dict[Location, int] = defaultdict(int)
    for (_, loc), nbytes in problem.residency.items():
        used[loc] += nbytes
    for g, nbytes in engine_holdings.up_contexts(before).items():
        used[Location.gpu(g)] += nbytes
    for members, per_gpu in steps:
        first = set.intersection(*(anc[m] for m in members)) | set(members)
        for g, nbytes in per_gpu.items():
            if nbytes > 0:
                adds[Location.gpu(g)].append((nbytes, first))
            elif nbytes < 0:
                frees[Location.gpu(g)].append((-nbytes, set(members)))
    for loc, add_events in sorted(adds.items()):
        common = set.intersection(*(before_it for _, before_it in add_events))
        freed_first = sum(nbytes for nbytes, by in frees.get(loc, []) if by & common)
        worst = used[loc] + sum(nbytes for nbytes, _ in add_events) - freed_first
        if worst > problem.capacity_of(loc):
            errors.append(f"capacity in some order: {loc.label()} can reach {worst} bytes > {problem.capacity_of(loc)}")

    readers: dict[tuple[StateObject, Location], list[Operation]] = defaultdict(list)
    reducers: dict[tuple[StateObject, Location], list[Operation]] = defaultdict(list)
    adders: dict[tuple[StateObject, Location], list[Operation]] = defaultdict(list)
    for op in ops:
        if op.source is not None:
            (readers if op.keep_source else reducers)[(op.object, op.source)].append(op)
        if op.dest is not None:
            adders[(op.object, op.dest)].append(op)
    for op in ops:
        if op.source is None or op.keep_source:
            continue
        early = [r.id for r in readers[(op.object, op.source)] if r.id not in anc[op.id]]
        if early:
            errors.append(
                f"source freed early: {op.id} may free {op.object.label()} at {op.source.label()} before {early} read it"
            )
        if op.action is Action.DROP and op.object.kind is not Kind.KV:
            if not _other_copy_guaranteed(problem, op, op.source, anc, reducers, adders):
                errors.append(
                    f"last copy in some order: {op.id} may drop the node's last complete copy of {op.object.label()}"
                )
    return errors


def _engine_step_bytes(
    target: Mapping[tuple[StateObject, Location], int],
    ops: Sequence[Operation],
    before: Mapping[tuple[str, str], engine_instances.InstanceView],
) -> tuple[list[tuple[list[str], dict[str, int]]], set[tuple[str, str]]]:
    """Each engine step's moves (ids) and the GPU bytes it adds (+) or frees (-) beside the bytes they move:
    the CUDA context of the instance it takes up or down (`engine_holdings.context_bytes`: a sleep keeps it, a
    stop frees it) and the KV pool an instance it brings up is launched with, taken whole by the call (vLLM
    allocates each KV cache tensor at its full size as it starts, vllm/v1/worker/gpu_model_runner.py
    `_allocate_kv_cache_tensors`; a wake maps it back whole, vllm/device_allocator/cumem.py); and the
    (model, GPU) pairs of those pools, whose KV the plan's moves put in room the pool holds already. A pool
    counts as the target counts it, max(0, pool - the KV the target puts there), plus that KV's moves there
    (the KV the target keeps there from before is counted where it is)."""
    if not before:
        return [], set()
    kv: dict[tuple[str, str], int] = defaultdict(int)  # (model, GPU) -> the target's KV there
    for (obj, loc), nbytes in target.items():
        if obj.kind is Kind.KV and loc.tier is Tier.GPU:
            kv[(obj.model, loc.id)] += nbytes
    kv_moved: dict[tuple[str, str], int] = defaultdict(int)  # (model, GPU) -> the KV the plan's moves put there
    for op in ops:
        if op.object.kind is Kind.KV and op.dest is not None and op.dest.tier is Tier.GPU:
            kv_moved[(op.object.model, op.dest.id)] += op.bytes
    steps: dict[tuple[str, str, Transition], list[Operation]] = defaultdict(list)
    for op in ops:
        if (
            op.engine is not None
            and op.engine.transition is not Transition.READAHEAD
            and (op.node, op.object.model) in before
        ):
            steps[(op.node, op.object.model, op.engine.transition)].append(op)
    out = []
    pooled: set[tuple[str, str]] = set()
    for (node, model, transition), moves in steps.items():
        step = moves[0].engine
        assert step is not None  # grouped by their steps
        b = before[(node, model)]
        if transition is Transition.START and (node, model, Transition.STOP) in steps:
            b = engine_instances.InstanceView(node, model, b.declared, EngineState.STOPPED, None, ())  # its own stop
        gpus = tuple(step.instance.gpus)
        a = engine_instances.InstanceView(node, model, b.declared, AFTER[transition], step.instance.precision, gpus)
        per_gpu: dict[str, int] = defaultdict(int)
        for g in b.gpus:
            per_gpu[g] -= engine_holdings.context_bytes(b)
        for g in a.gpus:
            per_gpu[g] += engine_holdings.context_bytes(a)
            if a.state is EngineState.RUNNING:
                pool = step.instance.kv_pool_bytes_per_gpu
                per_gpu[g] += max(0, pool - kv[(model, g)]) + kv_moved[(model, g)]
                pooled.add((model, g))
        out.append(([m.id for m in moves], dict(per_gpu)))
    return out, pooled


def _other_copy_guaranteed(
    problem: Problem,
    op: Operation,
    source: Location,
    anc: Mapping[str, set[str]],
    reducers: Mapping[tuple[StateObject, Location], list[Operation]],
    adders: Mapping[tuple[StateObject, Location], list[Operation]],
) -> bool:
    """Whether the node keeps a complete copy of what `op` drops from `source`, in every order."""
    size = problem.size_of(op.object)
    node = problem.node_of(source)
    after_drop = problem.residency.get((op.object, source), 0) - op.bytes
    if source.tier is not Tier.GPU and after_drop >= size:
        return True
    if source.tier is Tier.GPU:
        gpu_total = sum(
            b
            for (o, l), b in problem.residency.items()
            if o == op.object and l.tier is Tier.GPU and problem.node_of(l) == node
        )
        if gpu_total < size:
            return True  # the GPU tier held no complete copy to lose
    for tier in (Tier.HOST, Tier.NVME):
        loc = Location(tier, node)
        if loc == source or reducers.get((op.object, loc)):
            continue
        have = problem.residency.get((op.object, loc), 0)
        added = [a for a in adders.get((op.object, loc), [])]
        if have >= size or (have + sum(a.bytes for a in added) >= size and all(a.id in anc[op.id] for a in added)):
            return True
    return False


def _capabilities(
    problem: Problem, ops: Sequence[Operation], target: Mapping[tuple[StateObject, Location], int]
) -> list[str]:
    """The moves of a model its node runs without an engine, or with the `local` executor, are those its node
    declares. A vLLM or SGLang engine says what can be done with it instead (`_engine_moves`, `_engine_steps`,
    `_engine_expert_shares`): a vLLM node registers no capability, and its level-1 sleep still takes the weights
    to host RAM, LMCache its KV."""
    errors = []
    for op in ops:
        if not _by_node_capabilities(problem, op.node, op.object.model):
            continue
        caps = problem.nodes[op.node].capabilities
        below = op.dest is not None and op.dest.tier is not Tier.GPU
        if op.object.kind is Kind.WEIGHTS and Capability.WEIGHTS_OFFLOAD not in caps:
            if (op.dest is not None and op.dest.tier is Tier.HOST) or (
                op.source is not None and op.source.tier is Tier.HOST and op.dest and op.dest.tier is Tier.GPU
            ):
                errors.append(f"capability: {op.id} moves weights through host DRAM on node {op.node}, which cannot")
        if op.object.kind is Kind.KV and Capability.KV_OFFLOAD not in caps:
            # dropping KV that sits below GPU only frees memory; moving it between tiers needs the engine
            if below or (op.dest is not None and op.source is not None and op.source.tier is not Tier.GPU):
                errors.append(f"capability: {op.id} offloads KV on node {op.node}, which cannot")
    now = ResidencyIndex.build(problem, problem.residency)
    then = ResidencyIndex.build(problem, target)
    for (obj, node), nbytes in then.gpu_bytes.items():
        if obj.kind is not Kind.EXPERTS or not _by_node_capabilities(problem, node, obj.model):
            continue
        if Capability.PARTIAL_EXPERTS not in problem.nodes[node].capabilities:
            if 0 < nbytes < problem.size_of(obj) and nbytes != now.on(obj, node, Tier.GPU):
                errors.append(f"capability: node {node} cannot hold part of {obj.label()} on GPU")
    return errors


def _by_node_capabilities(problem: Problem, node_id: str, model_id: str) -> bool:
    """Whether the node's declared capabilities say what can be done with the model: no engine, or `local`."""
    return problem.nodes[node_id].engine_kind(model_id) in (None, EngineKind.LOCAL)


def _engine_groups(problem: Problem, target: Mapping[tuple[StateObject, Location], int]) -> list[str]:
    return outside_engine_groups(problem, target, gaining_only=True)


def outside_engine_groups(
    problem: Problem, placement: Mapping[tuple[StateObject, Location], int], *, gaining_only: bool = False
) -> list[str]:
    """Weights or experts on a GPU where no engine of their node can hold them: the node has no engine for the
    model, or fixes its engine to other GPUs. A plan is held to it where it adds bytes (`gaining_only`); a
    placement kept as it is, where anything is (a node may have registered its engines elsewhere since)."""
    errors = []
    for (obj, loc), nbytes in sorted(placement.items(), key=lambda item: (item[0][0].label(), item[0][1].label())):
        if loc.tier is not Tier.GPU or obj.kind is Kind.KV:
            continue
        if gaining_only and nbytes <= problem.residency.get((obj, loc), 0):
            continue
        node = problem.nodes[problem.gpus[loc.id].node]
        fixed = node.engine_gpus.get(obj.model)
        if not node.can_serve(obj.model):
            errors.append(
                f"engine: {obj.label()} gains bytes on {loc.label()}, but node {node.id} has no engine for {obj.model}"
            )
        elif fixed is not None and loc.id not in fixed:
            errors.append(
                f"engine: {obj.label()} gains bytes on {loc.label()}, outside the GPUs of {obj.model}'s engine on node "
                f"{node.id} ({', '.join(fixed)})"
            )
    return errors


def _woken_expert_shares(
    problem: Problem, target: Mapping[tuple[StateObject, Location], int], ops: Sequence[Operation]
) -> list[str]:
    """A sleeping MoE engine the plan wakes brings back the GPU expert share it was launched with, where its
    node reported it (`engine_holdings.launched_experts`): the wake maps back what its sleep offloaded
    (vllm/device_allocator/cumem.py `CuMemAllocator.wake_up`), no more and no less."""
    woken = {
        (op.node, op.object.model) for op in ops if op.engine is not None and op.engine.transition is Transition.WAKE
    }
    if not woken:
        return []
    launched = engine_holdings.launched_experts(problem, engine_instances.confirmed_states(problem))
    errors = []
    for node, model in sorted(woken & set(launched)):
        held = sum(launched[(node, model)][2].values())
        experts = StateObject.experts(model)
        planned = sum(target.get((experts, Location.gpu(g)), 0) for g in problem.nodes[node].gpus)
        if planned != held:
            errors.append(
                f"engine: {model}'s engine on {node} is woken with {planned} bytes of its routed experts on GPU, "
                f"not the {held} it was launched with: a wake maps back what its sleep offloaded"
            )
    return errors


def _engine_expert_shares(problem: Problem, target: Mapping[tuple[StateObject, Location], int]) -> list[str]:
    on_gpus: dict[tuple[str, str], dict[str, int]] = defaultdict(dict)  # (node, model) -> GPU -> expert bytes
    groups: dict[tuple[str, str], set[str]] = defaultdict(set)  # (node, model) -> GPUs of its weights
    for (obj, loc), nbytes in target.items():
        if loc.tier is not Tier.GPU or obj.kind is Kind.KV:
            continue
        key = (problem.gpus[loc.id].node, obj.model)
        if obj.kind is Kind.EXPERTS:
            on_gpus[key][loc.id] = nbytes
        else:
            groups[key].add(loc.id)
    errors = []
    for (node, model), shares in sorted(on_gpus.items()):
        if problem.nodes[node].engine_kind(model) is None:
            continue
        experts = StateObject.experts(model)
        now = {g: problem.residency.get((experts, Location.gpu(g)), 0) for g in problem.nodes[node].gpus}
        if {g: b for g, b in now.items() if b} == shares:
            continue  # as its running engine holds them now
        group = groups[(node, model)]
        held = [shares.get(g, 0) for g in sorted(group)]
        if not set(shares) <= group or (held and max(held) - min(held) > 1):
            errors.append(
                f"engine: {experts.label()} on node {node} is not in equal shares on its weights' GPUs "
                f"({', '.join(sorted(group))}): {', '.join(f'{g} {b}' for g, b in sorted(shares.items()))}"
            )
    return errors


def _tensor_parallel_groups(problem: Problem, target: Mapping[tuple[StateObject, Location], int]) -> list[str]:
    groups: dict[tuple[str, StateObject], set[str]] = defaultdict(set)  # (node, weights) -> its GPUs
    for (obj, loc), nbytes in target.items():
        if loc.tier is Tier.GPU and obj.kind is Kind.WEIGHTS and nbytes > 0:
            groups[(problem.gpus[loc.id].node, obj)].add(loc.id)
    errors = []
    for (node, obj), gpus in sorted(groups.items(), key=lambda item: (item[0][0], item[0][1].label())):
        model = problem.models[obj.model]
        kind = problem.nodes[node].engine_kind(obj.model)
        if tensor_parallel_ok(kind, model.attention_heads, len(gpus)):
            continue
        if all(problem.residency.get((obj, Location.gpu(g)), 0) == target[(obj, Location.gpu(g))] for g in gpus):
            continue  # as it runs now
        errors.append(
            f"engine: {obj.label()} on {len(gpus)} GPUs of node {node}: {kind.value if kind else kind} needs a group "
            f"size that divides its {model.attention_heads} attention heads"
        )
    return errors


def _served_precisions(
    problem: Problem, placement: Mapping[tuple[StateObject, Location], int]
) -> dict[tuple[str, str], set[str]]:
    """(model, node) -> the precisions whose weights are complete on the node's GPUs: its running engine."""
    out: dict[tuple[str, str], set[str]] = defaultdict(set)
    for (obj, node), nbytes in ResidencyIndex.build(problem, placement).gpu_bytes.items():
        if obj.kind is Kind.WEIGHTS and nbytes >= problem.size_of(obj) > 0:
            assert obj.precision is not None  # a weights object
            out[(obj.model, node)].add(obj.precision)
    return out


def _engine_moves(
    problem: Problem, ops: Sequence[Operation], target: Mapping[tuple[StateObject, Location], int]
) -> list[str]:
    errors = []
    before = _served_precisions(problem, problem.residency)
    after = _served_precisions(problem, target)

    kv_gains = {(op.object.model, op.dest.id) for op in ops if op.object.kind is Kind.KV and op.dest is not None}

    def refuse(op: Operation, kind: EngineKind, move: RuntimeMove, what: str) -> None:
        errors.append(
            f"engine: {op.id} {what} on node {op.node}, whose {kind.value} engine for {op.object.model} cannot: "
            f"{RUNTIME_REFUSALS[move]}"
        )

    for op in ops:
        obj = op.object
        kind = problem.nodes[op.node].engine_kind(obj.model)
        if kind is None or _carried_by_step(op):
            continue
        to_gpu = op.dest is not None and op.dest.tier is Tier.GPU
        if obj.kind is Kind.KV:
            restores = op.dest is not None and op.dest.tier is Tier.GPU and op.source is not None
            if restores and _lmcache(problem, op):
                continue  # LMCache loads it on the session's next request (a prefix hit): nothing is asked
            if _evicted_for_new_kv(op, kv_gains):
                continue  # the engine's pool evicts (LRU) to make room for the model's new KV there
            if op.source is not None and not offers(kind, RuntimeMove.SESSION_KV):
                if op.dest is None:
                    refuse(op, kind, RuntimeMove.SESSION_KV, f"frees {obj.label()} at {op.source.label()}")
                else:
                    refuse(
                        op,
                        kind,
                        RuntimeMove.SESSION_KV,
                        f"moves {obj.label()} from {op.source.label()} to {op.dest.label()}",
                    )
        elif obj.kind is Kind.EXPERTS:
            from_gpu = op.source is not None and op.source.tier is Tier.GPU and not op.keep_source
            running = before.get((obj.model, op.node), set()) & after.get((obj.model, op.node), set())
            if (to_gpu or from_gpu) and running and not offers(kind, RuntimeMove.EXPERT_SHARE):
                change = "adds" if to_gpu else "removes"
                refuse(
                    op,
                    kind,
                    RuntimeMove.EXPERT_SHARE,
                    f"{change} {op.bytes} bytes of {obj.label()} on GPU while the model runs at {min(running)}",
                )
        elif to_gpu:
            running = before.get((obj.model, op.node), set())
            if running and obj.precision not in running and not offers(kind, RuntimeMove.PRECISION):
                refuse(
                    op,
                    kind,
                    RuntimeMove.PRECISION,
                    f"brings {obj.label()} to the GPUs while the model runs at {', '.join(sorted(running))}",
                )
    return errors


def _carried_by_step(op: Operation) -> bool:
    """A move that an engine's own transition carries out (its weights, experts or KV with a start, wake,
    sleep, stop or restart): the step is checked by `_engine_steps`, not as a run-time move."""
    return op.engine is not None and op.engine.transition is not Transition.READAHEAD


def _evicted_for_new_kv(op: Operation, kv_gains: Collection[tuple[str, str]]) -> bool:
    """A session's KV that leaves a GPU where the same model's KV arrives: the pool's own LRU eviction."""
    src = op.source
    return op.dest is None and src is not None and src.tier is Tier.GPU and (op.object.model, src.id) in kv_gains


def _lmcache(problem: Problem, op: Operation) -> bool:
    declared = engine_instances.engine_of(problem, op.node, op.object.model)
    return declared is not None and EngineFeature.LMCACHE in declared.features


def _touches_gpu(op: Operation) -> bool:
    return (op.dest is not None and op.dest.tier is Tier.GPU) or (op.source is not None and op.source.tier is Tier.GPU)


def _engine_steps(problem: Problem, ops: Sequence[Operation], refused: Collection[str] = ()) -> list[str]:
    """Every engine node move that needs its engine carries a step its kind offers from the state it is in
    (`refused`: the operations refused as run-time moves already)."""
    before = engine_instances.confirmed_states(problem)
    if not before:
        return []
    errors: list[str] = []
    transitions: dict[tuple[str, str], set[Transition]] = defaultdict(set)
    for op in ops:
        if op.engine is not None and op.engine.transition is not Transition.READAHEAD:
            transitions[(op.node, op.object.model)].add(op.engine.transition)
    checked: set[tuple[str, str, Transition, str]] = set()
    for op in ops:
        key = (op.node, op.object.model)
        view = before.get(key)
        if view is None:
            continue
        step = op.engine
        if step is None:
            if op.object.kind is not Kind.KV and _touches_gpu(op) and op.id not in refused:
                errors.append(
                    f"engine: {op.id} moves {op.object.label()} on the GPUs of node {op.node} with no engine step: "
                    f"its {view.declared.kind.value} engine moves weights only by starting, waking, sleeping or stopping"
                )
            continue
        if step.instance.node != op.node or step.instance.model != op.object.model:
            errors.append(f"engine: {op.id} names instance {step.instance.id} on {step.instance.node}, not its own")
            continue
        expected = view.state
        if step.transition is Transition.START and transitions[key] == _STOP_THEN_START:
            expected = EngineState.STOPPED  # the plan's own stop left it so
        if step.transition is not Transition.READAHEAD and step.from_state is not expected:
            errors.append(
                f"engine: {op.id} {step.transition.value}s {step.instance.id} from {step.from_state.value}, but it is "
                f"{expected.value}"
            )
        seen = (op.node, op.object.model, step.transition, step.from_state.value)
        if seen in checked:
            continue
        checked.add(seen)
        inst = engine_instances.instance_from_ref(problem, step.previous or step.instance)
        verdict = may(inst, step.from_state, step.transition)
        if not verdict.allowed:
            missing = verdict.missing.value if verdict.missing is not None else "?"
            errors.append(
                f"engine: {op.id} asks {step.instance.id} on {op.node} ({inst.kind.value}) for {step.transition.value}, "
                f"which it does not offer ({missing}): {verdict.why}"
            )
    for (node, model), seen_transitions in sorted(transitions.items()):
        if seen_transitions == _STOP_THEN_START:
            errors += _started_after_the_stop(ops, node, model)
        elif len(seen_transitions) > 1:
            names = ", ".join(sorted(t.value for t in seen_transitions))
            errors.append(
                f"engine: {model}'s engine on {node} is asked for {names} in one plan: their order would decide its "
                "state; one transition per instance"
            )
    return errors


# The one pair of transitions an instance may take in one plan: a restart that no order makes safe as one call
# is a stop, then a start (operations.share_step_dependencies).
_STOP_THEN_START = frozenset({Transition.STOP, Transition.START})


def _started_after_the_stop(ops: Sequence[Operation], node: str, model: str) -> list[str]:
    """Every move of the instance's start waits, through `depends_on`, on a move of its stop: the stop's one
    call has been made before the start's."""
    by_id = {op.id: op for op in ops}
    stops = {
        op.id
        for op in ops
        if op.node == node and op.object.model == model and op.engine and op.engine.transition is Transition.STOP
    }
    errors = []
    for op in ops:
        if op.node != node or op.object.model != model or not op.engine or op.engine.transition is not Transition.START:
            continue
        seen: set[str] = set()
        stack = list(op.depends_on)
        while stack and not stops & seen:
            d = stack.pop()
            if d not in seen and d in by_id:
                seen.add(d)
                stack.extend(by_id[d].depends_on)
        if not stops & seen:
            errors.append(
                f"engine: {op.id} starts {op.engine.instance.id}, which the plan also stops, without waiting on the "
                "stop: the start would find the engine running"
            )
    return errors


def _whole_shards(
    problem: Problem, target: Mapping[tuple[StateObject, Location], int], ops: Sequence[Operation]
) -> list[str]:
    """A stop's moves take every weights and experts byte of its instance off the GPUs of its group, and a
    start's put the target's whole shard on each GPU of its group: the engine call frees or loads all of it,
    and the confirmed placement, moved by these moves, must say what the engine holds."""
    steps: dict[tuple[str, str, Transition], tuple[set[str], dict[tuple[StateObject, str], int]]] = {}
    for op in ops:
        step = op.engine
        if step is None or step.transition not in (Transition.STOP, Transition.START) or op.object.kind is Kind.KV:
            continue
        key = (op.node, op.object.model, step.transition)
        _gpus, moved = steps.setdefault(key, (set(step.instance.gpus), defaultdict(int)))
        if step.transition is Transition.STOP and op.source is not None and op.source.tier is Tier.GPU:
            moved[(op.object, op.source.id)] += 0 if op.keep_source else op.bytes
        if step.transition is Transition.START and op.dest is not None and op.dest.tier is Tier.GPU:
            moved[(op.object, op.dest.id)] += op.bytes
    if not steps:
        return []
    shards: dict[tuple[bool, str], list[tuple[StateObject, str, int]]] = defaultdict(list)  # (stop?, model) ->
    for stopping, placement in ((True, problem.residency), (False, target)):
        for (obj, loc), nbytes in placement.items():
            if obj.kind is not Kind.KV and loc.tier is Tier.GPU:
                shards[(stopping, obj.model)].append((obj, loc.id, nbytes))
    errors = []
    for (node, model, transition), (gpus, moved) in sorted(steps.items(), key=lambda kv: kv[0][:2]):
        what = "frees" if transition is Transition.STOP else "loads"
        for obj, g, nbytes in sorted(
            shards[(transition is Transition.STOP, model)], key=lambda s: (s[0].label(), s[1])
        ):
            if g in gpus and moved.get((obj, g), 0) != nbytes:
                errors.append(
                    f"engine: the {transition.value} of {model}'s engine on {node} {what} {moved.get((obj, g), 0)} "
                    f"bytes of {obj.label()} on gpu:{g}, not its whole shard of {nbytes}: the engine call {what} "
                    "all of it"
                )
    return errors


def _engine_capacity(
    problem: Problem, target: Mapping[tuple[StateObject, Location], int], ops: Sequence[Operation]
) -> list[str]:
    """GPU bytes with the KV pools of launched instances and the CUDA contexts of every instance up."""
    before = engine_instances.confirmed_states(problem)
    if not before:
        return []
    after = dict(before)
    pools: dict[tuple[str, str], int] = {}
    for op in ops:
        step = op.engine
        if step is None or step.transition is Transition.READAHEAD:
            continue
        key = (op.node, op.object.model)
        state = AFTER[step.transition]
        if step.transition is Transition.STOP and key in pools:
            continue  # the stop of a stop, then start: the start's instance is the one after the plan
        gpus = tuple(step.instance.gpus)
        after[key] = engine_instances.InstanceView(
            op.node, key[1], before[key].declared, state, step.instance.precision, gpus
        )
        if state is EngineState.RUNNING:
            pools[key] = step.instance.kv_pool_bytes_per_gpu
    # every instance up after the plan holds its CUDA context on each GPU of its group: a sleeping one its
    # residue, a running one beside its shard and pool (engines.holdings)
    extra: dict[str, int] = engine_holdings.up_contexts(after)
    kv: dict[tuple[str, str], int] = defaultdict(int)  # (model, gpu) -> KV bytes in the target
    used: dict[str, int] = defaultdict(int)
    for (obj, loc), nbytes in target.items():
        if loc.tier is Tier.GPU:
            used[loc.id] += nbytes
            if obj.kind is Kind.KV:
                kv[(obj.model, loc.id)] += nbytes
    errors = []
    for (node, model), pool in sorted(pools.items()):
        tp = len(after[(node, model)].gpus)
        least = engine_holdings.min_pool_bytes_per_gpu(problem, model, tp) if tp else 0
        if pool < least:
            errors.append(
                f"engine: {model}'s engine on {node} is launched with a KV pool of {pool} bytes per GPU, less than "
                f"one request of its maximum context takes ({least}): the engine would refuse to start"
            )
    # an instance that runs on as it is keeps the pool it was launched with (its room is taken already: the
    # capacity below counts the pools the plan launches)
    kept = {
        key: pool
        for key, pool in engine_holdings.launched_pools(problem, before).items()
        if key not in pools and after[key].state is EngineState.RUNNING and after[key].gpus == before[key].gpus
    }
    for (node, model), pool in sorted({**pools, **kept}.items()):
        for g in after[(node, model)].gpus:
            held = kv.get((model, g), 0)
            if held > pool:
                errors.append(
                    f"engine: {model}'s KV on gpu:{g} is planned at {held} bytes, beyond its engine's KV pool of "
                    f"{pool}: the engine cannot hold it there"
                )
            if (node, model) in pools:
                extra[g] += max(0, pool - held)
    for g, nbytes in sorted(extra.items()):
        capacity = problem.gpus[g].capacity_bytes
        if nbytes and used.get(g, 0) + nbytes > capacity:
            errors.append(
                f"capacity: gpu:{g} holds {used.get(g, 0)} bytes and {nbytes} of engine pools and engines' CUDA "
                f"contexts > {capacity}"
            )
    return errors
