"""Changes to a scenario, as plain edits of its JSON form.

What-if questions apply them to a copy of the live scenario; the admin
endpoints (PUT /v1/cluster, PUT/DELETE /v1/models) apply the same edits to the
live one. Every error names the field it is about.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, cast

from planner_service.domain.problem import resolve_model
from planner_service.domain.scenario import ClusterIn, ModelIn, ScenarioError
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

ScenarioData = dict[str, Any]  # Scenario.model_dump(mode="json")


class ChangeError(ValueError):
    """A change that cannot apply; the message starts with the field path."""


_FIELD_PATH = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:\[\d+\]|\.[A-Za-z0-9_]+)*): ")


def field_of(message: str) -> str | None:
    """The field a change's or a scenario's error names first (`changes[0].gpu.id: ...`), dotted as the
    API's problem documents write fields (`changes.0.gpu.id`); None when the message starts with none."""
    match = _FIELD_PATH.match(message)
    return re.sub(r"\[(\d+)\]", r".\1", match.group(1)) if match else None


def _node_ids(data: ScenarioData) -> list[str]:
    return [n["id"] for n in data["cluster"]["nodes"]]


def _find_node(data: ScenarioData, node_id: str, where: str) -> dict[str, Any]:
    for node in data["cluster"]["nodes"]:
        if node["id"] == node_id:
            return cast(dict[str, Any], node)
    raise ChangeError(f"{where}: unknown node {node_id!r}; known: {sorted(_node_ids(data))}")


def _new_gpu(data: ScenarioData, gpu_id: str, where: str) -> None:
    """GPU ids are unique across the cluster (a location names the GPU alone)."""
    for node in data["cluster"]["nodes"]:
        if any(g["id"] == gpu_id for g in node.get("gpus", [])):
            raise ChangeError(f"{where}: gpu {gpu_id!r} exists already, on node {node['id']!r}")


def _drop_residency(data: ScenarioData, keep: Callable[[dict[str, Any]], bool]) -> None:
    data["residency"] = [r for r in data["residency"] if keep(r)]


def _drop_engines(data: ScenarioData, keep: Callable[[dict[str, Any]], bool]) -> None:
    """Forget the engines that lose their model or a GPU (a node serving through its engines keeps the rest)."""
    for node in data["cluster"]["nodes"]:
        if node.get("engines") is not None:
            node["engines"] = [e for e in node["engines"] if keep(e)]


def nvme_copies(data: ScenarioData, model: ModelIn, nodes: list[str] | None, where: str) -> None:
    """Declare full copies of the model's weights (every precision) and routed experts on the nodes' NVMe."""
    try:
        spec = resolve_model(model, where)
    except ScenarioError as error:
        raise ChangeError(str(error)) from None
    targets = _node_ids(data) if nodes is None else nodes
    for node_id in targets:
        _find_node(data, node_id, f"{where}.nvme_nodes")
    objects: list[tuple[dict[str, Any], int]] = [
        ({"kind": "weights", "model": model.id, "precision": p}, spec.weights_bytes[p]) for p in spec.precisions
    ]
    if spec.is_moe:
        objects.append(({"kind": "experts", "model": model.id}, spec.experts_bytes))
    for node_id in targets:
        for obj, nbytes in objects:
            location = {"tier": "nvme", "node": node_id}
            _drop_residency(data, _not_at(obj, location))
            if nbytes > 0:
                data["residency"].append({"object": obj, "location": location, "bytes": nbytes})


def _not_at(obj: dict[str, Any], location: dict[str, Any]) -> Callable[[dict[str, Any]], bool]:
    """Keeps the residency entries other than `obj` at `location`."""
    return lambda r: not (_same_object(r["object"], obj) and r["location"] == location)


