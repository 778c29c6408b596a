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

import copy
import dataclasses
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from planner_service.domain.problem import Problem, compile_problem, resolve_model
from planner_service.domain.scenario import (
    ClusterIn,
    ModelIn,
    PredictorIn,
    Scenario,
    ScenarioError,
    Slo,
    parse_scenario,
)
from planner_service.domain.state import (
    Kind,
    Location,
    Placement,
    StateObject,
    Tier,
    location_from_json,
    object_from_json,
    placement_to_json,
)
from planner_service.metrics import Metrics, StateSnapshot
from planner_service.planner.online import (
    STAND_IN,
    RecentLoad,
    engines_in,
    for_real,
    is_stand_in,
    pins,
    worth_adopting,
)
from planner_service.planner.operations import PRIORITY_RANK, Operation, apply_operation, apply_operations
from planner_service.planner.plan import Plan
from planner_service.planner.predictor import SwitchPredictor
from planner_service.planner.residency import ResidencyIndex
from planner_service.planner.srv import srv_entries
from planner_service.service import calibration
from planner_service.service import changes as edits
from planner_service.service.backoff import FailedMoves
from planner_service.service.errors import (
    Conflict,
    Forbidden,
    InvalidInput,
    NotFound,
    NotReady,
    SolverUnavailable,
)
from planner_service.service.inputs import (
    Event,
    HeartbeatIn,
    RegisterIn,
    ReportIn,
    RequestEvent,
    SessionEndEvent,
    ToolCallEndEvent,
    ToolCallStartEvent,
    TurnEndEvent,
)
from planner_service.service.questions import LiveView
from planner_service.service.records import FINAL_STATES, OpRecord, OpState, SessionState
from planner_service.service.store import FINAL_KEEP, Batch, Store, Stored
from planner_service.solver.registry import solve

log = logging.getLogger(__name__)

PREDICTOR_WINDOW_SECONDS = 3600.0
PRUNE_EVERY_SECONDS = 3600.0  # how often a running service forgets observations and event ids past their windows
GIB = 2**30
PLAN_ATTEMPTS = 4  # solves per replan before it yields to the agents whose operations keep moving the state


@dataclasses.dataclass(frozen=True)
class Usage:
    """What the online rules read of the sessions, copied under the lock for a plan made outside it."""

    now: float
    last_used: dict[str, float]  # model -> when a request or turn last ran on it
    stuck: set[str]  # models a request has waited for past the unpin delay
    waiting: set[str]  # models a request waits for, served nowhere
    pending: bool  # the current plan has operations not leased yet


