"""Read views of the live state, as the API answers them."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from collections import defaultdict
from typing import Any

from planner_service.domain.problem import resolve_model
from planner_service.domain.scenario import Capability, NodeEngineIn
from planner_service.domain.state import (
    Kind,
    Tier,
)
from planner_service.metrics import StateSnapshot
from planner_service.planner import engine_plan
from planner_service.planner.gateway_directives import (
    DirectiveLimits,
    InstanceView,
    SessionView,
    WarmupPricing,
    decide_directives,
)
from planner_service.service.errors import (
    NotFound,
)
from planner_service.service.inputs import RegisterIn
from planner_service.service.live import (
    Live,
    iso,
)
from planner_service.service.nodes import NodeRecord
from planner_service.service.planning import Planning
from planner_service.service.questions import LiveView
from planner_service.service.queues import Queues
from planner_service.service.records import SessionState
from planner_service.service.state_lock import Urgency
from planner_service.service.store import Batch

log = logging.getLogger(__name__)


class Views:
    """Read views of the live state, as the API answers them."""

    def __init__(self, live: Live, planning: Planning, queues: Queues) -> None:
        self.live = live
        self.planning = planning
        self.queues = queues

    def cluster_view(self) -> dict[str, Any]:
        self.live.require_ready()
        with self.live.change():
            self.live.refresh_sizes()
            problem = self.live.sizes
            assert problem is not None
            used: dict[str, int] = defaultdict(int)
            planned: dict[str, int] = defaultdict(int)
            for (_, loc), nbytes in self.live.placement.items():
                if loc.tier is Tier.GPU:
                    used[loc.id] += nbytes
            for (_, loc), nbytes in self.live.plan_placement.items():
                if loc.tier is Tier.GPU:
                    planned[loc.id] += nbytes
            nodes = []
            for declared in self.live.declared.cluster.nodes:
                n = problem.nodes[declared.id]
                record = self.live.node_record(n.id)
                gpus = []
                for gpu in declared.gpus:
                    g = problem.gpus[gpu.id]
                    gpus.append(
                        {
                            "id": g.id,
                            "type": g.type,
                            "capacity_bytes": g.capacity_bytes,
                            "reserved_bytes": gpu.reserved_bytes,
                            "hbm_bytes_per_s": g.hbm_bytes_per_s,
                            "bf16_flops": g.bf16_flops,
                            "h2d_bytes_per_s": g.h2d_bytes_per_s,
                            "d2h_bytes_per_s": g.d2h_bytes_per_s,
                            "used_bytes": used[g.id],
                            "planned_bytes": planned[g.id],
                            "calibrated": self.live.calibration.of_json("gpus", g.id),
                        }
                    )
                nodes.append(
                    {
                        "id": n.id,
                        "host_dram_bytes": n.host_bytes,
                        "nvme_bytes": n.nvme_bytes,
                        "nvme_read_bytes_per_s": n.nvme_read_bytes_per_s,
                        "nvme_write_bytes_per_s": n.nvme_write_bytes_per_s,
                        "capabilities": sorted(c.value for c in n.capabilities),
                        "engines": engines_with_urls(declared.engines, record.registration),
                        "calibrated": self.live.calibration.of_json("nodes", n.id),
                        "registered_at": record.registered_at,
                        "last_heartbeat": record.last_heartbeat,
                        "telemetry": record.telemetry.model_dump(mode="json") if record.telemetry else None,
                        "reconcile": record.reconcile.public_json() if record.reconcile else None,
                        "gpus": gpus,
                    }
                )
            return {"nodes": nodes, "quarantine": [q.to_json() for q in self.live.quarantine]}

    def model_view(self, model_id: str) -> dict[str, Any]:
        model = next(m for m in self.live.declared.models if m.id == model_id)
        spec = resolve_model(model, "model")
        return {
            **model.model_dump(mode="json", exclude_none=True),
            "resolved": {
                "precisions": list(spec.precisions),
                "weights_bytes": dict(spec.weights_bytes),
                "kv_bytes_per_token": spec.kv_bytes_per_token,
                "kv_heads": spec.kv_heads,
                "experts_bytes": spec.experts_bytes,
                "expert_bytes": spec.expert_bytes,
                "is_moe": spec.is_moe,
                "active_params": spec.active_params,
            },
            "serving": model_id in self.live.serving,
        }

    def models_view(self) -> list[dict[str, Any]]:
        self.live.require_ready()
        with self.live.change():
            return [self.model_view(m) for m in self.live.model_ids()]

    def _session_view(self, s: SessionState) -> dict[str, Any]:
        kv: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for (obj, loc), n in self.live.placement.items():
            if obj.kind is Kind.KV and obj.session == s.id:
                kv[obj.model][loc.tier.value] += n
        return {
            "id": s.id,
            "user": s.user,
            "slo": s.slo.value,
            "model": s.model,
            "active": s.active,
            "ended": s.ended,
            "in_tool_call": s.in_tool_call,
            "context_tokens": s.context_tokens,
            "cached_tokens": dict(s.cached_tokens),
            "requests": s.requests,
            "tool_calls": s.tool_calls,
            "kv_bytes": {m: dict(t) for m, t in sorted(kv.items())},
            "last_activity": iso(s.last_activity),
        }

    def sessions_view(self) -> list[dict[str, Any]]:
        self.live.require_ready()
        with self.live.change():
            return [self._session_view(s) for _, s in sorted(self.live.sessions.items())]

    def session_view(self, session_id: str) -> dict[str, Any]:
        self.live.require_ready()
        with self.live.change():
            if session_id not in self.live.sessions:
                raise NotFound(f"unknown session {session_id!r}")
            return self._session_view(self.live.sessions[session_id])

    def srv_view(self) -> dict[str, Any]:
        self.live.require_ready()
        with self.live.change():
            return self.live.srv_view()

    def engines_view(self) -> list[dict[str, Any]]:
        """The engine nodes' instances now and once the current plan is done (planner/engine_plan.py)."""
        self.live.require_ready()
        with self.live.change():
            problem = self.live.problem(self.live.placement, {})
            plan = self.live.plan
            planned = self.live.plan_placement if plan is not None else None
            steps = engine_plan.plan_steps(plan.operations) if plan is not None else None
            return engine_plan.engine_rows(problem, planned, steps)

    def plan_view(self) -> dict[str, Any]:
        self.live.require_ready()
        with self.live.change():
            if self.live.plan is None:
                raise NotFound("no plan yet; POST /v1/plan to plan now")
            return self.live.plan.public_json()

    def operations_view(self, node: str | None = None, state: str | None = None) -> list[dict[str, Any]]:
        self.live.require_ready()
        with self.live.change():
            if node is not None:
                self.live.require_node(node)
            batch = Batch()
            self.queues.expire(batch)
            self.live.write(batch)
            ids = self.live.open_ops if state in (None, "queued", "leased") else self.live.ops.keys()
            rows = [self.live.ops[i] for i in ids]
            return [
                r.to_json()
                for r in sorted(rows, key=lambda r: (r.epoch, r.seq))
                if (node is None or r.node == node) and (state is None or r.state.value == state)
            ]

    def metrics_snapshot(self) -> StateSnapshot:
        snap = StateSnapshot()
        with self.live.change():
            if not self.live.ready or self.live.sizes is None:
                return snap
            for (obj, loc), n in self.live.placement.items():
                key = (obj.model, obj.kind.value, loc.tier.value)
                snap.resident_bytes[key] = snap.resident_bytes.get(key, 0) + n
            for g in self.live.sizes.gpus.values():
                snap.gpu_capacity_bytes[(g.node, g.id)] = g.capacity_bytes
                snap.gpu_used_bytes[(g.node, g.id)] = 0
            for (_, loc), n in self.live.placement.items():
                if loc.tier is Tier.GPU and loc.id in self.live.sizes.gpus:
                    snap.gpu_used_bytes[(self.live.sizes.gpus[loc.id].node, loc.id)] += n
            for i in self.live.open_ops:
                r = self.live.ops[i]
                key = (r.node, r.op.priority.value, r.state.value)
                snap.queue[key] = snap.queue.get(key, 0) + 1
            if (plan := self.live.plan) is not None:
                for held in plan.held_back:
                    key = (held.operation.node, held.operation.priority.value, "held_back")
                    snap.queue[key] = snap.queue.get(key, 0) + 1
                snap.predicted_p95_seconds = plan.predicted.switch_latency_p95_seconds
                snap.unserved_sessions = len(plan.unserved)
            snap.plan_epoch = self.live.epoch
        return snap

    def routes_view(self) -> dict[str, Any]:
        """The gateway's route table: per model its engine instances (state and URL), each session's KV holder.

        Instances are those the nodes' heartbeats report; a registered engine with a URL that no heartbeat
        reports yet counts as running where its model's weights sit on its node's GPUs, else stopped.
        """
        self.live.require_ready()
        with self.live.change(Urgency.URGENT):
            assert self.live.sizes is not None
            gpu_node = {g.id: g.node for g in self.live.sizes.gpus.values()}
            weights_on: dict[str, set[str]] = defaultdict(set)  # model -> GPUs holding its weights
            kv_on: dict[tuple[str, str], set[str]] = defaultdict(set)  # (session, model) -> GPUs holding its KV
            for (obj, loc), n in self.live.placement.items():
                if loc.tier is not Tier.GPU or n <= 0:
                    continue
                if obj.kind is Kind.WEIGHTS:
                    weights_on[obj.model].add(loc.id)
                elif obj.kind is Kind.KV and obj.session is not None:
                    kv_on[(obj.session, obj.model)].add(loc.id)
            instances: dict[str, list[dict[str, Any]]] = defaultdict(list)
            for node_id in self.live.node_ids():
                for model, entry in _node_instances(node_id, self.live.node_record(node_id), gpu_node):
                    if entry["state"] is None:
                        held = weights_on[model] & set(
                            entry["gpus"] or [g for g, n in gpu_node.items() if n == node_id]
                        )
                        entry["state"] = "running" if held else "stopped"
                    instances[model].append(entry)
            models: list[dict[str, Any]] = []
            for m in sorted(instances):
                entries: list[dict[str, Any]] = instances[m]
                models.append({"model": m, "instances": sorted(entries, key=_instance_order)})
            planned_kv: dict[tuple[str, str], set[str]] = defaultdict(set)  # (session, model) -> GPUs the plan keeps
            for (obj, loc), n in self.live.plan_placement.items():
                if obj.kind is Kind.KV and obj.session is not None and loc.tier is Tier.GPU and n > 0:
                    planned_kv[(obj.session, obj.model)].add(loc.id)
            kv_holders = {
                key: frozenset(e["id"] for e in instances.get(key[1], []) if set(e["gpus"]) & gpus)
                for key, gpus in kv_on.items()
            }
            sessions = []
            views: list[SessionView] = []
            for sid, s in sorted(self.live.sessions.items()):
                if s.ended:
                    continue
                holders = kv_holders.get((sid, s.model))
                holder = next((e["id"] for e in instances[s.model] if e["id"] in holders), None) if holders else None
                sessions.append({"session": sid, "model": s.model, "instance": holder})
                if holder is not None or s.active or s.in_tool_call:  # what a pin or a warm-up could concern
                    views.append(self._directive_session(s, holder, instances, planned_kv))
            table = {
                "models": models,
                "sessions": sessions,
                "directives": self._directives(instances, views, kv_holders),
            }
            digest = hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()[:16]
            return {"epoch": self.live.epoch, "revision": digest, **table}

    @staticmethod
    def _directive_session(
        s: SessionState,
        holder: str | None,
        instances: dict[str, list[dict[str, Any]]],
        planned_kv: dict[tuple[str, str], set[str]],
    ) -> SessionView:
        """What the directives read of a session; `planned_kv`: (session, model) -> GPUs the plan keeps it on."""
        kept = False
        if holder is not None and (planned := planned_kv.get((s.id, s.model))):
            kept = any(e["id"] == holder and planned.intersection(e["gpus"]) for e in instances.get(s.model, []))
        return SessionView(
            id=s.id,
            model=s.model,
            busy=s.active,  # a request in flight, served or waiting for its model (turn_end clears it)
            in_tool_call=s.in_tool_call,
            context_tokens=s.context_tokens,
            holder=holder,
            kept=kept,
            slo=s.slo,
        )

    def _directives(
        self,
        instances: dict[str, list[dict[str, Any]]],
        sessions: list[SessionView],
        kv_holders: dict[tuple[str, str], frozenset[str]],
    ) -> dict[str, Any]:
        """The gateway's pins and warm-ups (planner/gateway_directives.py), under the state lock."""
        assert self.live.sizes is not None
        sizes = self.live.sizes
        views = [
            InstanceView(
                id=e["id"],
                model=model,
                gpus=tuple(e["gpus"]),
                routable=e["state"] == "running" and bool(e["url"]),
            )
            for model, entries in instances.items()
            for e in entries
        ]
        in_tool_call = {s.id: s.model for s in sessions if s.in_tool_call and not s.busy}
        now = self.live.clock()
        rows = {m: self.live.predictor.next_model_probs(m, now) for m in set(in_tool_call.values())}  # one per model
        next_model = {sid: rows[m] for sid, m in in_tool_call.items()}
        queued: set[str] = set()
        for i in self.live.open_ops:
            op = self.live.ops[i].op
            queued.update(loc.id for loc in (op.source, op.dest) if loc is not None and loc.tier is Tier.GPU)
            if op.engine is not None:
                queued.update(op.engine.instance.gpus)
        free = {g: gpu.capacity_bytes for g, gpu in sizes.gpus.items()}
        for (_, loc), n in self.live.placement.items():
            if loc.tier is Tier.GPU and loc.id in free:
                free[loc.id] -= n
        # an engine's KV pool (reported, `sizes.engine_pools`) bounds a warm-up's KV to the pool beyond the KV of
        # its model placed there, on every GPU of its group
        kv_on_gpu: dict[tuple[str, str], int] = defaultdict(int)  # (model, GPU) -> KV bytes placed
        for (obj, loc), n in self.live.placement.items():
            if obj.kind is Kind.KV and loc.tier is Tier.GPU:
                kv_on_gpu[(obj.model, loc.id)] += n
        pool_room: dict[str, int] = {}
        for v in views:
            if v.gpus and (pool := sizes.engine_pools.get((sizes.gpus[v.gpus[0]].node, v.model))) is not None:
                pool_room[v.id] = min(pool - kv_on_gpu[(v.model, g)] for g in v.gpus)
        # a session in a tool call's KV below the GPUs of a node that loads KV back: the hand-off may restore it
        # rather than re-prefill (greedy `_kv_without_seconds` reads the larger of host and NVMe the same way)
        below: dict[tuple[str, str], dict[str, dict[Tier, int]]] = {}
        for (obj, loc), n in self.live.placement.items():
            if (
                obj.kind is Kind.KV
                and obj.session in in_tool_call
                and loc.tier in (Tier.HOST, Tier.NVME)
                and (node := sizes.nodes.get(loc.id)) is not None
                and Capability.KV_OFFLOAD in node.capabilities
            ):
                tiers = below.setdefault((obj.session, obj.model), {}).setdefault(loc.id, {})
                tiers[loc.tier] = tiers.get(loc.tier, 0) + n
        restorable = {
            key: {node: max(tiers.items(), key=lambda e: (e[1], e[0] is Tier.HOST)) for node, tiers in nodes.items()}
            for key, nodes in below.items()
        }
        horizon = sizes.constants.horizon_seconds
        turns = {m: self.live.predictor.next_turn(m, horizon, now) for m in rows}
        settings = self.live.settings
        pins, warmups = decide_directives(
            views,
            sessions,
            next_model,
            kv_holders,
            frozenset(queued),
            free,
            {m: spec.kv_bytes_per_token for m, spec in sizes.models.items()},
            DirectiveLimits(
                max_warmups_per_instance=settings.warmups_per_instance,
                min_probability=settings.warmup_min_probability,
                target=settings.warmup_target,
            ),
            WarmupPricing(sizes.models, sizes.gpus, sizes.constants, pool_room, sizes.nodes, restorable, turns),
        )
        return {
            "decided": True,
            "pins": [p.model_dump(mode="json") for p in pins],
            "warmups": [w.model_dump(mode="json") for w in warmups],
        }

    def live_view(self) -> LiveView:
        """A consistent copy of what questions about the live state need (what-if, Pareto, explain)."""
        self.live.require_ready()
        with self.live.change():
            assert self.live.sizes is not None
            state, next_model, _ = self.planning.planning_snapshot()
            return LiveView(
                state=state,
                next_model=next_model,
                predictor=copy.deepcopy(self.live.predictor),
                ended=frozenset(sid for sid, s in self.live.sessions.items() if s.ended),
                now=self.live.clock(),
                epoch=self.live.epoch,
                srv_version=self.live.srv_version,
                plan=self.live.plan,
                sizes=self.live.sizes,
                placement=dict(self.live.placement),
                plan_placement=dict(self.live.plan_placement),
                plan_ops=[
                    copy.deepcopy(r)
                    for r in self.live.ops.values()
                    if r.epoch == self.live.epoch or r.id in self.live.open_ops
                ],
                sessions={sid: copy.deepcopy(s) for sid, s in self.live.sessions.items()},
            )


