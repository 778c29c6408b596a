"""Operator edits (cluster, models) and node registration and heartbeats."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from planner_service.domain.engines import KIND_FEATURES, EngineKind
from planner_service.domain.problem import compile_problem
from planner_service.domain.scenario import ClusterIn, ModelIn, NodeEngineIn, Scenario, ScenarioError
from planner_service.service import calibration
from planner_service.service import changes as edits
from planner_service.service.confirmed import Confirmed
from planner_service.service.errors import (
    Conflict,
    InvalidInput,
    NotFound,
)
from planner_service.service.inputs import (
    HeartbeatIn,
    RegisterIn,
)
from planner_service.service.live import Live, iso, scenario_with
from planner_service.service.store import Batch
from planner_service.service.views import Views, engines_with_urls

log = logging.getLogger(__name__)


class Admin:
    """Operator edits (cluster, models) and node registration and heartbeats."""

    def __init__(self, live: Live, confirmed: Confirmed, views: Views) -> None:
        self.live = live
        self.confirmed = confirmed
        self.views = views

    def _admin_edit(self, edit: Callable[[Scenario], Scenario]) -> None:
        """Apply an operator's edit to the live scenario; state at removed hardware or models is forgotten."""
        state = self.live.state(self.live.placement)  # the sessions and placement the catalog knows
        before = state.sessions
        try:
            scenario = edits.validated(edit(scenario_with(self.live.declared, before, state.residency)))
            problem = compile_problem(scenario, {})
        except (edits.ChangeError, ScenarioError) as error:
            raise InvalidInput(str(error), field=edits.field_of(str(error))) from None
        self.live.declared = scenario
        batch = Batch(meta={"base": self.live.declared_json(), "calibration": self.live.calibration.to_json()})
        for sid in {s.id for s in before} - {s.id for s in scenario.sessions}:
            self.live.sessions.pop(sid, None)
            batch.sessions[sid] = None
        for model in [m.id for m in scenario.models]:
            self.live.predictor.add_model(model)
        for model in set(self.live.predictor.models) - {m.id for m in scenario.models}:
            self.live.predictor.remove_model(model)
        self.live.placement = dict(problem.residency)
        batch.placement.update(self.live.publish_srv())
        batch.meta["srv"] = self.live.stored_srv()
        self.live.write(batch)
        self.live.topology_changes += 1
        self.live.wake(force=True)

    def put_cluster(self, cluster: ClusterIn) -> dict[str, Any]:
        self.live.require_ready()
        with self.live.change():
            explicit = [
                *((n.id, "nodes", f) for n in cluster.nodes for f in calibration.NODE_FIELDS if getattr(n, f)),
                *(
                    (g.id, "gpus", f)
                    for n in cluster.nodes
                    for g in n.gpus
                    for f in calibration.GPU_FIELDS
                    if getattr(g, f)
                ),
            ]
            for key, scope, field in explicit:  # the operator's figure wins over what was learned
                self.live.calibration.forget(calibration.Link(scope, key, field))
            self._admin_edit(lambda s: edits.replace_cluster(s, cluster))
            return self.views.cluster_view()

    def put_model(
        self, model_id: str, spec: dict[str, Any], nvme_nodes: list[str] | None
    ) -> tuple[dict[str, Any], bool]:
        self.live.require_ready()
        if "id" in spec and spec["id"] != model_id:
            raise InvalidInput(f"model.id: {spec['id']!r} differs from the path's {model_id!r}", field="model.id")
        try:
            model = ModelIn.model_validate({**spec, "id": model_id})
        except ValueError as error:
            raise InvalidInput(f"model: {error}", field="model") from None
        with self.live.change():
            created = model_id not in self.live.model_ids()
            self._admin_edit(lambda s: edits.put_model(s, model, nvme_nodes, "model"))
            return self.views.model_view(model_id), created

    def delete_model(self, model_id: str) -> None:
        self.live.require_ready()
        with self.live.change():
            if model_id not in self.live.model_ids():
                raise NotFound(f"unknown model {model_id!r}; known: {sorted(self.live.model_ids())}")
            self._refuse_model_in_use(model_id)
            self._admin_edit(lambda s: edits.remove_model(s, model_id, "model"))

    def _refuse_model_in_use(self, model_id: str) -> None:
        """A model is not deleted from under what uses it: an active session on it (its requests would fail),
        or an open operation on its state (a node may be copying it right now)."""
        sessions = sorted(s.id for s in self.live.sessions.values() if s.model == model_id and s.active and not s.ended)
        records = [self.live.ops[op_id] for op_id in self.live.open_ops]
        operations = [r.id for r in sorted(records, key=lambda r: (r.epoch, r.seq)) if r.op.object.model == model_id]
        if not sessions and not operations:
            return
        uses = []
        if sessions:
            uses.append(f"active session(s) {_listed(sessions)} (end them with a session_end event)")
        if operations:
            uses.append(f"open operation(s) {_listed(operations)} (wait until they are done or superseded)")
        raise Conflict(f"model {model_id!r} is in use: {'; '.join(uses)}")

    # -- calibration -------------------------------------------------------------

    def calibration_view(self, node_id: str | None = None) -> dict[str, Any]:
        """Every node (or `node_id`) with its GPUs: what each link learned, and whether the node calibrates."""
        self.live.require_ready()
        with self.live.lock:
            nodes = self.live.declared.cluster.nodes
            if node_id is not None:
                self.live.require_node(node_id)
                nodes = [n for n in nodes if n.id == node_id]
            learned = self.live.calibration
            out = []
            for node in nodes:
                scale = self.confirmed.node_scale(node.id)
                gpus = [{"id": g.id, "calibrated": learned.of_json("gpus", g.id)} for g in node.gpus]
                out.append(
                    {
                        "id": node.id,
                        "scale": scale,
                        "calibrates": scale >= 1,
                        "calibrated": learned.of_json("nodes", node.id),
                        "gpus": gpus,
                    }
                )
            return {"nodes": out}

    def reset_calibration(self, scope: str | None = None, key: str | None = None, field: str | None = None) -> int:
        """Forget what links learned: everything (no `scope`), a node's NVMe and its GPUs' links, one GPU's links,
        or one `field` of them; the links plan with their catalog (or explicit) bandwidths again. Answers how
        many entries were forgotten."""
        self.live.require_ready()
        with self.live.change():
            learned = self.live.calibration
            if scope is None:
                targets = sorted(learned.links(), key=lambda link: link.scope != "nodes")  # nodes first
            else:
                assert key is not None
                fields = calibration.NODE_FIELDS if scope == "nodes" else calibration.GPU_FIELDS
                if field is not None and field not in fields:
                    raise InvalidInput(
                        f"field: {field!r} is not a calibrated bandwidth of {scope}; choose one of {list(fields)}",
                        field="field",
                    )
                chosen = (field,) if field is not None else fields
                if scope == "nodes":
                    self.live.require_node(key)
                    targets = [calibration.Link("nodes", key, name) for name in chosen]
                    if field is None:
                        targets += [
                            calibration.Link("gpus", g.id, name)
                            for g in self.live.node(key).gpus
                            for name in calibration.GPU_FIELDS
                        ]
                else:
                    gpus = {g.id for n in self.live.declared.cluster.nodes for g in n.gpus}
                    if key not in gpus:
                        raise NotFound(f"unknown gpu {key!r}; known: {sorted(gpus)}")
                    targets = [calibration.Link("gpus", key, name) for name in chosen]
            forgotten = 0
            for link in targets:
                if learned.forget(link):
                    forgotten += 1
                    log.warning("calibration of %s %s reset by an operator", link.key, link.field)
            if forgotten:
                self.live.refresh_live()
                self.live.write(Batch(meta={"calibration": learned.to_json()}))
                self.live.wake(force=True)
            return forgotten

    def register_node(self, node_id: str, body: RegisterIn) -> dict[str, Any]:
        self.live.require_ready()
        with self.live.change():
            self.live.require_node(node_id)
            now = self.live.clock()
            node = self.live.node(node_id)
            known = {g.id: g for g in node.gpus}
            warnings = []
            seen = {g.id for g in body.gpus}
            for i, g in enumerate(body.gpus):
                if g.id not in known:
                    warnings.append(f"gpus[{i}].id: {g.id!r} is not in the cluster topology; PUT /v1/cluster to add it")
                elif g.type and known[g.id].type and g.type != known[g.id].type:
                    warnings.append(f"gpus[{i}].type: {g.type!r}, the topology says {known[g.id].type!r}")
            if body.gpus:
                warnings += [f"gpu {gid!r} of the topology was not reported" for gid in sorted(set(known) - seen)]
            if body.scale < 1:
                warnings.append(
                    f"scale {body.scale:g}: a scaled test run; this node's measurements do not calibrate bandwidths"
                )
                log.info("node %s registered at scale %g: its measured copies do not calibrate", node_id, body.scale)
            engines = self._node_engines(body, set(known), node.engines or [])
            batch = Batch()
            registered = node
            if body.capabilities is not None and sorted(body.capabilities) != sorted(node.capabilities):
                registered = registered.model_copy(update={"capabilities": list(body.capabilities)})
            if engines != node.engines:
                registered = registered.model_copy(update={"engines": engines})
            if registered is not node:
                self.live.replace_node(registered)
                batch.meta["base"] = self.live.declared_json()
                self.live.topology_changes += 1
                self.live.wake(force=True)
            self.live.put_node_record(node_id, self.live.node_record(node_id).registered(body, iso(now)), batch)
            self.live.write(batch)
            return {
                "node": node_id,
                "registered_at": iso(now),
                "capabilities": [c.value for c in registered.capabilities],
                "engines": engines_with_urls(registered.engines, body),
                "gpus": sorted(known),
                "lease_seconds": self.live.settings.lease_seconds,
                "scale": body.scale,
                "warnings": warnings,
            }

    def _node_engines(
        self, body: RegisterIn, node_gpus: set[str], declared: list[NodeEngineIn]
    ) -> list[NodeEngineIn] | None:
        """The node's `engines` from a registration, checked: an entry per model its engines serve, with the
        GPUs of an engine launched on fixed ones, and for a vllm or sglang engine its kind, features and
        management (the registration's, else what the topology declared for that model's engine of that
        kind), so that the planner keeps planning engine transitions for it; None where no engine names a
        model (any model, any group)."""
        models = set(self.live.model_ids())
        before = {e.model: e for e in declared if e.kind is not None}
        out: dict[str, NodeEngineIn] = {}
        for i, engine in enumerate(body.engines):
            for j, gpu in enumerate(engine.gpus):
                if gpu not in node_gpus:
                    raise InvalidInput(
                        f"engines[{i}].gpus[{j}]: {gpu!r} is not a GPU of this node; its GPUs: {sorted(node_gpus)}",
                        field=f"engines.{i}.gpus.{j}",
                    )
            if len(set(engine.gpus)) != len(engine.gpus):
                raise InvalidInput(f"engines[{i}].gpus: a GPU is named twice", field=f"engines.{i}.gpus")
            kind = EngineKind(engine.kind) if engine.kind in ("vllm", "sglang") else None
            if kind is not None and engine.features is not None:
                foreign = [f.value for f in engine.features if f not in KIND_FEATURES[kind]]
                if foreign:
                    raise InvalidInput(
                        f"engines[{i}].features: a {kind.value} engine has no {', '.join(foreign)}",
                        field=f"engines.{i}.features",
                    )
            for j, model in enumerate(engine.models):
                if model not in models:
                    raise InvalidInput(
                        f"engines[{i}].models[{j}]: unknown model {model!r}; known: {sorted(models)}",
                        field=f"engines.{i}.models.{j}",
                    )
                if model in out and out[model].gpus != sorted(engine.gpus):
                    raise InvalidInput(
                        f"engines[{i}].models[{j}]: {model!r} has another engine here, on {out[model].gpus or 'any GPUs'}; "
                        "the planner serves a model from one group per node",
                        field=f"engines.{i}.models.{j}",
                    )
                if kind is None:
                    out[model] = NodeEngineIn(model=model, gpus=sorted(engine.gpus))
                    continue
                prior = before.get(model)
                prior = prior if prior is not None and prior.kind is kind else None
                features = engine.features if engine.features is not None else (prior.features if prior else None)
                management = engine.management or (prior.management if prior else None)
                out[model] = NodeEngineIn(
                    model=model,
                    gpus=sorted(engine.gpus),
                    kind=kind,
                    features=sorted(features) if features else None,
                    management=management or None,
                )
        return [out[m] for m in sorted(out)] if out else None

    def heartbeat(self, node_id: str, body: HeartbeatIn) -> dict[str, Any]:
        self.live.require_ready()
        with self.live.change():
            self.live.require_node(node_id)
            assert self.live.sizes is not None
            node_gpus = set(self.live.sizes.nodes[node_id].gpus)
            for i, g in enumerate(body.gpus):
                if g.id not in node_gpus:
                    raise InvalidInput(
                        f"gpus[{i}].id: {g.id!r} is not a GPU of node {node_id!r}; its GPUs: {sorted(node_gpus)}",
                        field=f"gpus.{i}.id",
                    )
            unknown_models = sorted(set(body.expert_hit_rates) - set(self.live.sizes.models))
            if unknown_models:
                raise InvalidInput(
                    f"expert_hit_rates: unknown model(s) {unknown_models}; known: {sorted(self.live.sizes.models)}",
                    field="expert_hit_rates",
                )
            self._check_instances(node_id, body, node_gpus)
            now = self.live.clock()
            batch = Batch()
            heard = f"the heartbeat of {node_id}"
            for g in body.gpus:
                for field in calibration.GPU_FIELDS:
                    if getattr(g, field) is not None:
                        self.confirmed.calibrate(
                            calibration.Link("gpus", g.id, field), getattr(g, field), None, batch, heard
                        )
            for field in calibration.NODE_FIELDS:
                if getattr(body, field) is not None:
                    self.confirmed.calibrate(
                        calibration.Link("nodes", node_id, field), getattr(body, field), None, batch, heard
                    )
            reconciled = self.confirmed.reconcile(node_id, body, now, batch)
            pools = self.live.engine_pools()
            self.live.put_node_record(node_id, self.live.node_record(node_id).heard(body, iso(now), reconciled), batch)
            if self.live.engine_pools() != pools:  # the SRV counts no GPU KV beyond a running engine's pool
                batch.placement.update(self.live.publish_srv())
                batch.meta["srv"] = self.live.stored_srv()
            self.live.write(batch)
            return {
                "node": node_id,
                "received_at": iso(now),
                "calibration": self.live.calibration.of_json("nodes", node_id),
            }

    def _check_instances(self, node_id: str, body: HeartbeatIn, node_gpus: set[str]) -> None:
        """Refuse (naming the field) an engine instance of another node, on GPUs the node does not have, or of
        a model or precision the catalog does not know."""
        assert self.live.sizes is not None
        models = self.live.sizes.models
        for i, entry in enumerate(body.instances):
            inst, field = entry.instance, f"instances.{i}.instance"
            if inst.node != node_id:
                raise InvalidInput(f"{field}.node: {inst.node!r} is not this node ({node_id!r})", field=f"{field}.node")
            strange = sorted(set(inst.gpus) - node_gpus)
            if strange:
                raise InvalidInput(
                    f"{field}.gpus: {strange} are not GPUs of node {node_id!r}; its GPUs: {sorted(node_gpus)}",
                    field=f"{field}.gpus",
                )
            if inst.model not in models:
                raise InvalidInput(
                    f"{field}.model: unknown model {inst.model!r}; known: {_listed(sorted(models))}",
                    field=f"{field}.model",
                )
            if inst.precision not in models[inst.model].precisions:
                raise InvalidInput(
                    f"{field}.precision: {inst.model} has no precision {inst.precision!r}; "
                    f"its precisions: {list(models[inst.model].precisions)}",
                    field=f"{field}.precision",
                )


def _listed(ids: list[str], most: int = 10) -> str:
    """Up to `most` ids, then how many more."""
    shown = ", ".join(ids[:most])
    return shown if len(ids) <= most else f"{shown} and {len(ids) - most} more"
