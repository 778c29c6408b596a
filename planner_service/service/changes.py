"""Changes to a scenario, as typed edits: each takes a `Scenario` and returns the changed one.

What-if questions apply them to a copy of the live scenario; the admin
endpoints (PUT /v1/cluster, PUT/DELETE /v1/models) apply the same edits to the
live one. An edit builds its result without validating it; `validated` checks
the whole result once, as a scenario file is checked. Every error names the
field it is about.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from planner_service.domain.architecture import Precision
from planner_service.domain.problem import resolve_model
from planner_service.domain.scenario import (
    ClusterIn,
    GpuSpecIn,
    LocationIn,
    ModelIn,
    NodeEngineIn,
    NodeIn,
    ObjectIn,
    ResidencyIn,
    Scenario,
    ScenarioError,
    SessionIn,
    parse_scenario,
)
from planner_service.service.inputs import (
    AddGpu,
    AddModel,
    AddNode,
    AddSessions,
    Change,
    RemoveGpu,
    RemoveModel,
    RemoveNode,
    SetSlo,
)


class ChangeError(ValueError):
    """A change that cannot apply; the message starts with the field path."""


_FIELD_PATH = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:\[\d+\]|\.[A-Za-z0-9_]+)*): ")


def field_of(message: str) -> str | None:
    """The field a change's or a scenario's error names first (`changes[0].gpu.id: ...`), dotted as the
    API's problem documents write fields (`changes.0.gpu.id`); None when the message starts with none."""
    match = _FIELD_PATH.match(message)
    return re.sub(r"\[(\d+)\]", r".\1", match.group(1)) if match else None


def validated(scenario: Scenario) -> Scenario:
    """The edited scenario checked as a whole, as a scenario file is (raises `ScenarioError` naming the
    field): the edits build it without running the validators."""
    return parse_scenario(scenario.model_dump())


def _node_ids(s: Scenario) -> list[str]:
    return [n.id for n in s.cluster.nodes]


def _find_node(s: Scenario, node_id: str, where: str) -> NodeIn:
    for node in s.cluster.nodes:
        if node.id == node_id:
            return node
    raise ChangeError(f"{where}: unknown node {node_id!r}; known: {sorted(_node_ids(s))}")


def _new_gpu(s: Scenario, gpu_id: str, where: str) -> None:
    """GPU ids are unique across the cluster (a location names the GPU alone)."""
    for node in s.cluster.nodes:
        if any(g.id == gpu_id for g in node.gpus):
            raise ChangeError(f"{where}: gpu {gpu_id!r} exists already, on node {node.id!r}")


def _with_nodes(s: Scenario, nodes: list[NodeIn]) -> Scenario:
    return s.model_copy(update={"cluster": s.cluster.model_copy(update={"nodes": nodes})})


def _keep_residency(s: Scenario, keep: Callable[[ResidencyIn], bool]) -> Scenario:
    return s.model_copy(update={"residency": [r for r in s.residency if keep(r)]})


def _keep_engines(s: Scenario, keep: Callable[[NodeEngineIn], bool]) -> Scenario:
    """Forget the engines that lose their model or a GPU (a node serving through its engines keeps the rest)."""
    return _with_nodes(
        s,
        [
            n if n.engines is None else n.model_copy(update={"engines": [e for e in n.engines if keep(e)]})
            for n in s.cluster.nodes
        ],
    )


def nvme_copies(s: Scenario, model: ModelIn, nodes: list[str] | None, where: str) -> Scenario:
    """Declare full copies of the model's weights (every precision) and routed experts on the nodes' NVMe."""
    try:
        spec = resolve_model(model, where)
    except ScenarioError as error:
        raise ChangeError(str(error)) from None
    targets = _node_ids(s) if nodes is None else nodes
    for node_id in targets:
        _find_node(s, node_id, f"{where}.nvme_nodes")
    objects = [
        (ObjectIn(kind="weights", model=model.id, precision=Precision(p)), spec.weights_bytes[p])
        for p in spec.precisions
    ]
    if spec.is_moe:
        objects.append((ObjectIn(kind="experts", model=model.id), spec.experts_bytes))
    copies = [
        ResidencyIn(object=obj, location=LocationIn(tier="nvme", node=node_id), bytes=nbytes)
        for node_id in targets
        for obj, nbytes in objects
    ]
    replaced = {(c.object, c.location.node) for c in copies}
    kept = [r for r in s.residency if r.location.tier != "nvme" or (r.object, r.location.node) not in replaced]
    return s.model_copy(update={"residency": [*kept, *(c for c in copies if c.bytes > 0)]})


def _location_on(location: LocationIn, nodes: set[str], gpus: set[str]) -> bool:
    return location.gpu in gpus if location.tier == "gpu" else location.node in nodes


def replace_cluster(s: Scenario, cluster: ClusterIn) -> Scenario:
    """New topology; state at locations that no longer exist is forgotten."""
    nodes = {n.id for n in cluster.nodes}
    gpus = {g.id for n in cluster.nodes for g in n.gpus}
    s = s.model_copy(update={"cluster": cluster})
    return _keep_residency(s, lambda r: _location_on(r.location, nodes, gpus))