def engines_with_urls(
    engines: list[NodeEngineIn] | None, registration: RegisterIn | None
) -> list[dict[str, Any]] | None:
    """A node's declared engines as {model, gpus, ...} entries with the URL its registration gave the engine
    serving each."""
    if engines is None:
        return None
    registered = registration.engines if registration is not None else []
    urls = {m: e.url for e in registered if e.url for m in e.models}
    entries = [e.model_dump(mode="json", exclude_none=True) for e in engines]
    return [{**e, "url": urls[e["model"]]} if e["model"] in urls else e for e in entries]


_STATE_ORDER = {"running": 0, "asleep": 1, "stopped": 2}


def _instance_order(entry: dict[str, Any]) -> tuple[int, str]:
    return _STATE_ORDER[entry["state"]], str(entry["id"])


_ROUTE_STATE = {"running": "running", "asleep_host": "asleep", "asleep_discarded": "asleep", "stopped": "stopped"}


def _node_instances(node: str, record: NodeRecord, gpu_node: dict[str, str]) -> list[tuple[str, dict[str, Any]]]:
    """(model, instance entry) per engine instance of a node: the heartbeat's instances with the URL of the
    registered engine serving that model there, then registered engines with a URL no heartbeat reports
    (state None: the caller draws it from the placement)."""
    engines = record.registration.engines if record.registration is not None else []
    reported = record.telemetry.instances if record.telemetry is not None else []

    def registered(model: str, gpus: list[str]) -> tuple[str | None, str | None]:
        """The URL and kind of the registered engine serving the model on that group."""
        for e in engines:
            if model in e.models and (not e.gpus or sorted(e.gpus) == sorted(gpus)):
                return e.url, e.kind
        return None, None

    out: list[tuple[str, dict[str, Any]]] = []
    seen: set[str] = set()
    for r in reported:
        inst = r.instance
        seen.add(inst.model)
        url, kind = registered(inst.model, inst.gpus)
        entry = {
            "id": inst.id,
            "node": node,
            "gpus": list(inst.gpus),
            "state": _ROUTE_STATE[r.state.value],
            "url": url,
            "engine": kind,
        }
        out.append((inst.model, entry))
    for e in engines:
        if not e.url:
            continue
        gpus = [g for g in e.gpus if gpu_node.get(g) == node]
        for model in e.models:
            if model not in seen:
                seen.add(model)
                entry = {"id": f"{node}/{e.name}", "node": node, "gpus": gpus, "state": None, "url": e.url}
                out.append((model, {**entry, "engine": e.kind}))
    return out