def iso(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def placement_from_json(entries: list[dict[str, Any]]) -> Placement:
    return {
        (object_from_json(e["object"]), location_from_json(e["location"])): int(e["bytes"])
        for e in entries
        if int(e["bytes"]) > 0
    }


class ClusterService:
    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        *,
        lease_seconds: float = 30.0,
        event_retention_seconds: float = 7 * 86400.0,
        solver: str = "greedy",
        demand_window_seconds: float = 3600.0,
        demand_seats: int = 10,
        demand_min_requests: int = 1000,
        unpin_after_seconds: float = 60.0,
        failed_move_backoff_seconds: float = 30.0,
        failed_move_backoff_max_seconds: float = 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._lease_seconds = lease_seconds
        self._event_retention_seconds = event_retention_seconds
        self._solver = solver
        # the requests stand-in sessions stand for
        self._load = RecentLoad(demand_window_seconds, demand_seats, demand_min_requests)
        self._unpin_after_seconds = unpin_after_seconds
        self._last_used: dict[str, float] = {}  # model -> when a request or turn last ran on it
        self._clock = clock
        self._lock = threading.RLock()
        self._plan_lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []
        self.urgent = threading.Event()  # set when a request waits for a model served nowhere, or the plan broke
        self._force_replan = False
        self._failed_moves = FailedMoves(failed_move_backoff_seconds, failed_move_backoff_max_seconds)
        self._held_until: float | None = None  # when the first move the plan holds back may be queued again
        self._ready = False
        self.broken: str | None = None  # why the service stopped serving (a failed database write)
        self._topology_changes = 0  # hardware, catalog or registration edits: a plan made before is void
        self._base: dict[str, Any] = {}
        self._sessions: dict[str, SessionState] = {}
        self._event_ids: dict[str, float] = {}  # applied event id -> when (a resend within retention is ignored)
        self._pruned_at = float("-inf")
        self._placement: Placement = {}
        self._srv_version = 0
        self._srv_doc: dict[str, Any] = {}
        self._epoch = 0
        self._plan_doc: dict[str, Any] | None = None
        self._plan_placement: Placement = {}
        self._ops: dict[str, OpRecord] = {}
        self._open_ops: set[str] = set()  # queued or leased
        self._calibration: dict[str, dict[str, dict[str, dict[str, float]]]] = {"gpus": {}, "nodes": {}}
        self._nodes_info: dict[str, dict[str, Any]] = {}
        self._quarantine: list[dict[str, Any]] = []  # placement entries a start took out: they broke an invariant
        self._predictor = SwitchPredictor([])
        self._sizes: Problem | None = None  # the live problem without residency: sizes, capacities, bandwidths
        self._serving: set[str] = set()
        self.metrics_source_registered = False

    # -- lifecycle ---------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready

    def start(self, seed: Callable[[], Scenario]) -> bool:
        """Open the store; restore its state, or seed an empty one from `seed()`. True when seeded."""
        with self._lock:
            now = self._clock()
            self._store.open()
            self._prune(now)
            stored = self._store.load(now - self._observation_window())
            seeded = stored.empty
            if seeded:
                self._seed(seed(), now)
            else:
                self._restore(stored)
            self._ready = True
            return seeded

    def close(self) -> None:
        with self._lock:
            self._ready = False
            self._store.close()

    def status(self) -> dict[str, int | None]:
        with self._lock:
            ready = self._ready and self.broken is None and self._plan_doc is not None
            return {"epoch": self._epoch if ready else None, "srv_version": self._srv_version if ready else None}

    def add_listener(self, callback: Callable[[], None]) -> None:
        """`callback()` runs (from any thread) whenever the queues may have changed."""
        self._listeners.append(callback)

    def _notify(self) -> None:
        for callback in list(self._listeners):
            callback()

    def _require_ready(self) -> None:
        if self.broken is not None:
            raise NotReady(self.broken)
        if not self._ready:
            raise NotReady("the service is starting; retry shortly")

    def _write(self, batch: Batch) -> None:
        """Commit `batch`, or stop serving: memory already holds the change and the database does not, and
        only a restart, which restores the last committed state, makes them agree again."""
        try:
            self._store.write(batch)
        except Exception as error:  # noqa: BLE001 -- any failed write must stop serving, whatever raised it
            self.broken = (
                f"a database write failed ({error}); restart the service: it restores the last committed state"
            )
            log.critical("%s", self.broken)
            raise NotReady(self.broken) from None

    def _seed(self, scenario: Scenario, now: float) -> None:
        data = scenario.model_dump(mode="json")
        residency = data.pop("residency")
        data.pop("sessions")
        self._base = data
        for s in scenario.sessions:
            self._sessions[s.id] = SessionState(
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
        self._placement = placement_from_json(residency)
        self._predictor = self._new_predictor()
        self._publish_srv()
        batch = Batch(
            meta={
                "base": self._base,
                "placement": placement_to_json(self._placement),
                "srv": self._srv_doc,
                "epoch": 0,
                "calibration": self._calibration,
                "nodes": self._nodes_info,
            },
            sessions={s.id: s.to_json() for s in self._sessions.values()},
        )
        self._write(batch)
        log.info(
            "seeded an empty database: %d nodes, %d models, %d sessions",
            len(self._base["cluster"]["nodes"]),
            len(self._base["models"]),
            len(self._sessions),
        )

    def _restore(self, stored: Stored) -> None:
        meta = stored.meta
        self._base = meta["base"]
        self._placement = placement_from_json(meta.get("placement", []))
        self._srv_doc = meta["srv"]
        self._srv_version = int(self._srv_doc["version"])
        self._epoch = int(meta.get("epoch", 0))
        self._plan_doc = meta.get("plan")
        self._plan_placement = placement_from_json(self._plan_doc["placement"]) if self._plan_doc else {}
        # the failures that held moves back are not kept: the first replan queues them once more
        self._held_until = self._clock() if self._plan_doc and self._plan_doc.get("held_back") else None
        self._calibration = meta.get("calibration", {"gpus": {}, "nodes": {}})
        self._nodes_info = meta.get("nodes", {})
        self._quarantine = list(meta.get("quarantine", []))
        self._sessions = {k: SessionState.from_json(v) for k, v in stored.sessions.items()}
        self._event_ids = dict(stored.event_ids)
        self._ops = {k: OpRecord.from_json(v) for k, v in stored.operations.items()}
        self._open_ops = {k for k, r in self._ops.items() if r.state not in FINAL_STATES}
        self._predictor = self._new_predictor()
        for t, kind, a, b, gap, tokens in stored.observations:
            if kind == "handoff" and a in self._predictor.models and b in self._predictor.models:
                self._predictor.observe_handoff(t, a, b)
            elif kind == "gap" and gap is not None:
                self._predictor.observe_turn_gap(t, gap)
            elif kind == "request" and b is not None and tokens is not None:
                self._load.add(t, b, tokens)
        for session in self._sessions.values():
            last = self._last_used.get(session.model, session.last_activity)
            self._last_used[session.model] = max(last, session.last_activity)
        self._refresh_live()
        self._repair_placement()
        log.info(
            "restored from the database: srv version %d, plan epoch %d, %d sessions, %d events, %d open operations",
            self._srv_version,
            self._epoch,
            len(self._sessions),
            len(self._event_ids),
            len(self._open_ops),
        )

    def _repair_placement(self) -> None:
        """Bring a stored placement that breaks a physical invariant back within them, so that a start never
        fails on a database this service wrote: an object over its full size at a location keeps its full size,
        and a location over its capacity sheds what it can best lose (KV first, then what has a complete copy
        elsewhere on its node, the largest first). What was taken out is kept under `quarantine` and logged;
        the nodes' next reports and the plans after them rebuild it."""
        p = self._sizes
        assert p is not None
        removed: list[dict[str, Any]] = []

        def quarantine(obj: StateObject, loc: Location, nbytes: int, why: str) -> None:
            removed.append({"object": obj.to_json(), "location": loc.to_json(), "bytes": nbytes, "why": why})

        placement = dict(self._placement)
        live = self._valid_placement(placement)
        for (obj, loc), n in live.items():
            if obj.kind is not Kind.KV and n > p.size_of(obj):
                quarantine(obj, loc, n - p.size_of(obj), f"more than the full size {p.size_of(obj)}")
                placement[(obj, loc)] = p.size_of(obj)
        used: dict[Location, int] = defaultdict(int)
        for (_, loc), n in self._valid_placement(placement).items():
            used[loc] += n

        def complete_elsewhere(obj: StateObject, loc: Location) -> bool:
            node = p.node_of(loc)
            return any(
                o == obj
                and other != loc
                and p.node_of(other) == node
                and other.tier is not Tier.GPU
                and n >= p.size_of(o)
                for (o, other), n in placement.items()
            )

        for loc, total in sorted(used.items()):
            over = total - p.capacity_of(loc)
            if over <= 0:
                continue
            here = [(obj, n) for (obj, l), n in self._valid_placement(placement).items() if l == loc]
            here.sort(key=lambda e: (e[0].kind is not Kind.KV, not complete_elsewhere(e[0], loc), -e[1]))
            for obj, n in here:
                if over <= 0:
                    break
                quarantine(
                    obj, loc, n, f"{loc.label()} held {total} bytes, more than its capacity {p.capacity_of(loc)}"
                )
                del placement[(obj, loc)]
                over -= n
        if not removed:
            return
        for entry in removed:
            log.error("the stored placement broke an invariant; quarantined: %s", entry)
        self._placement = placement
        self._publish_srv()
        quarantined = [*self._quarantine, *removed]
        self._write(
            Batch(
                meta={
                    "placement": placement_to_json(self._placement),
                    "srv": self._srv_doc,
                    "quarantine": quarantined,
                }
            )
        )
        self._quarantine = quarantined
        self._force_replan = True

    def _new_predictor(self) -> SwitchPredictor:
        priors = PredictorIn.model_validate(self._base.get("predictor", {}))
        return SwitchPredictor([m["id"] for m in self._base["models"]], priors, window_seconds=PREDICTOR_WINDOW_SECONDS)

    # -- scenario views ----------------------------------------------------------

    def _scenario_data(self, residency: Placement, *, calibrated: bool = True) -> dict[str, Any]:
        """The live state as scenario JSON: base + sessions + `residency` (+ bandwidth calibration)."""
        data = copy.deepcopy(self._base)
        if calibrated:
            for node in data["cluster"]["nodes"]:
                node.update({k: v["value"] for k, v in self._calibration["nodes"].get(node["id"], {}).items()})
                for gpu in node.get("gpus", []):
                    gpu.update({k: v["value"] for k, v in self._calibration["gpus"].get(gpu["id"], {}).items()})
        models = {m["id"] for m in data["models"]}
        with_kv = {obj.session for obj, _ in residency if obj.kind is Kind.KV}
        sessions = [s for s in self._sessions.values() if s.model in models and (not s.ended or s.id in with_kv)]
        included = {s.id for s in sessions}
        data["sessions"] = [
            {
                "id": s.id,
                "user": s.user,
                "slo": s.slo.value,
                "model": s.model,
                "active": s.active and not s.ended,
                "context_tokens": s.context_tokens,
            }
            for s in sorted(sessions, key=lambda s: s.id)
        ]
        data["residency"] = [
            e
            for e in placement_to_json(residency)
            if e["object"]["model"] in models and (e["object"]["kind"] != "kv" or e["object"]["session"] in included)
        ]
        return data

    def _next_model(self, data: Mapping[str, Any], now: float) -> dict[str, dict[str, float]]:
        current = {
            s["id"]: s["model"]
            for s in data["sessions"]
            if not (s["id"] in self._sessions and self._sessions[s["id"]].ended)
        }
        return self._predictor.predict_sessions(current, now)

    def _compile(self, data: dict[str, Any], next_model: Mapping[str, Mapping[str, float]]) -> Problem:
        return compile_problem(parse_scenario(data), next_model)

    def _refresh_live(self) -> None:
        """Recompute sizes (sessions, calibration) and the served models from the confirmed placement."""
        data = self._scenario_data(self._placement)
        data["residency"] = []
        self._sizes = self._compile(data, {})
        self._serving = set(ResidencyIndex.build(self._sizes, self._valid_placement(self._placement)).serving)

    def _publish_srv(self) -> None:
        """Snapshot the SRV of the confirmed placement; `version` moves exactly when the snapshot does."""
        self._refresh_live()
        assert self._sizes is not None
        rows = srv_entries(self._sizes, self._valid_placement(self._placement))
        placement = placement_to_json(self._placement)
        if self._srv_doc and (rows, placement) == (self._srv_doc["srv"], self._srv_doc["placement"]):
            return
        self._srv_version = self._srv_version + 1 if self._srv_doc else 1
        self._srv_doc = {"version": self._srv_version, "srv": rows, "placement": placement}

    def _valid_placement(self, placement: Placement) -> Placement:
        p = self._sizes
        assert p is not None
        return {
            (obj, loc): n
            for (obj, loc), n in placement.items()
            if obj.model in p.models
            and (obj.kind is not Kind.KV or obj.session in p.sessions)
            and (loc.id in p.gpus if loc.tier is Tier.GPU else loc.id in p.nodes)
        }

    # -- planning ----------------------------------------------------------------

    def _inflight(self) -> list[OpRecord]:
        """The leased operations, in the order their plans meant them."""
        return sorted(
            (self._ops[i] for i in self._open_ops if self._ops[i].state is OpState.LEASED),
            key=lambda r: (r.epoch, r.seq),
        )

    def _planning_snapshot(
        self, *, stand_ins: bool = False
    ) -> tuple[dict[str, Any], dict[str, dict[str, float]], list[OpRecord]]:
        """Scenario JSON whose residency is the confirmed placement plus what leased operations will do
        (and, for the planning loop, whose sessions include stand-ins for the recent load)."""
        inflight = self._inflight()
        residency = apply_operations(self._placement, [r.op for r in inflight])
        data = self._scenario_data(residency)
        if stand_ins:
            data["sessions"] += self._stand_ins(data)
        return data, self._next_model(data, self._clock()), inflight

    def _stand_ins(self, data: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Stand-in active sessions for the recent load beyond the requests in flight (`online.RecentLoad`)."""
        models = {m["id"] for m in data["models"]}
        in_flight: dict[str, int] = defaultdict(int)
        for session in data["sessions"]:
            in_flight[session["model"]] += session["active"]
        return [
            {
                "id": s.id,
                "user": s.user,
                "slo": s.slo.value,
                "model": s.model,
                "active": True,
                "context_tokens": s.context_tokens,
            }
            for s in self._load.stand_ins(self._clock(), in_flight)
            if s.model in models
        ]

    def _usage(self) -> Usage:
        """When each model last ran, which wait past the unpin delay, which wait not served anywhere, and
        whether the current plan has operations not leased yet."""
        now = self._clock()
        waiting = [
            (s.model, now - s.waiting_since)
            for s in self._sessions.values()
            if s.active and s.waiting_since is not None
        ]
        return Usage(
            now,
            dict(self._last_used),
            {model for model, waited in waiting if waited > self._unpin_after_seconds},
            {model for model, _ in waiting if model not in self._serving},
            any(self._ops[i].state is OpState.QUEUED for i in self._open_ops),
        )

    @staticmethod
    def _pins(problem: Problem, usage: Usage) -> dict[str, dict[str, str]]:
        """The greedy's `nodes` and `precisions`: engines that served within the planning horizon stay where
        they are, unless a request has waited for its model past the unpin delay (`online.pins`)."""
        engines = engines_in(problem, usage.last_used)
        nodes, precisions = pins(engines, usage.stuck, usage.now, problem.constants.horizon_seconds)
        return {"nodes": nodes, "precisions": precisions}

    def _solve(self, problem: Problem, solver: str, **options: object) -> Plan:
        started = time.perf_counter()
        try:
            plan = solve(problem, solver, **options)
        except ImportError as error:
            raise SolverUnavailable(
                f"solver {solver!r} is not available in this build ({error}); use solver 'greedy'"
            ) from None
        self._metrics.plan_duration.labels(solver).observe(time.perf_counter() - started)
        return plan

    def replan(self, *, force: bool = False) -> dict[str, Any]:
        """Plan from the live state as the online rules say (`planner/online.py`: stand-ins for the recent
        load, pinned engines); install a new epoch when the target changed and is worth its moves, or
        when there is no plan yet (always when `force`)."""
        self._require_ready()
        with self._plan_lock:
            for _ in range(PLAN_ATTEMPTS):
                with self._lock:
                    self._expire_and_write()
                    data, next_model, _ = self._planning_snapshot(stand_ins=True)
                    usage = self._usage()
                    basis = self._basis()
                    held_due = self._held_until is not None and usage.now >= self._held_until
                    force = force or self._force_replan or held_due
                    self.urgent.clear()
                try:
                    problem = self._compile(data, next_model)
                except ScenarioError as error:
                    # the operations in flight would overfill a location: nothing may be planned on top of
                    # them (a plan from the confirmed placement alone would repeat their moves); they finish,
                    # fail or expire, and the replan that follows sees where they left the cluster
                    raise Conflict(f"the state in flight cannot be planned until it lands: {error}") from None
                try:
                    try:
                        # pins are the greedy's: the search and the MILP choose every node
                        pinned = self._pins(problem, usage) if self._solver == "greedy" else {}
                        plan = self._solve(problem, self._solver, **pinned)
                    except SolverUnavailable as error:
                        log.warning("%s; the planning loop falls back to greedy", error.message)
                        plan = self._solve(problem, "greedy", **self._pins(problem, usage))
                except ValueError as error:  # ScenarioError included: the live state itself cannot be planned
                    raise Conflict(f"the live state cannot be planned: {error}") from None
                adopt = worth_adopting(problem, plan, usage.waiting, pending=usage.pending)
                if not force and self._plan_doc is not None and not adopt:
                    self._metrics.replans.labels("kept").inc()
                    return {"epoch": self._epoch, "changed": False}  # staying put is the better deal
                plan = for_real(problem, plan)
                with self._lock:
                    if self._basis() != basis:
                        continue  # operations went in flight, landed elsewhere or failed while solving: again
                    if not force and self._plan_doc is not None and plan.placement == self._plan_placement:
                        self._metrics.replans.labels("unchanged").inc()
                        return {"epoch": self._epoch, "changed": False}
                    self._install(plan, self._inflight())  # the same landing place, maybe other operations
                    self._metrics.replans.labels("installed").inc()
                    self._force_replan = False
                    epoch = self._epoch
                break
            else:
                # never installed over a state it was not planned from: the planning loop tries again soon
                self._metrics.replans.labels("stale").inc()
                log.info("the state moved during each of %d solves; replanning after the debounce", PLAN_ATTEMPTS)
                self._wake(force=force)
                return {"epoch": self._epoch, "changed": False}
        self._notify()
        return {"epoch": epoch, "changed": True}

    def _wake(self, *, urgent: bool = False, force: bool = False) -> None:
        """Tell the planning loop to replan at once (after its debounce) when a request waits for a model
        served nowhere (`urgent`) or the plan broke (`force`); other changes wait for its periodic replan
        (`planner/online.py` says why)."""
        self._force_replan = self._force_replan or force
        if urgent or force:
            self.urgent.set()

    def _basis(self) -> tuple[frozenset[tuple[tuple[StateObject, Location], int]], int]:
        """What a plan is safe against: where the confirmed placement will be once the operations in flight
        land (an operation that lands changes nothing here; one leased, failed or expired since does), and
        the hardware and catalog. Sessions and demand may move on: the next replan catches up with them."""
        landing = apply_operations(self._placement, [r.op for r in self._inflight()])
        return frozenset(landing.items()), self._topology_changes

    def _install(self, plan: Plan, inflight: list[OpRecord]) -> None:
        now = self._clock()
        epoch = self._epoch + 1
        rename = {op.id: f"{epoch}.{op.id}" for op in plan.operations}
        held = self._failed_moves.hold_back(plan.operations, now)
        records: list[OpRecord] = []
        for seq, op in enumerate(plan.operations):
            if op.id in held:
                continue
            deps = [rename[d] for d in op.depends_on]
            for r in inflight:  # a new operation must not race one still in flight
                frees_dest = op.dest is not None and r.op.frees() == op.dest
                reads_its_output = op.source is not None and r.op.dest == op.source and r.op.object == op.object
                drops_its_source = (
                    op.frees() is not None
                    and r.op.keep_source
                    and r.op.source == op.frees()
                    and r.op.object == op.object
                )
                if frees_dest or reads_its_output or drops_its_source:
                    deps.append(r.id)
            new = dataclasses.replace(op, id=rename[op.id], depends_on=deps)
            records.append(OpRecord(new, epoch, seq, OpState.QUEUED, now, now))
        batch = Batch()
        for oid in list(self._open_ops):
            r = self._ops[oid]
            if r.state is OpState.QUEUED:
                r.state, r.superseded_by, r.updated_at = OpState.SUPERSEDED, epoch, now
                self._open_ops.discard(oid)
                batch.operations[oid] = r.to_json()
        for r in records:
            self._ops[r.id] = r
            self._open_ops.add(r.id)
            batch.operations[r.id] = r.to_json()
        doc = plan.to_json()
        doc["operations"] = [r.op.to_json() for r in records]
        doc["held_back"] = [
            {
                "operation": dataclasses.replace(
                    op, id=rename[op.id], depends_on=[rename[d] for d in op.depends_on]
                ).to_json(),
                "until": iso(held[op.id].until),
                "failures": held[op.id].count,
                "error": held[op.id].error,
            }
            for op in plan.operations
            if op.id in held
        ]
        self._held_until = min((f.until for f in held.values()), default=None)
        doc["epoch"] = epoch
        doc["planned_at"] = iso(now)
        doc["based_on_srv_version"] = self._srv_version
        batch.meta.update({"epoch": epoch, "plan": doc})
        self._write(batch)
        self._epoch, self._plan_doc, self._plan_placement = epoch, doc, dict(plan.placement)
        log.info(
            "plan epoch %d: %s, %d operations, %d unserved", epoch, doc["status"], len(records), len(plan.unserved)
        )

    # -- leases ------------------------------------------------------------------

    def _expire(self, batch: Batch) -> bool:
        now = self._clock()
        expired_leases: dict[str, str] = {}
        for oid in list(self._open_ops):
            r = self._ops[oid]
            if r.state is OpState.LEASED and r.lease_expires_at is not None and r.lease_expires_at <= now:
                expired_leases[r.lease_id or ""] = r.node
                if r.epoch < self._epoch:
                    r.state, r.superseded_by = OpState.SUPERSEDED, self._epoch
                    self._open_ops.discard(oid)
                    self._wake(force=True)
                else:
                    r.state = OpState.QUEUED
                r.lease_id, r.lease_expires_at, r.updated_at = None, None, now
                batch.operations[oid] = r.to_json()
        for node in expired_leases.values():
            self._metrics.lease_expiries.labels(node).inc()
        if expired_leases:
            log.info("%d lease(s) expired; their operations were re-queued", len(expired_leases))
        return bool(expired_leases)

    def _expire_and_write(self) -> bool:
        batch = Batch()
        expired = self._expire(batch)
        self._write(batch)
        return expired

    def tick(self) -> None:
        """Expire leases, and hourly forget what left its window (the planning loop calls this about every
        second)."""
        if not self._ready or self.broken is not None:
            return
        with self._lock:
            expired = self._expire_and_write()
            now = self._clock()
            if now - self._pruned_at >= PRUNE_EVERY_SECONDS:
                self._prune(now)
        if expired:
            self._notify()

    def _observation_window(self) -> float:
        return max(PREDICTOR_WINDOW_SECONDS, self._load.max_window_seconds)

    def _prune(self, now: float) -> None:
        """Forget observations older than their window, event ids past their retention and all but the newest
        finished operations, in the store and here, so that a long-running service holds a bounded state."""
        retained_from = now - self._event_retention_seconds
        self._store.prune(now - self._observation_window(), retained_from)
        self._event_ids = {event_id: at for event_id, at in self._event_ids.items() if at >= retained_from}
        finished = sorted((r for r in self._ops.values() if r.state in FINAL_STATES), key=lambda r: (r.epoch, r.seq))
        for r in finished[: max(0, len(finished) - FINAL_KEEP)]:  # the newest stay, as in the store
            del self._ops[r.id]
        self._pruned_at = now

    def _deps_done(self, r: OpRecord) -> bool:
        return all(d not in self._ops or self._ops[d].state is OpState.DONE for d in r.op.depends_on)

    def _require_node(self, node_id: str) -> None:
        nodes = [n["id"] for n in self._base["cluster"]["nodes"]]
        if node_id not in nodes:
            raise NotFound(f"unknown node {node_id!r}; known: {sorted(nodes)}")

    def lease(self, node_id: str, max_operations: int) -> dict[str, Any]:
        """Lease up to `max_operations` of the node's queued operations whose dependencies are done."""
        self._require_ready()
        with self._lock:
            self._require_node(node_id)
            now = self._clock()
            batch = Batch()
            expired = self._expire(batch)
            eligible = sorted(
                (
                    self._ops[i]
                    for i in self._open_ops
                    if self._ops[i].state is OpState.QUEUED
                    and self._ops[i].node == node_id
                    and self._deps_done(self._ops[i])
                ),
                key=lambda r: (PRIORITY_RANK[r.op.priority], r.epoch, r.seq),
            )[:max_operations]
            lease_id = expires = None
            if eligible:
                lease_id, expires = uuid.uuid4().hex, now + self._lease_seconds
                for r in eligible:
                    r.state, r.lease_id, r.lease_expires_at, r.updated_at = OpState.LEASED, lease_id, expires, now
                    r.leases += 1
                    batch.operations[r.id] = r.to_json()
            self._write(batch)
        if expired:
            self._notify()
        return {
            "lease_id": lease_id,
            "expires_at": iso(expires),
            "expires_in_seconds": self._lease_seconds if lease_id else None,
            "operations": [{**r.op.to_json(), "epoch": r.epoch} for r in eligible],
        }

    def report(self, op_id: str, body: ReportIn, *, node_scope: str | None = None) -> dict[str, Any]:
        """A node's outcome for a leased operation. Idempotent: the same report again answers the same."""
        self._require_ready()
        with self._lock:
            self._expire_and_write()
            r = self._ops.get(op_id)
            if r is None:
                raise NotFound(f"unknown operation {op_id!r}")
            if node_scope is not None and r.node != node_scope:
                raise Forbidden(f"operation {op_id} belongs to node {r.node!r}, not to {node_scope!r}")
            if r.state in (OpState.DONE, OpState.FAILED):
                if r.lease_id == body.lease_id and r.state.value == body.status:
                    return {"operation": r.to_json(), "srv_version": self._srv_version, "duplicate": True}
                raise Conflict(f"operation {op_id} is already {r.state.value} under another report")
            if r.state is OpState.SUPERSEDED:
                raise Conflict(
                    f"operation {op_id} was superseded by plan epoch {r.superseded_by}; lease the node's queue again"
                )
            if r.state is OpState.QUEUED:
                raise Conflict(
                    f"operation {op_id} is not leased (its lease expired and it was re-queued); lease it again"
                )
            if r.lease_id != body.lease_id:
                raise Conflict(f"operation {op_id} is held by another lease, not {body.lease_id!r}")
            now = self._clock()
            r.state = OpState.DONE if body.status == "done" else OpState.FAILED
            r.measured_seconds, r.measured_bytes, r.error, r.updated_at = (
                body.measured_seconds,
                body.measured_bytes,
                body.error,
                now,
            )
            self._open_ops.discard(op_id)
            batch = Batch(operations={op_id: r.to_json()})
            if r.state is OpState.DONE:
                self._failed_moves.succeeded(r.op)
                self._confirm(r, now, batch)
            else:
                failures = self._failed_moves.failed(r.op, now, body.error)
                self._wake(force=True)  # the next plan holds the move back until then
                log.warning(
                    "operation %s failed on %s (%d time(s); held back until %s): %s",
                    op_id,
                    r.node,
                    failures.count,
                    iso(failures.until),
                    body.error,
                )
            self._write(batch)
            if body.measured_seconds is not None:
                self._metrics.operation_duration.labels(r.op.action.value, r.state.value).observe(body.measured_seconds)
            out = {"operation": r.to_json(), "srv_version": self._srv_version, "duplicate": False}
        self._notify()
        return out

    def _confirm(self, r: OpRecord, now: float, batch: Batch) -> None:
        """Apply a done operation to the confirmed placement and learn from its measured duration."""
        op = r.op
        self._refresh_live()  # sizes must know the sessions that events created since
        touched = {(op.object, loc): 1 for loc in (op.source, op.dest) if loc is not None}
        if len(self._valid_placement(touched)) != len(touched):
            log.warning("operation %s refers to state or hardware no longer in the cluster; placement unchanged", r.id)
        elif (conflict := self._landing_conflict(op)) is not None:
            # the node says it did what the confirmed state says cannot be: trust neither, plan again from what
            # is known, and let the node's next report of its memory settle who was right
            r.conflict = conflict
            self._metrics.report_conflicts.labels(r.node).inc()
            self._wake(force=True)
            log.error("operation %s reported done but not applied: %s", r.id, conflict)
        else:
            apply_operation(self._placement, op)
        self._purge_ended_sessions(batch)
        self._publish_srv()
        self._calibrate_from(r, batch)
        for s in self._sessions.values():
            if s.waiting_since is not None and s.model in self._serving:
                self._observe_switch(s, now - s.waiting_since)
                s.waiting_since = None
                batch.sessions[s.id] = s.to_json()
        batch.meta.update({"placement": placement_to_json(self._placement), "srv": self._srv_doc})

    def _landing_conflict(self, op: Operation) -> str | None:
        """Why applying `op` to the confirmed placement would break a physical invariant, if it would: the
        source must hold what it gives, the destination must have room, and no location may hold more of
        weights or experts than their full size."""
        p = self._sizes
        assert p is not None
        if op.source is not None and (held := self._placement.get((op.object, op.source), 0)) < op.bytes:
            return f"{op.source.label()} holds {held} bytes of {op.object.label()}, not the {op.bytes} it gives"
        if op.dest is None:
            return None
        after = self._placement.get((op.object, op.dest), 0) + op.bytes
        if op.object.kind is not Kind.KV and after > p.size_of(op.object):
            return f"{op.dest.label()} would hold {after} bytes of {op.object.label()}, more than its {p.size_of(op.object)}"
        used = sum(n for (_, loc), n in self._placement.items() if loc == op.dest) + op.bytes
        if used > p.capacity_of(op.dest):
            return f"{op.dest.label()} would hold {used} bytes, more than its capacity {p.capacity_of(op.dest)}"
        return None

    def _purge_ended_sessions(self, batch: Batch) -> None:
        with_kv = {obj.session for obj, _ in self._placement if obj.kind is Kind.KV}
        busy = {self._ops[i].op.object.session for i in self._open_ops if self._ops[i].op.object.kind is Kind.KV}
        for sid in [s.id for s in self._sessions.values() if s.ended and s.id not in with_kv | busy]:
            del self._sessions[sid]
            batch.sessions[sid] = None

    def _observe_switch(self, s: SessionState, seconds: float) -> None:
        self._metrics.switch_latency.labels(s.slo.value).observe(seconds)
        targets = self._sizes.constants.slo_targets_seconds if self._sizes else None
        if targets is not None and seconds > targets.of(s.slo):
            self._metrics.slo_violations.labels(s.slo.value).inc()

    # -- calibration -------------------------------------------------------------

    def _calibrate_from(self, r: OpRecord, batch: Batch) -> None:
        """A measured copy is a sample of the bandwidth of the link it crossed."""
        op, seconds = r.op, r.measured_seconds
        if not seconds or seconds <= 0 or op.source is None or op.dest is None:
            return
        link = calibration.link_of(op.source, op.dest)
        nbytes = r.measured_bytes if r.measured_bytes else op.bytes
        if link is not None:
            self._calibrate(link, nbytes / seconds, calibration.Copy(op.bytes, nbytes), batch, r.id)

    def _calibrate(
        self, link: calibration.Link, rate: float, copied: calibration.Copy | None, batch: Batch, source: str
    ) -> None:
        """Fold one bandwidth sample into the link's estimate, unless `calibration.refusal` says no."""
        assert self._sizes is not None
        specs = self._sizes.nodes if link.scope == "nodes" else self._sizes.gpus
        if link.key not in specs:
            return
        entries = self._calibration[link.scope].setdefault(link.key, {})
        entry = entries.get(link.field)
        estimate = float(getattr(specs[link.key], link.field))  # the calibrated value where an entry exists
        catalog = float(entry.get("catalog", estimate)) if entry is not None else estimate
        folded, why = calibration.fold(entry, catalog, estimate, rate, copied)
        self._metrics.calibration_samples.labels("refused" if why else "accepted").inc()
        if why is not None:
            log.warning("calibration of %s %s: the sample from %s is refused: %s", link.key, link.field, source, why)
        if folded is not None and folded is not entry:
            entries[link.field] = {**folded, "catalog": catalog}
        batch.meta["calibration"] = self._calibration

    # -- events ------------------------------------------------------------------

    def apply_events(self, events: list[Event]) -> dict[str, Any]:
        """Apply a batch atomically: all new events apply, or none when one refers to something unknown."""
        self._require_ready()
        with self._lock:
            models = sorted(m["id"] for m in self._base["models"])
            known_sessions = {sid for sid, s in self._sessions.items()}
            seen: set[str] = set()
            for i, ev in enumerate(events):
                if ev.id in self._event_ids or ev.id in seen:
                    continue
                seen.add(ev.id)
                if is_stand_in(ev.session):
                    raise InvalidInput(
                        f"events[{i}].session: ids beginning with {STAND_IN!r} are reserved for the planner's "
                        "stand-in sessions",
                        field=f"events.{i}.session",
                    )
                if isinstance(ev, RequestEvent):
                    if ev.model not in models:
                        raise InvalidInput(
                            f"events[{i}].model: unknown model {ev.model!r}; known: {models}", field=f"events.{i}.model"
                        )
                    known_sessions.add(ev.session)
                elif ev.session not in known_sessions:
                    raise InvalidInput(
                        f"events[{i}].session: unknown session {ev.session!r}; a session starts with a request event",
                        field=f"events.{i}.session",
                    )
            now = self._clock()
            batch = Batch()
            results = []
            for ev in events:
                if ev.id in self._event_ids:
                    results.append({"id": ev.id, "status": "duplicate"})
                    continue
                self._apply_event(ev, ev.at if ev.at is not None else now, batch)
                self._event_ids[ev.id] = now
                batch.events.append((ev.id, ev.type, now))
                results.append({"id": ev.id, "status": "applied"})
            self._purge_ended_sessions(batch)
            self._write(batch)
            applied = [ev for ev, res in zip(events, results, strict=True) if res["status"] == "applied"]
            for ev in applied:
                self._metrics.events.labels(ev.type).inc()
            if applied:
                self._wake(urgent=any(isinstance(ev, RequestEvent) and ev.model not in self._serving for ev in applied))
        return {
            "applied": len(applied),
            "duplicates": len(events) - len(applied),
            "results": results,
        }

    def _apply_event(self, ev: Event, t: float, batch: Batch) -> None:
        s = self._sessions.get(ev.session)
        if isinstance(ev, RequestEvent):
            if s is None:
                s = SessionState(
                    id=ev.session,
                    user=ev.user or "default",
                    slo=ev.slo or Slo.INTERACTIVE,
                    model=ev.model,
                    created_at=t,
                )
                self._sessions[s.id] = s
            else:
                self._predictor.observe_handoff(t, s.model, ev.model)
                batch.observations.append((t, "handoff", s.model, ev.model, None, None))
                if s.last_turn_end is not None and t >= s.last_turn_end:
                    self._predictor.observe_turn_gap(t, t - s.last_turn_end)
                    batch.observations.append((t, "gap", None, None, t - s.last_turn_end, None))
            s.model, s.active, s.ended = ev.model, True, False
            s.user = ev.user or s.user
            s.slo = ev.slo or s.slo
            s.requests += 1
            s.context_tokens += ev.input_tokens + ev.output_tokens
            s.cached_tokens[ev.model] = s.context_tokens
            self._load.add(t, ev.model, s.context_tokens)
            batch.observations.append((t, "request", None, ev.model, None, s.context_tokens))
            if ev.model in self._serving:
                self._observe_switch(s, 0.0)
                s.waiting_since = None
            else:
                s.waiting_since = t
        else:
            assert s is not None
            if isinstance(ev, TurnEndEvent):
                s.active, s.in_tool_call, s.last_turn_end = False, False, t
                s.context_tokens += ev.output_tokens
                s.cached_tokens[s.model] = s.context_tokens
            elif isinstance(ev, ToolCallStartEvent):
                s.in_tool_call = True
                s.tool_calls += 1
            elif isinstance(ev, ToolCallEndEvent):
                s.in_tool_call = False
            elif isinstance(ev, SessionEndEvent):
                s.active, s.in_tool_call, s.ended, s.waiting_since = False, False, True, None
        s.last_activity = t
        if isinstance(ev, (RequestEvent, TurnEndEvent)):
            self._last_used[s.model] = max(self._last_used.get(s.model, t), t)
        batch.sessions[s.id] = s.to_json()

    # -- topology and catalog ----------------------------------------------------

    def _admin_edit(self, edit: Callable[[dict[str, Any]], None]) -> None:
        """Apply an operator's edit to the live scenario; state at removed hardware or models is forgotten."""
        data = self._scenario_data(self._placement, calibrated=False)
        before = {s["id"] for s in data["sessions"]}
        try:
            edit(data)
            scenario = parse_scenario(data)
            problem = compile_problem(scenario, {})
        except (edits.ChangeError, ScenarioError) as error:
            raise InvalidInput(str(error)) from None
        new = scenario.model_dump(mode="json")
        self._base = {k: new[k] for k in ("cluster", "models", "predictor", "constants")}
        batch = Batch(meta={"base": self._base, "calibration": self._calibration})
        for sid in before - {s.id for s in scenario.sessions}:
            self._sessions.pop(sid, None)
            batch.sessions[sid] = None
        placement = dict(problem.residency)
        for model in [m.id for m in scenario.models]:
            self._predictor.add_model(model)
        for model in set(self._predictor.models) - {m.id for m in scenario.models}:
            self._predictor.remove_model(model)
        self._placement = placement
        self._publish_srv()
        batch.meta.update({"placement": placement_to_json(self._placement), "srv": self._srv_doc})
        self._write(batch)
        self._topology_changes += 1
        self._wake(force=True)

    def put_cluster(self, cluster: ClusterIn) -> dict[str, Any]:
        self._require_ready()
        with self._lock:
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
                self._calibration[scope].get(key, {}).pop(field, None)
            self._admin_edit(lambda data: edits.replace_cluster(data, cluster))
            return self.cluster_view()

    def put_model(
        self, model_id: str, spec: dict[str, Any], nvme_nodes: list[str] | None
    ) -> tuple[dict[str, Any], bool]:
        self._require_ready()
        if "id" in spec and spec["id"] != model_id:
            raise InvalidInput(f"model.id: {spec['id']!r} differs from the path's {model_id!r}", field="model.id")
        try:
            model = ModelIn.model_validate({**spec, "id": model_id})
        except ValueError as error:
            raise InvalidInput(f"model: {error}", field="model") from None
        with self._lock:
            created = model_id not in {m["id"] for m in self._base["models"]}
            self._admin_edit(lambda data: edits.put_model(data, model, nvme_nodes, "model"))
            return self._model_view(model_id), created

    def delete_model(self, model_id: str) -> None:
        self._require_ready()
        with self._lock:
            if model_id not in {m["id"] for m in self._base["models"]}:
                raise NotFound(f"unknown model {model_id!r}; known: {sorted(m['id'] for m in self._base['models'])}")
            self._admin_edit(lambda data: edits.remove_model(data, model_id, "model"))

    # -- nodes -------------------------------------------------------------------

    def register_node(self, node_id: str, body: RegisterIn) -> dict[str, Any]:
        self._require_ready()
        with self._lock:
            self._require_node(node_id)
            now = self._clock()
            node = next(n for n in self._base["cluster"]["nodes"] if n["id"] == node_id)
            known = {g["id"]: g for g in node.get("gpus", [])}
            warnings = []
            seen = {g.id for g in body.gpus}
            for i, g in enumerate(body.gpus):
                if g.id not in known:
                    warnings.append(f"gpus[{i}].id: {g.id!r} is not in the cluster topology; PUT /v1/cluster to add it")
                elif g.type and known[g.id].get("type") and g.type != known[g.id]["type"]:
                    warnings.append(f"gpus[{i}].type: {g.type!r}, the topology says {known[g.id]['type']!r}")
            if body.gpus:
                warnings += [f"gpu {gid!r} of the topology was not reported" for gid in sorted(set(known) - seen)]
            engines = self._node_engines(body, set(known))
            batch = Batch()
            changed = False
            if body.capabilities is not None and sorted(body.capabilities) != sorted(node.get("capabilities", [])):
                node["capabilities"] = [c.value for c in body.capabilities]
                changed = True
            if engines != node.get("engines"):
                node["engines"] = engines
                changed = True
            if changed:
                batch.meta["base"] = self._base
                self._topology_changes += 1
                self._wake(force=True)
            info = self._nodes_info.setdefault(node_id, {})
            info["registration"] = body.model_dump(mode="json")
            info["registered_at"] = iso(now)
            batch.meta["nodes"] = self._nodes_info
            self._write(batch)
            return {
                "node": node_id,
                "registered_at": iso(now),
                "capabilities": node.get("capabilities", []),
                "engines": node.get("engines"),
                "gpus": sorted(known),
                "lease_seconds": self._lease_seconds,
                "warnings": warnings,
            }

    def _node_engines(self, body: RegisterIn, node_gpus: set[str]) -> list[dict[str, Any]] | None:
        """The node's `engines` from a registration, checked: an entry per model its engines serve, with the
        GPUs of an engine launched on fixed ones; None where no engine names a model (any model, any group)."""
        models = {m["id"] for m in self._base["models"]}
        out: dict[str, dict[str, Any]] = {}
        for i, engine in enumerate(body.engines):
            for j, gpu in enumerate(engine.gpus):
                if gpu not in node_gpus:
                    raise InvalidInput(
                        f"engines[{i}].gpus[{j}]: {gpu!r} is not a GPU of this node; its GPUs: {sorted(node_gpus)}",
                        field=f"engines.{i}.gpus.{j}",
                    )
            if len(set(engine.gpus)) != len(engine.gpus):
                raise InvalidInput(f"engines[{i}].gpus: a GPU is named twice", field=f"engines.{i}.gpus")
            for j, model in enumerate(engine.models):
                if model not in models:
                    raise InvalidInput(
                        f"engines[{i}].models[{j}]: unknown model {model!r}; known: {sorted(models)}",
                        field=f"engines.{i}.models.{j}",
                    )
                if model in out and out[model]["gpus"] != sorted(engine.gpus):
                    raise InvalidInput(
                        f"engines[{i}].models[{j}]: {model!r} has another engine here, on {out[model]['gpus'] or 'any GPUs'}; "
                        "the planner serves a model from one group per node",
                        field=f"engines.{i}.models.{j}",
                    )
                out[model] = {"model": model, "gpus": sorted(engine.gpus)}
        return [out[m] for m in sorted(out)] if out else None

    def heartbeat(self, node_id: str, body: HeartbeatIn) -> dict[str, Any]:
        self._require_ready()
        with self._lock:
            self._require_node(node_id)
            assert self._sizes is not None
            node_gpus = set(self._sizes.nodes[node_id].gpus)
            for i, g in enumerate(body.gpus):
                if g.id not in node_gpus:
                    raise InvalidInput(
                        f"gpus[{i}].id: {g.id!r} is not a GPU of node {node_id!r}; its GPUs: {sorted(node_gpus)}",
                        field=f"gpus.{i}.id",
                    )
            unknown_models = sorted(set(body.expert_hit_rates) - set(self._sizes.models))
            if unknown_models:
                raise InvalidInput(
                    f"expert_hit_rates: unknown model(s) {unknown_models}; known: {sorted(self._sizes.models)}",
                    field="expert_hit_rates",
                )
            now = self._clock()
            batch = Batch()
            heard = f"the heartbeat of {node_id}"
            for g in body.gpus:
                for field in calibration.GPU_FIELDS:
                    if getattr(g, field) is not None:
                        self._calibrate(calibration.Link("gpus", g.id, field), getattr(g, field), None, batch, heard)
            for field in calibration.NODE_FIELDS:
                if getattr(body, field) is not None:
                    self._calibrate(calibration.Link("nodes", node_id, field), getattr(body, field), None, batch, heard)
            info = self._nodes_info.setdefault(node_id, {})
            info["telemetry"] = body.model_dump(mode="json")
            info["last_heartbeat"] = iso(now)
            batch.meta["nodes"] = self._nodes_info
            self._write(batch)
            return {
                "node": node_id,
                "received_at": iso(now),
                "calibration": self._calibration["nodes"].get(node_id, {}),
            }

    # -- reads -------------------------------------------------------------------

    def cluster_view(self) -> dict[str, Any]:
        self._require_ready()
        with self._lock:
            data = self._scenario_data({})
            problem = self._compile(data, {})
            used: dict[str, int] = defaultdict(int)
            planned: dict[str, int] = defaultdict(int)
            for (_, loc), n in self._placement.items():
                if loc.tier is Tier.GPU:
                    used[loc.id] += n
            for (_, loc), n in self._plan_placement.items():
                if loc.tier is Tier.GPU:
                    planned[loc.id] += n
            nodes = []
            for raw in self._base["cluster"]["nodes"]:
                n = problem.nodes[raw["id"]]
                info = self._nodes_info.get(n.id, {})
                gpus = []
                for graw in raw.get("gpus", []):
                    g = problem.gpus[graw["id"]]
                    gpus.append(
                        {
                            "id": g.id,
                            "type": g.type,
                            "capacity_bytes": g.capacity_bytes,
                            "reserved_bytes": graw.get("reserved_bytes", 0),
                            "hbm_bytes_per_s": g.hbm_bytes_per_s,
                            "bf16_flops": g.bf16_flops,
                            "h2d_bytes_per_s": g.h2d_bytes_per_s,
                            "d2h_bytes_per_s": g.d2h_bytes_per_s,
                            "used_bytes": used[g.id],
                            "planned_bytes": planned[g.id],
                            "calibrated": self._calibration["gpus"].get(g.id, {}),
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
                        "engines": raw.get("engines"),
                        "calibrated": self._calibration["nodes"].get(n.id, {}),
                        "registered_at": info.get("registered_at"),
                        "last_heartbeat": info.get("last_heartbeat"),
                        "telemetry": info.get("telemetry"),
                        "gpus": gpus,
                    }
                )
            return {"nodes": nodes, "quarantine": copy.deepcopy(self._quarantine)}

    def _model_view(self, model_id: str) -> dict[str, Any]:
        raw = next(m for m in self._base["models"] if m["id"] == model_id)
        spec = resolve_model(ModelIn.model_validate(raw), "model")
        return {
            **{k: v for k, v in raw.items() if v is not None},
            "resolved": {
                "precisions": list(spec.precisions),
                "weights_bytes": dict(spec.weights_bytes),
                "kv_bytes_per_token": spec.kv_bytes_per_token,
                "experts_bytes": spec.experts_bytes,
                "expert_bytes": spec.expert_bytes,
                "is_moe": spec.is_moe,
                "active_params": spec.active_params,
            },
            "serving": model_id in self._serving,
        }

    def models_view(self) -> list[dict[str, Any]]:
        self._require_ready()
        with self._lock:
            return [self._model_view(m["id"]) for m in self._base["models"]]

    def _session_view(self, s: SessionState) -> dict[str, Any]:
        kv: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for (obj, loc), n in self._placement.items():
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
        self._require_ready()
        with self._lock:
            return [self._session_view(s) for _, s in sorted(self._sessions.items())]

    def session_view(self, session_id: str) -> dict[str, Any]:
        self._require_ready()
        with self._lock:
            if session_id not in self._sessions:
                raise NotFound(f"unknown session {session_id!r}")
            return self._session_view(self._sessions[session_id])

    def srv_view(self) -> dict[str, Any]:
        self._require_ready()
        with self._lock:
            return copy.deepcopy(self._srv_doc)

    def plan_view(self) -> dict[str, Any]:
        self._require_ready()
        with self._lock:
            if self._plan_doc is None:
                raise NotFound("no plan yet; POST /v1/plan to plan now")
            return copy.deepcopy(self._plan_doc)

    def operations_view(self, node: str | None = None, state: str | None = None) -> list[dict[str, Any]]:
        self._require_ready()
        with self._lock:
            if node is not None:
                self._require_node(node)
            batch = Batch()
            self._expire(batch)
            self._write(batch)
            ids = self._open_ops if state in (None, "queued", "leased") else self._ops.keys()
            rows = [self._ops[i] for i in ids]
            return [
                r.to_json()
                for r in sorted(rows, key=lambda r: (r.epoch, r.seq))
                if (node is None or r.node == node) and (state is None or r.state.value == state)
            ]

    def metrics_snapshot(self) -> StateSnapshot:
        snap = StateSnapshot()
        with self._lock:
            if not self._ready or self._sizes is None:
                return snap
            for (obj, loc), n in self._placement.items():
                key = (obj.model, obj.kind.value, loc.tier.value)
                snap.resident_bytes[key] = snap.resident_bytes.get(key, 0) + n
            for g in self._sizes.gpus.values():
                snap.gpu_capacity_bytes[(g.node, g.id)] = g.capacity_bytes
                snap.gpu_used_bytes[(g.node, g.id)] = 0
            for (_, loc), n in self._placement.items():
                if loc.tier is Tier.GPU and loc.id in self._sizes.gpus:
                    snap.gpu_used_bytes[(self._sizes.gpus[loc.id].node, loc.id)] += n
            for i in self._open_ops:
                r = self._ops[i]
                key = (r.node, r.op.priority.value, r.state.value)
                snap.queue[key] = snap.queue.get(key, 0) + 1
            if self._plan_doc is not None:
                for held in self._plan_doc.get("held_back", []):
                    key = (held["operation"]["node"], held["operation"]["priority"], "held_back")
                    snap.queue[key] = snap.queue.get(key, 0) + 1
                snap.predicted_p95_seconds = float(self._plan_doc["predicted"]["switch_latency_p95_seconds"])
                snap.unserved_sessions = len(self._plan_doc["unserved"])
            snap.plan_epoch = self._epoch
        return snap

    # -- questions ---------------------------------------------------------------

    def live_view(self) -> LiveView:
        """A consistent copy of what questions about the live state need (what-if, Pareto, explain)."""
        self._require_ready()
        with self._lock:
            assert self._sizes is not None
            data, next_model, _ = self._planning_snapshot()
            return LiveView(
                data=data,
                next_model=next_model,
                predictor=copy.deepcopy(self._predictor),
                ended=frozenset(sid for sid, s in self._sessions.items() if s.ended),
                now=self._clock(),
                epoch=self._epoch,
                srv_version=self._srv_version,
                plan_doc=copy.deepcopy(self._plan_doc),
                sizes=self._sizes,
                placement=dict(self._placement),
                plan_placement=dict(self._plan_placement),
                plan_ops=[
                    copy.deepcopy(r) for r in self._ops.values() if r.epoch == self._epoch or r.id in self._open_ops
                ],
                sessions={sid: copy.deepcopy(s) for sid, s in self._sessions.items()},
            )

    def solve(self, problem: Problem, solver: str, **options: object) -> Plan:
        """Solve and time one problem (the planning-duration histogram counts it)."""
        return self._solve(problem, solver, **options)
