"""The service's live state and what every part of it shares: the lock, the store, the clock, the
derived sizes of the live problem and the SRV published from the confirmed placement."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from planner_service.domain.problem import Problem, Session, compile_problem, with_state
from planner_service.domain.scenario import NodeIn, ResidencyIn, Scenario, SessionIn
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
from planner_service.metrics import Metrics
from planner_service.planner.online import (
    RecentLoad,
)
from planner_service.planner.predictor import SwitchPredictor
from planner_service.planner.residency import ResidencyIndex
from planner_service.planner.srv import srv_rows
from planner_service.service.backoff import FailedMoves
from planner_service.service.calibration import Calibration
from planner_service.service.errors import NotFound, NotReady, ServiceError
from planner_service.service.inputs import EngineInstanceStateIn
from planner_service.service.nodes import NodeRecord, nodes_to_json
from planner_service.service.published import InstalledPlan, PublishedSrv
from planner_service.service.records import FINAL_STATES, OpenOps, OpRecord, OpState, Quarantined, SessionState
from planner_service.service.state_lock import StateLock, Urgency
from planner_service.service.store import FINAL_KEEP, Batch, Store
from planner_service.settings import Settings
from planner_service.wire.enums import EngineState

log = logging.getLogger(__name__)


PREDICTOR_WINDOW_SECONDS = 3600.0
ASLEEP_STATES = frozenset({EngineState.ASLEEP_HOST, EngineState.ASLEEP_DISCARDED})
LAUNCHED_STATES = ASLEEP_STATES | {EngineState.RUNNING}
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
    rates: dict[str, float] = dataclasses.field(default_factory=dict)  # model -> requests/s over the demand window


def iso(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def placement_from_json(entries: list[dict[str, Any]]) -> Placement:
    return {
        (object_from_json(e["object"]), location_from_json(e["location"])): int(e["bytes"])
        for e in entries
        if int(e["bytes"]) > 0
    }


@dataclasses.dataclass(frozen=True)
class LiveState:
    """A live problem's parts, copied under the lock and immutable, so that it is built outside the lock."""

    catalog: Problem  # the compiled cluster and catalog, with calibrated bandwidths
    scenario: Scenario  # what `catalog` was compiled from (its sessions and residency empty)
    sessions: tuple[Session, ...]
    residency: Placement
    # (node, model) -> the KV pool per GPU its running or sleeping engine reports (`Live.engine_pools`)
    engine_pools: Mapping[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    # (node, model) -> the state and GPU group of its sleeping engine, as reported (`Live.observed_engines`)
    observed_engines: Mapping[tuple[str, str], tuple[EngineState, tuple[str, ...]]] = dataclasses.field(
        default_factory=dict
    )
    # (node, model) -> the GPU expert share its sleeping MoE engine was launched with (`Live.observed_engines`)
    asleep_expert_fractions: Mapping[tuple[str, str], float] = dataclasses.field(default_factory=dict)

    def problem(self, next_model: Mapping[str, Mapping[str, float]]) -> Problem:
        """Raises `ScenarioError` when the residency overfills a location."""
        problem = with_state(self.catalog, self.sessions, self.residency, next_model)
        if not (self.engine_pools or self.observed_engines):
            return problem
        return dataclasses.replace(
            problem,
            engine_pools=self.engine_pools,
            observed_engines=self.observed_engines,
            asleep_expert_fractions=self.asleep_expert_fractions,
        )

    def full_scenario(self) -> Scenario:
        """The typed scenario with the sessions and the residency: what a what-if edits."""
        return scenario_with(self.scenario, self.sessions, self.residency)


def placement_of(scenario: Scenario) -> Placement:
    """A scenario's residency as a placement."""
    return {
        (object_from_json(r.object.model_dump()), location_from_json(r.location.model_dump())): r.bytes
        for r in scenario.residency
        if r.bytes > 0
    }


def session_of(s: SessionState) -> Session:
    """A live session as a problem plans for it (an ended one is no longer active)."""
    return Session(s.id, s.user, s.slo, s.model, s.active and not s.ended, s.context_tokens)


def calibrated(declared: Scenario, learned: Calibration) -> Scenario:
    """`declared` with the bandwidths links learned (`service/calibration.py`) in place of the declared ones."""

    def values(scope: str, key: str) -> dict[str, float]:
        return {name: e.value for name, e in learned.of(scope, key).items()}

    nodes = [
        node.model_copy(
            update={
                **values("nodes", node.id),
                "gpus": [g.model_copy(update=values("gpus", g.id)) for g in node.gpus],
            }
        )
        for node in declared.cluster.nodes
    ]
    return declared.model_copy(update={"cluster": declared.cluster.model_copy(update={"nodes": nodes})})


def scenario_with(declared: Scenario, sessions: Iterable[Session], residency: Placement) -> Scenario:
    """The typed scenario of `declared` with `sessions` and `residency`: what an edit changes and validates."""
    return declared.model_copy(
        update={
            "sessions": [
                SessionIn(
                    id=s.id, user=s.user, slo=s.slo, model=s.model, active=s.active, context_tokens=s.context_tokens
                )
                for s in sessions
            ],
            "residency": [ResidencyIn.model_validate(entry) for entry in placement_to_json(residency)],
        }
    )


class Live:
    """The one authoritative state in memory, with the helpers that read it the same way everywhere."""

    def __init__(self, store: Store, metrics: Metrics, settings: Settings, clock: Callable[[], float]) -> None:
        self.store = store
        self.metrics = metrics
        self.settings = settings
        self.clock = clock
        self.lock = StateLock()
        self._thread = threading.local()  # per thread: how deep in `change()`, and whether it committed unsynced
        self.plan_lock = threading.Lock()  # one replan at a time
        self.listeners: list[Callable[[frozenset[str] | None], None]] = []
        self.urgent = threading.Event()  # set when a request waits for a model served nowhere, or the plan broke
        self.ready = False
        self.broken: str | None = None  # why the service stopped serving (a failed database write)
        self.reloader: Callable[[], None] | None = None  # restores memory from the store (set by the service)
        self.reset_state()

    def reset_state(self) -> None:
        """Empty memory, as before a start."""
        # the requests stand-in sessions stand for
        self.load = RecentLoad(
            self.settings.demand_window_seconds, self.settings.demand_seats, self.settings.demand_min_requests
        )
        self.last_used: dict[str, float] = {}  # model -> when a request or turn last ran on it
        self.force_replan = False
        self.failed_moves = FailedMoves(
            self.settings.failed_move_backoff_seconds, self.settings.failed_move_backoff_max_seconds
        )
        self.held_until: float | None = None  # when the first move the plan holds back may be queued again
        self.topology_changes = 0  # hardware, catalog or registration edits: a plan made before is void
        self.sessions: dict[str, SessionState] = {}
        self.event_ids: dict[str, float] = {}  # applied event id -> when (a resend within retention is ignored)
        self.pruned_at = float("-inf")
        self.placement: Placement = {}
        self.published_placement: Placement = {}  # the placement as the last publish (and commit) left it
        self.srv: PublishedSrv | None = None  # None until the first publish
        self.epoch = 0
        self.plan: InstalledPlan | None = None  # the plan of `epoch`; None until the first
        self.plan_placement: Placement = {}
        self.ops: dict[str, OpRecord] = {}
        self.open_ops = OpenOps(self.ops)  # queued or leased
        self.next_lease_expiry = float("-inf")  # no lease ends before it: expiries need no scan until then
        self.calibration = Calibration()
        self.node_records: dict[str, NodeRecord] = {}  # node -> its agent's registration, telemetry, reconcile
        self.quarantine: tuple[Quarantined, ...] = ()  # placement entries a start took out: they broke an invariant
        self.predictor = SwitchPredictor([])
        self._declared: Scenario | None = None
        self.calibrated: Scenario | None = None  # `declared` with the calibrated bandwidths
        self.catalog: Problem | None = None  # `calibrated` compiled: no sessions, no residency
        self.sizes: Problem | None = None  # `catalog` with the planned sessions: sizes, capacities, bandwidths
        self._compiled_from: tuple[Scenario, object] | None = None  # (declared, calibration) `catalog` is of
        self._sessions_key: object = None  # the planning fields `sizes` has its sessions from
        self.serving: set[str] = set()

    def require_ready(self) -> None:
        if self.broken is not None:
            raise NotReady(self.broken)
        if not self.ready:
            raise NotReady("the service is starting; retry shortly")

    def write(self, batch: Batch) -> None:
        """Commit `batch`. When that fails, memory already holds a change the database does not: memory goes
        back to what the database holds, and the caller is told nothing happened. The outermost `change()`
        makes it durable (`durable()`) once the state lock is released, before the caller answers."""
        try:
            self.store.write(batch)
        except Exception as error:  # noqa: BLE001 -- whatever a write raises, memory must not stay ahead
            self.recover(f"a database write failed ({error})")
            raise NotReady(f"a database write failed ({error}); nothing changed, retry") from None
        if batch:
            self._thread.unsynced = True

    @contextmanager
    def change(self, urgency: Urgency = Urgency.ROUTINE) -> Iterator[None]:
        """Hold the state lock for a change (`Urgency.URGENT` when a caller waits on it to go on: it goes before
        the routine ones waiting, `state_lock.py`). Refusals (`ServiceError`) are raised before anything changes;
        any other exception may leave memory half changed and uncommitted, so memory is reloaded from the
        database before it propagates: nothing the service publishes was not committed. What the change
        committed is flushed to disk after the lock is released (group commit), before this returns."""
        depth = getattr(self._thread, "depth", 0)
        self._thread.depth = depth + 1
        try:
            self.lock.acquire(urgency)
            try:
                yield
            except ServiceError:
                raise
            except Exception as error:
                self.recover(f"{type(error).__name__}: {error}")
                raise
            finally:
                self.lock.release()
        finally:
            self._thread.depth = depth
            if depth == 0:
                self.durable()

    def durable(self) -> None:
        """Flush what this thread committed, outside the state lock (`Store.sync`: writers that committed
        meanwhile share the flush). A flush that fails stops the service: what it answered may not be on disk."""
        if not getattr(self._thread, "unsynced", False):
            return
        self._thread.unsynced = False
        try:
            self.store.sync()
        except OSError as error:
            self.broken = f"flushing the database to disk failed ({error}): restart the service"
            log.critical("%s", self.broken)
            raise NotReady(self.broken) from None

    def recover(self, why: str) -> None:
        """Make memory the database's state again, or stop serving when even that fails."""
        log.error("%s: the change is undone, memory is reloaded from the database", why)
        try:
            assert self.reloader is not None
            self.reloader()
        except Exception as error:  # noqa: BLE001 -- a reload that fails for any reason must stop serving
            self.broken = f"{why}; reloading from the database failed too ({error}): restart the service"
            log.critical("%s", self.broken)

    def notify(self, nodes: frozenset[str] | None = None) -> None:
        """The queues of `nodes` (None: of every node) may have changed."""
        for callback in list(self.listeners):
            callback(nodes)

    def add_listener(self, callback: Callable[[frozenset[str] | None], None]) -> None:
        """`callback(nodes)` runs (from any thread) whenever the queues of `nodes` (None: any node's) may have
        changed."""
        self.listeners.append(callback)

    def wake(self, *, urgent: bool = False, force: bool = False) -> None:
        """Tell the planning loop to replan at once (after its debounce) when a request waits for a model
        served nowhere (`urgent`) or the plan broke (`force`); other changes wait for its periodic replan
        (`planner/online.py` says why)."""
        self.force_replan = self.force_replan or force
        if urgent or force:
            self.urgent.set()

    @property
    def declared(self) -> Scenario:
        """The scenario as operators declared it: the cluster, the model catalog, the predictor's priors and the
        cost constants. Its sessions and residency are empty: those live in `sessions` and `placement`.
        Immutable: an edit replaces it, so whatever was compiled from it stays true of it."""
        assert self._declared is not None, "the service has not started"
        return self._declared

    @declared.setter
    def declared(self, scenario: Scenario) -> None:
        self._declared = scenario.model_copy(update={"sessions": [], "residency": []})

    def declared_json(self) -> dict[str, Any]:
        """The declared scenario as the store keeps it (the `base` meta row: a scenario file without sessions
        and residency)."""
        return self.declared.model_dump(mode="json", exclude={"sessions", "residency"})

    def node(self, node_id: str) -> NodeIn:
        return next(n for n in self.declared.cluster.nodes if n.id == node_id)

    def replace_node(self, node: NodeIn) -> None:
        """Declare `node` in place of the node of its id (a registration's capabilities and engines)."""
        nodes = [node if n.id == node.id else n for n in self.declared.cluster.nodes]
        self.declared = self.declared.model_copy(
            update={"cluster": self.declared.cluster.model_copy(update={"nodes": nodes})}
        )

    def node_record(self, node_id: str) -> NodeRecord:
        """What the node's agent said last (an empty record where it said nothing yet)."""
        return self.node_records.get(node_id) or NodeRecord()

    def put_node_record(self, node_id: str, record: NodeRecord, batch: Batch) -> None:
        """Replace the node's record; `batch` stores the `nodes` row with it."""
        self.node_records[node_id] = record
        batch.meta["nodes"] = nodes_to_json(self.node_records)

    def node_ids(self) -> list[str]:
        return [n.id for n in self.declared.cluster.nodes]

    def model_ids(self) -> list[str]:
        return [m.id for m in self.declared.models]

    def new_predictor(self) -> SwitchPredictor:
        return SwitchPredictor(self.model_ids(), self.declared.predictor, window_seconds=PREDICTOR_WINDOW_SECONDS)

    def planned_sessions(self, residency: Placement) -> list[Session]:
        """The sessions a problem holding `residency` plans for, by id: those of catalog models not ended, and
        the ended ones whose KV it still holds."""
        models = set(self.model_ids())
        with_kv = {obj.session for obj, _ in residency if obj.kind is Kind.KV}
        return [
            session_of(s)
            for _, s in sorted(self.sessions.items())
            if s.model in models and (not s.ended or s.id in with_kv)
        ]

    def next_model(self, sessions: Iterable[Session], now: float) -> dict[str, dict[str, float]]:
        current = {s.id: s.model for s in sessions if not (s.id in self.sessions and self.sessions[s.id].ended)}
        return self.predictor.predict_sessions(current, now)

    def compile(self, scenario: Scenario) -> Problem:
        """Resolve presets, configs and the cluster into a `Problem`: the costly step, taken only when the
        declared scenario or the calibration changed (`refresh_sizes`)."""
        return compile_problem(scenario, {})

    def state(self, residency: Placement) -> LiveState:
        """What the live problem holding `residency` is made of: the compiled catalog, the planned sessions and
        the residency restricted to the models and sessions it knows."""
        self.refresh_sizes()
        assert self.catalog is not None
        sessions = self.planned_sessions(residency)
        included = {s.id for s in sessions}
        kept = {
            (obj, loc): n
            for (obj, loc), n in residency.items()
            if obj.model in self.catalog.models and (obj.kind is not Kind.KV or obj.session in included)
        }
        assert self.calibrated is not None
        return LiveState(
            self.catalog,
            self.calibrated,
            tuple(sessions),
            kept,
            self.engine_pools(),
            self.observed_engines(),
            self.asleep_expert_fractions(),
        )

    def engine_pools(self) -> dict[tuple[str, str], int]:
        """(node, model) -> the KV pool per GPU of each running or sleeping engine instance the nodes' last
        heartbeats report (`instances[].instance.kv_pool_bytes_per_gpu`), of the models the catalog knows: a
        sleeping engine's pool is the one it was launched with, which its wake allocates again (a sleep frees
        the pool's memory, not its size: vllm/device_allocator/cumem.py `CuMemAllocator.wake_up` maps every
        allocation it recorded back, the KV cache's with the same handle and size). A pool of 0
        is one the agent does not know (an engine it did not launch with a pool): no engine serves from an
        empty pool (vLLM and SGLang refuse to start), so the planner derives that one
        (engine_holdings.launched_pools)."""
        pools: dict[tuple[str, str], int] = {}
        for node_id, record in self.node_records.items():
            if record.telemetry is not None:
                pools.update(self.reported_pools(node_id, record.telemetry.instances))
        return pools

    def observed_engines(self) -> dict[tuple[str, str], tuple[EngineState, tuple[str, ...]]]:
        """(node, model) -> the state and GPU group of each sleeping engine instance the nodes' last heartbeats
        report, of the models the catalog knows. The confirmed placement cannot tell a sleeping engine from a
        stopped one (neither holds anything on its GPUs), and the planner prices waking the first and cold
        starting the second very differently (`engine_costs.instance_now`)."""
        return {
            (node_id, entry.instance.model): (entry.state, tuple(entry.instance.gpus))
            for node_id, entry in self._asleep_instances()
        }

    def asleep_expert_fractions(self) -> dict[tuple[str, str], float]:
        """(node, model) -> the GPU expert share each sleeping MoE engine the nodes' last heartbeats report was
        launched with: its wake maps those experts back, a launch setting as its pool is."""
        models = self.catalog.models if self.catalog is not None else {}
        return {
            (node_id, entry.instance.model): entry.instance.gpu_expert_fraction
            for node_id, entry in self._asleep_instances()
            if models[entry.instance.model].experts_bytes
        }

    def _asleep_instances(self) -> Iterator[tuple[str, EngineInstanceStateIn]]:
        """(node, instance) of each sleeping engine instance the nodes' last heartbeats report, of the models
        the catalog knows."""
        known = self.catalog.models if self.catalog is not None else {}
        for node_id, record in sorted(self.node_records.items()):
            if record.telemetry is not None:
                for entry in record.telemetry.instances:
                    if entry.state in ASLEEP_STATES and entry.instance.model in known:
                        yield node_id, entry

    def reported_pools(self, node_id: str, instances: Iterable[EngineInstanceStateIn]) -> dict[tuple[str, str], int]:
        """`engine_pools` of one heartbeat's instances."""
        known = self.catalog.models if self.catalog is not None else {}
        return {
            (node_id, entry.instance.model): entry.instance.kv_pool_bytes_per_gpu
            for entry in instances
            if entry.state in LAUNCHED_STATES
            and entry.instance.kv_pool_bytes_per_gpu > 0
            and entry.instance.model in known
        }

    def problem(self, residency: Placement, next_model: Mapping[str, Mapping[str, float]]) -> Problem:
        """The live problem holding `residency`; raises `ScenarioError` when it overfills a location."""
        return self.state(residency).problem(next_model)

    def refresh_live(self) -> Placement:
        """Recompute sizes (sessions, calibration) and the served models from the confirmed placement; the
        confirmed placement restricted to what the live problem knows (`valid_placement`)."""
        self.refresh_sizes()
        assert self.sizes is not None
        valid = self.valid_placement(self.placement)
        self.serving = set(ResidencyIndex.serving_in(self.sizes, valid))
        return valid

    def refresh_sizes(self) -> None:
        """Recompute the live problem's sizes, capacities and bandwidths when what they are made of changed.

        Two layers, each redone only when its inputs changed: the catalog and the cluster with its calibrated
        bandwidths (`catalog`, compiled when the declared scenario is replaced or the calibration changes), and
        the sessions it plans for (`sizes`: the catalog with the planning fields of the sessions not ended and
        of the ended ones that still hold KV). No done report or event compiles the catalog again; an event
        that changes a session's planning fields redoes only the second, cheap layer."""
        calibration = self.calibration.values()  # a refused sample's bookkeeping changes no bandwidth
        if (
            self._compiled_from is None
            or self._compiled_from[0] is not self.declared
            or self._compiled_from[1] != calibration
        ):
            self.calibrated = calibrated(self.declared, self.calibration)
            self.catalog = self.compile(self.calibrated)
            self._compiled_from = (self.declared, calibration)
            self._sessions_key = None
        with_kv = {obj.session for obj, _ in self.placement if obj.kind is Kind.KV}
        key = tuple(
            (s.id, s.user, s.slo, s.model, s.active, s.ended, s.context_tokens)
            for s in self.sessions.values()
            if not s.ended or s.id in with_kv
        )
        if self.sizes is None or key != self._sessions_key:
            assert self.catalog is not None
            self.sizes = with_state(self.catalog, self.planned_sessions(self.placement), {}, {})
            self._sessions_key = key
        pools = self.engine_pools()
        if pools != self.sizes.engine_pools:  # the SRV counts no GPU KV beyond a reported pool (planner/srv.py)
            self.sizes = dataclasses.replace(self.sizes, engine_pools=MappingProxyType(pools))

    def publish_srv(self, touched: Iterable[tuple[StateObject, Location]] | None = None) -> Placement:
        """Publish the SRV of the confirmed placement; `version` moves exactly when what it publishes does.

        `touched`: the only (object, location) entries changed since the last publish (None: any may have).
        Returns the entries that changed, with their bytes now (0: gone), for the batch that commits them: a
        done report writes its two entries, not the whole placement."""
        valid = self.refresh_live()
        assert self.sizes is not None
        keys = set(self.placement) | set(self.published_placement) if touched is None else set(touched)
        changed = {
            k: self.placement.get(k, 0) for k in keys if self.placement.get(k, 0) != self.published_placement.get(k, 0)
        }
        rows = srv_rows(self.sizes, valid)
        for k, n in changed.items():
            if n > 0:
                self.published_placement[k] = n
            else:
                self.published_placement.pop(k, None)
        if self.srv is not None and not changed and rows == self.srv.rows:
            return changed
        self.srv = PublishedSrv(self.srv.version + 1 if self.srv is not None else 1, rows)
        return changed

    @property
    def srv_version(self) -> int:
        return self.srv.version if self.srv is not None else 0

    def stored_srv(self) -> dict[str, Any]:
        """The published SRV as the store keeps it (its `srv` row)."""
        assert self.srv is not None, "nothing published yet"
        return self.srv.to_json()

    def srv_view(self) -> dict[str, Any]:
        """The published SRV with the placement it was computed from, as `GET /v1/srv` answers it."""
        assert self.srv is not None, "nothing published yet"
        return {
            "version": self.srv.version,
            "srv": [row.to_json() for row in self.srv.rows],
            "placement": placement_to_json(self.published_placement),
        }

    def valid_placement(self, placement: Placement) -> Placement:
        p = self.sizes
        assert p is not None
        return {
            (obj, loc): n
            for (obj, loc), n in placement.items()
            if obj.model in p.models
            and (obj.kind is not Kind.KV or obj.session in p.sessions)
            and (loc.id in p.gpus if loc.tier is Tier.GPU else loc.id in p.nodes)
        }

    def inflight(self) -> list[OpRecord]:
        """The leased operations, in the order their plans meant them."""
        return sorted(
            (self.ops[i] for i in self.open_ops if self.ops[i].state is OpState.LEASED),
            key=lambda r: (r.epoch, r.seq),
        )

    def require_node(self, node_id: str) -> None:
        nodes = self.node_ids()
        if node_id not in nodes:
            raise NotFound(f"unknown node {node_id!r}; known: {sorted(nodes)}")

    def observation_window(self) -> float:
        return max(PREDICTOR_WINDOW_SECONDS, self.load.max_window_seconds)

    def prune(self, now: float) -> None:
        """Forget observations older than their window, event ids past their retention and all but the newest
        finished operations, in the store and here, so that a long-running service holds a bounded state."""
        retained_from = now - self.settings.event_retention_seconds
        self.store.prune(now - self.observation_window(), retained_from)
        self.event_ids = {event_id: at for event_id, at in self.event_ids.items() if at >= retained_from}
        finished = sorted((r for r in self.ops.values() if r.state in FINAL_STATES), key=lambda r: (r.epoch, r.seq))
        for r in finished[: max(0, len(finished) - FINAL_KEEP)]:  # the newest stay, as in the store
            del self.ops[r.id]
        self.pruned_at = now

    def status(self) -> dict[str, int | None]:
        with self.change(Urgency.URGENT):
            ready = self.ready and self.broken is None and self.plan is not None
            return {"epoch": self.epoch if ready else None, "srv_version": self.srv_version if ready else None}

    def purge_ended_sessions(self, batch: Batch) -> None:
        """Forget the ended sessions that hold no KV and have none in flight (every event batch and done
        report calls this: the placement and the open operations are looked at only when one has ended)."""
        ended = {s.id for s in self.sessions.values() if s.ended}
        if not ended:
            return
        ended -= {obj.session for obj, _ in self.placement if obj.kind is Kind.KV}
        ended -= {self.ops[i].op.object.session for i in self.open_ops if self.ops[i].op.object.kind is Kind.KV}
        for sid in sorted(ended):
            del self.sessions[sid]
            batch.sessions[sid] = None

    def observe_switch(self, s: SessionState, seconds: float) -> None:
        self.metrics.switch_latency.labels(s.slo.value).observe(seconds)
        targets = self.sizes.constants.slo_targets_seconds if self.sizes else None
        if targets is not None and seconds > targets.of(s.slo):
            self.metrics.slo_violations.labels(s.slo.value).inc()