def put_model(s: Scenario, model: ModelIn, nvme_nodes: list[str] | None, where: str) -> Scenario:
    """Add or replace a model; replaced, it keeps its sessions and the state that still fits its new sizes."""
    replaced = any(m.id == model.id for m in s.models)
    models = [model if m.id == model.id else m for m in s.models] if replaced else [*s.models, model]
    s = s.model_copy(update={"models": models})
    try:
        spec = resolve_model(model, where)
    except ScenarioError as error:
        raise ChangeError(str(error)) from None
    if replaced:

        def fits(r: ResidencyIn) -> bool:
            obj = r.object
            if obj.model != model.id or obj.kind == "kv":
                return True
            if obj.kind == "weights":
                held = spec.weights_bytes.get(obj.precision) if obj.precision is not None else None
                return held is not None and r.bytes <= held
            return spec.is_moe and r.bytes <= spec.experts_bytes

        s = _keep_residency(s, fits)
    return nvme_copies(s, model, nvme_nodes, where)


def remove_model(s: Scenario, model_id: str, where: str) -> Scenario:
    known = [m.id for m in s.models]
    if model_id not in known:
        raise ChangeError(f"{where}: unknown model {model_id!r}; known: {sorted(known)}")
    if len(known) == 1:
        raise ChangeError(f"{where}: {model_id!r} is the last model; a catalog needs at least one")
    gone_sessions = {x.id for x in s.sessions if x.model == model_id}
    handoff = {
        src: {dst: w for dst, w in row.items() if dst != model_id}
        for src, row in s.predictor.handoff.items()
        if src != model_id
    }
    s = s.model_copy(
        update={
            "models": [m for m in s.models if m.id != model_id],
            "sessions": [x for x in s.sessions if x.id not in gone_sessions],
            "predictor": s.predictor.model_copy(update={"handoff": handoff}),
        }
    )
    s = _keep_residency(s, lambda r: r.object.model != model_id and r.object.session not in gone_sessions)
    return _keep_engines(s, lambda e: e.model != model_id)


def apply_change(s: Scenario, change: Change, where: str) -> Scenario:
    """`s` with one what-if change applied."""
    if isinstance(change, AddGpu):
        node = _find_node(s, change.node, f"{where}.node")
        _new_gpu(s, change.gpu.id, f"{where}.gpu.id")
        grown = node.model_copy(update={"gpus": [*node.gpus, change.gpu]})
        return _with_nodes(s, [grown if n.id == node.id else n for n in s.cluster.nodes])
    if isinstance(change, RemoveGpu):
        known = [g.id for n in s.cluster.nodes for g in n.gpus]
        if change.gpu not in known:
            raise ChangeError(f"{where}.gpu: unknown gpu {change.gpu!r}; known: {sorted(known)}")
        s = _with_nodes(
            s,
            [n.model_copy(update={"gpus": _without_gpu(n.gpus, change.gpu)}) for n in s.cluster.nodes],
        )
        s = _keep_residency(s, lambda r: r.location.gpu != change.gpu)
        return _keep_engines(s, lambda e: change.gpu not in e.gpus)
    if isinstance(change, AddNode):
        if change.node.id in _node_ids(s):
            raise ChangeError(f"{where}.node.id: node {change.node.id!r} exists already")
        for j, gpu in enumerate(change.node.gpus):
            _new_gpu(s, gpu.id, f"{where}.node.gpus[{j}].id")
        s = _with_nodes(s, [*s.cluster.nodes, change.node])
        if change.copy_models:
            for i, m in enumerate(s.models):
                s = nvme_copies(s, m, [change.node.id], f"models[{i}]")
        return s
    if isinstance(change, RemoveNode):
        node = _find_node(s, change.node, f"{where}.node")
        if len(s.cluster.nodes) == 1:
            raise ChangeError(f"{where}.node: {change.node!r} is the last node; a cluster needs at least one")
        s = _with_nodes(s, [n for n in s.cluster.nodes if n.id != node.id])
        gpus = {g.id for g in node.gpus}
        return _keep_residency(s, lambda r: not _location_on(r.location, {change.node}, gpus))
    if isinstance(change, AddModel):
        if change.model.id in {m.id for m in s.models}:
            raise ChangeError(f"{where}.model.id: model {change.model.id!r} exists already")
        return put_model(s, change.model, change.nvme_nodes, f"{where}.model")
    if isinstance(change, RemoveModel):
        return remove_model(s, change.model, f"{where}.model")
    if isinstance(change, AddSessions):
        known = [m.id for m in s.models]
        if change.model not in known:
            raise ChangeError(f"{where}.model: unknown model {change.model!r}; known: {sorted(known)}")
        taken = {x.id for x in s.sessions}
        added = []
        k = 0
        for _ in range(change.count):
            while f"whatif-{k}" in taken:
                k += 1
            taken.add(f"whatif-{k}")
            added.append(
                SessionIn(
                    id=f"whatif-{k}",
                    user=change.user,
                    slo=change.slo,
                    model=change.model,
                    active=change.active,
                    context_tokens=change.context_tokens,
                )
            )
        return s.model_copy(update={"sessions": [*s.sessions, *added]})
    if isinstance(change, SetSlo):
        if change.session not in {x.id for x in s.sessions}:
            known_sessions = sorted(x.id for x in s.sessions)
            raise ChangeError(f"{where}.session: unknown session {change.session!r}; known: {known_sessions}")
        sessions = [x.model_copy(update={"slo": change.slo}) if x.id == change.session else x for x in s.sessions]
        return s.model_copy(update={"sessions": sessions})
    raise ChangeError(f"{where}.type: unsupported change")  # pragma: no cover - the union is closed


def _without_gpu(gpus: list[GpuSpecIn], gpu_id: str) -> list[GpuSpecIn]:
    return [g for g in gpus if g.id != gpu_id]
