"""The authoritative cluster state: sessions, confirmed placement, plans and operation queues.

`ClusterService` is the one owner of the live state. Every public method
takes the state lock, changes memory and writes the change through the
`Store` as one batch before it returns, so what a caller is told has
happened survives a crash. Planning reads a snapshot under the lock and
solves outside it, so lease polls and reports never wait behind a solve.

Lifecycle of an operation: `queued -> leased -> done | failed`, or
`superseded` when a newer plan epoch replaces it before it is leased (or
when its lease expires after a newer epoch exists). An expired lease of the
current epoch re-queues its operations. The confirmed placement, and with it
the SRV and its `version`, change only when an operation is reported `done`
(or when an operator changes the topology or catalog underneath it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from planner_service.domain.problem import Problem
from planner_service.domain.scenario import ClusterIn, Scenario, parse_scenario
from planner_service.metrics import Metrics, StateSnapshot
from planner_service.planner.plan import Plan
from planner_service.service.admin import Admin
from planner_service.service.calibration import Calibration
from planner_service.service.confirmed import Confirmed
from planner_service.service.inputs import Event, HeartbeatIn, RegisterIn, ReportIn
from planner_service.service.live import Live, placement_from_json, placement_of
from planner_service.service.nodes import nodes_from_json, nodes_to_json
from planner_service.service.planning import Planning
from planner_service.service.published import InstalledPlan, PublishedSrv
from planner_service.service.questions import LiveView
from planner_service.service.queues import Queues
from planner_service.service.records import FINAL_STATES, OpenOps, OpRecord, Quarantined, SessionState
from planner_service.service.sessions import Sessions
from planner_service.service.store import Batch, Store, Stored
from planner_service.service.views import Views
from planner_service.settings import Settings

log = logging.getLogger(__name__)


class ClusterService:
    """The service's parts around one live state: each public method is one of theirs."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        settings: Settings | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.live = Live(store, metrics, settings if settings is not None else Settings(), clock)
        self.confirmed = Confirmed(self.live)
        self.queues = Queues(self.live, self.confirmed)
        self.planning = Planning(self.live, self.queues)
        self.sessions = Sessions(self.live)
        self.views = Views(self.live, self.planning, self.queues)
        self.admin = Admin(self.live, self.confirmed, self.views)
        self.live.reloader = self._reload

    @property
    def ready(self) -> bool:
        return self.live.ready

    @property
    def urgent(self) -> threading.Event:  # the planning loop waits on it
        return self.live.urgent

    @property
    def broken(self) -> str | None:
        return self.live.broken

    def start(self, seed: Callable[[], Scenario]) -> bool:
        """Open the store; restore its state, or seed an empty one from `seed()`. True when seeded."""
        with self.live.lock:
            now = self.live.clock()
            self.live.store.open()
            self.live.prune(now)
            stored = self.live.store.load(now - self.live.observation_window())
            seeded = stored.empty
            if seeded:
                self._seed(seed(), now)
            else:
                self._restore(stored)
            self.live.ready = True
        self.live.durable()  # the seed, or the repairs a restore wrote
        return seeded

    def _reload(self) -> None:
        """Memory from the database alone, as a restart would have it (what only memory held is forgotten:
        the failures holding moves back); the next replan plans from it."""
        stored = self.live.store.load(self.live.clock() - self.live.observation_window())
        self.live.reset_state()
        self._restore(stored)
        self.live.force_replan = True

    def close(self) -> None:
        with self.live.lock:
            self.live.ready = False
            self.live.store.close()

    def _seed(self, scenario: Scenario, now: float) -> None:
        self.live.declared = scenario
        for s in scenario.sessions:
            self.live.sessions[s.id] = SessionState(
                id=s.id,
                user=s.user,
                slo=s.slo,
                model=s.model,
                active=s.active,
                context_tokens=s.context_tokens,
                cached_tokens={s.model: s.context_tokens} if s.context_tokens else {},
                created_at=now,
                last_activity=now,
            )
        self.live.placement = placement_of(scenario)
        self.live.predictor = self.live.new_predictor()
        placement = self.live.publish_srv()
        batch = Batch(
            meta={
                "base": self.live.declared_json(),
                "srv": self.live.stored_srv(),
                "epoch": 0,
                "calibration": self.live.calibration.to_json(),
                "nodes": nodes_to_json(self.live.node_records),
            },
            sessions={s.id: s.to_json() for s in self.live.sessions.values()},
            placement=placement,
        )
        self.live.write(batch)
        log.info(
            "seeded an empty database: %d nodes, %d models, %d sessions",
            len(self.live.declared.cluster.nodes),
            len(self.live.declared.models),
            len(self.live.sessions),
        )

    def _restore(self, stored: Stored) -> None:
        meta = stored.meta
        self.live.declared = parse_scenario(meta["base"])
        self.live.placement = dict(stored.placement)
        self.live.published_placement = dict(stored.placement)
        self.live.srv = PublishedSrv.from_json(meta["srv"])
        self.live.epoch = int(meta.get("epoch", 0))
        plan = self.live.plan = InstalledPlan.from_stored(meta.get("plan"))
        self.live.plan_placement = placement_from_json(plan.placement_json()) if plan is not None else {}
        # the failures that held moves back are not kept: the first replan queues them once more
        self.live.held_until = self.live.clock() if plan is not None and plan.held_back else None
        self.live.calibration, invalid = Calibration.from_json(meta.get("calibration"))
        for link, entry in invalid:  # an infinite or absurd bandwidth an older build took
            log.error("stored calibration of %s %s is not a bandwidth (%s): forgotten", link.key, link.field, entry)
        self.live.node_records = nodes_from_json(meta.get("nodes"))
        self.live.quarantine = tuple(Quarantined.from_json(q) for q in meta.get("quarantine", []))
        self.live.sessions = {k: SessionState.from_json(v) for k, v in stored.sessions.items()}
        self.live.event_ids = dict(stored.event_ids)
        self.live.ops = {k: OpRecord.from_json(v) for k, v in stored.operations.items()}
        self.live.open_ops = OpenOps(
            self.live.ops, (k for k, r in self.live.ops.items() if r.state not in FINAL_STATES)
        )
        self.live.predictor = self.live.new_predictor()
        for t, kind, a, b, gap, tokens in stored.observations:
            if kind == "handoff" and a in self.live.predictor.models and b in self.live.predictor.models:
                self.live.predictor.observe_handoff(t, a, b)
            elif kind == "gap" and gap is not None:
                self.live.predictor.observe_turn_gap(t, gap)
            elif kind == "end" and a in self.live.predictor.models:
                self.live.predictor.observe_session_end(t, a)
            elif kind == "request" and b is not None and tokens is not None:
                self.live.load.add(t, b, tokens)
        for session in self.live.sessions.values():
            last = self.live.last_used.get(session.model, session.last_activity)
            self.live.last_used[session.model] = max(last, session.last_activity)
        self.live.refresh_live()
        self.confirmed.repair_placement()
        log.info(
            "restored from the database: srv version %d, plan epoch %d, %d sessions, %d events, %d open operations",
            self.live.srv_version,
            self.live.epoch,
            len(self.live.sessions),
            len(self.live.event_ids),
            len(self.live.open_ops),
        )

    def status(self) -> dict[str, int | None]:
        return self.live.status()

    def add_listener(self, callback: Callable[[frozenset[str] | None], None]) -> None:
        self.live.add_listener(callback)

    # -- planning, queues and leases --------------------------------------------

    def replan(self, *, force: bool = False) -> dict[str, Any]:
        return self.planning.replan(force=force)

    def solve(self, problem: Problem, solver: str, **options: object) -> Plan:
        return self.planning.solve(problem, solver, **options)

    def tick(self) -> None:
        self.queues.tick()

    def lease(self, node_id: str, max_operations: int) -> dict[str, Any]:
        return self.queues.lease(node_id, max_operations)

    def renew(self, node_id: str, lease_id: str, *, node_scope: str | None = None) -> dict[str, Any]:
        return self.queues.renew(node_id, lease_id, node_scope=node_scope)

    def report(self, op_id: str, body: ReportIn, *, node_scope: str | None = None) -> dict[str, Any]:
        return self.queues.report(op_id, body, node_scope=node_scope)

    # -- events, operator edits, nodes ---------------------------------------------

    def apply_events(self, events: list[Event]) -> dict[str, Any]:
        return self.sessions.apply_events(events)

    def put_cluster(self, cluster: ClusterIn) -> dict[str, Any]:
        return self.admin.put_cluster(cluster)

    def put_model(
        self, model_id: str, spec: dict[str, Any], nvme_nodes: list[str] | None
    ) -> tuple[dict[str, Any], bool]:
        return self.admin.put_model(model_id, spec, nvme_nodes)

    def delete_model(self, model_id: str) -> None:
        self.admin.delete_model(model_id)

    def register_node(self, node_id: str, body: RegisterIn) -> dict[str, Any]:
        return self.admin.register_node(node_id, body)

    def calibration_view(self, node_id: str | None = None) -> dict[str, Any]:
        return self.admin.calibration_view(node_id)

    def reset_calibration(self, scope: str | None = None, key: str | None = None, field: str | None = None) -> int:
        return self.admin.reset_calibration(scope, key, field)

    def heartbeat(self, node_id: str, body: HeartbeatIn) -> dict[str, Any]:
        return self.admin.heartbeat(node_id, body)

    # -- reads -----------------------------------------------------------------

    def cluster_view(self) -> dict[str, Any]:
        return self.views.cluster_view()

    def models_view(self) -> list[dict[str, Any]]:
        return self.views.models_view()

    def sessions_view(self) -> list[dict[str, Any]]:
        return self.views.sessions_view()

    def session_view(self, session_id: str) -> dict[str, Any]:
        return self.views.session_view(session_id)

    def srv_view(self) -> dict[str, Any]:
        return self.views.srv_view()

    def plan_view(self) -> dict[str, Any]:
        return self.views.plan_view()

    def engines_view(self) -> list[dict[str, Any]]:
        return self.views.engines_view()

    def routes_view(self) -> dict[str, Any]:
        return self.views.routes_view()

    def operations_view(self, node: str | None = None, state: str | None = None) -> list[dict[str, Any]]:
        return self.views.operations_view(node, state)

    def metrics_snapshot(self) -> StateSnapshot:
        return self.views.metrics_snapshot()

    def live_view(self) -> LiveView:
        return self.views.live_view()