def _same_object(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("kind", "model", "precision", "session")
    return all(a.get(k) == b.get(k) for k in keys)


def _location_on(location: dict[str, Any], nodes: set[str], gpus: set[str]) -> bool:
    return location.get("gpu") in gpus if location["tier"] == "gpu" else location.get("node") in nodes


def replace_cluster(data: ScenarioData, cluster: ClusterIn) -> None:
    """New topology; state at locations that no longer exist is forgotten."""
    data["cluster"] = cluster.model_dump(mode="json", exclude_none=True)
    nodes = {n.id for n in cluster.nodes}
    gpus = {g.id for n in cluster.nodes for g in n.gpus}
    _drop_residency(data, lambda r: _location_on(r["location"], nodes, gpus))


def put_model(data: ScenarioData, model: ModelIn, nvme_nodes: list[str] | None, where: str) -> None:
    """Add or replace a model; replaced, it keeps its sessions and the state that still fits its new sizes."""
    entry = model.model_dump(mode="json", exclude_none=True)
    models = data["models"]
    replaced = False
    for i, existing in enumerate(models):
        if existing["id"] == model.id:
            models[i] = entry
            replaced = True
    if not replaced:
        models.append(entry)
    try:
        spec = resolve_model(model, where)
    except ScenarioError as error:
        raise ChangeError(str(error)) from None
    if replaced:

        def fits(r: dict[str, Any]) -> bool:
            obj = r["object"]
            if obj["model"] != model.id or obj["kind"] == "kv":
                return True
            if obj["kind"] == "weights":
                return obj["precision"] in spec.weights_bytes and r["bytes"] <= spec.weights_bytes[obj["precision"]]
            return spec.is_moe and r["bytes"] <= spec.experts_bytes

        _drop_residency(data, fits)
    nvme_copies(data, model, nvme_nodes, where)


def remove_model(data: ScenarioData, model_id: str, where: str) -> None:
    known = [m["id"] for m in data["models"]]
    if model_id not in known:
        raise ChangeError(f"{where}: unknown model {model_id!r}; known: {sorted(known)}")
    if len(known) == 1:
        raise ChangeError(f"{where}: {model_id!r} is the last model; a catalog needs at least one")
    data["models"] = [m for m in data["models"] if m["id"] != model_id]
    gone_sessions = {s["id"] for s in data["sessions"] if s["model"] == model_id}
    data["sessions"] = [s for s in data["sessions"] if s["id"] not in gone_sessions]
    _drop_residency(
        data, lambda r: r["object"]["model"] != model_id and r["object"].get("session") not in gone_sessions
    )
    _drop_engines(data, lambda e: e["model"] != model_id)
    handoff = data.get("predictor", {}).get("handoff", {})
    handoff.pop(model_id, None)
    for row in handoff.values():
        row.pop(model_id, None)


def apply_change(data: ScenarioData, change: Change, where: str) -> None:
    """Apply one what-if change to `data` in place."""
    if isinstance(change, AddGpu):
        node = _find_node(data, change.node, f"{where}.node")
        _new_gpu(data, change.gpu.id, f"{where}.gpu.id")
        node.setdefault("gpus", []).append(change.gpu.model_dump(mode="json", exclude_none=True))
    elif isinstance(change, RemoveGpu):
        known = [g["id"] for n in data["cluster"]["nodes"] for g in n.get("gpus", [])]
        if change.gpu not in known:
            raise ChangeError(f"{where}.gpu: unknown gpu {change.gpu!r}; known: {sorted(known)}")
        for node in data["cluster"]["nodes"]:
            node["gpus"] = [g for g in node.get("gpus", []) if g["id"] != change.gpu]
        _drop_residency(data, lambda r: r["location"].get("gpu") != change.gpu)
        _drop_engines(data, lambda e: change.gpu not in e["gpus"])
    elif isinstance(change, AddNode):
        if change.node.id in _node_ids(data):
            raise ChangeError(f"{where}.node.id: node {change.node.id!r} exists already")
        for j, gpu in enumerate(change.node.gpus):
            _new_gpu(data, gpu.id, f"{where}.node.gpus[{j}].id")
        data["cluster"]["nodes"].append(change.node.model_dump(mode="json", exclude_none=True))
        if change.copy_models:
            for i, m in enumerate(data["models"]):
                nvme_copies(data, ModelIn.model_validate(m), [change.node.id], f"models[{i}]")
    elif isinstance(change, RemoveNode):
        node = _find_node(data, change.node, f"{where}.node")
        if len(data["cluster"]["nodes"]) == 1:
            raise ChangeError(f"{where}.node: {change.node!r} is the last node; a cluster needs at least one")
        data["cluster"]["nodes"].remove(node)
        gpus = {g["id"] for g in node.get("gpus", [])}
        _drop_residency(data, lambda r: not _location_on(r["location"], {change.node}, gpus))
    elif isinstance(change, AddModel):
        if change.model.id in {m["id"] for m in data["models"]}:
            raise ChangeError(f"{where}.model.id: model {change.model.id!r} exists already")
        put_model(data, change.model, change.nvme_nodes, f"{where}.model")
    elif isinstance(change, RemoveModel):
        remove_model(data, change.model, f"{where}.model")
    elif isinstance(change, AddSessions):
        known = [m["id"] for m in data["models"]]
        if change.model not in known:
            raise ChangeError(f"{where}.model: unknown model {change.model!r}; known: {sorted(known)}")
        taken = {s["id"] for s in data["sessions"]}
        k = 0
        for _ in range(change.count):
            while f"whatif-{k}" in taken:
                k += 1
            taken.add(f"whatif-{k}")
            data["sessions"].append(
                {
                    "id": f"whatif-{k}",
                    "user": change.user,
                    "slo": change.slo.value,
                    "model": change.model,
                    "active": change.active,
                    "context_tokens": change.context_tokens,
                }
            )
    elif isinstance(change, SetSlo):
        for s in data["sessions"]:
            if s["id"] == change.session:
                s["slo"] = change.slo.value
                break
        else:
            known = sorted(s["id"] for s in data["sessions"])
            raise ChangeError(f"{where}.session: unknown session {change.session!r}; known: {known}")
    else:  # pragma: no cover - the union is closed
        raise ChangeError(f"{where}.type: unsupported change")
