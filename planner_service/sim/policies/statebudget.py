"""`statebudget`: the real planner, called online with only what it could know at the time.

On a request whose model is not ready (at most every `min_interval_seconds`),
after turns end (at most every `idle_interval_seconds`) and on every engine
tick, the policy builds a `Problem` from the simulated cluster: confirmed
placement = simulated residency (copies still in flight count as there),
sessions with their context and an active flag for requests waiting or
running, and next-model probabilities from a `SwitchPredictor` fed the
hand-offs observed so far. It calls `planner.registry.solve` and executes
the plan's operations in simulated time, each as soon as its `depends_on`
are done and its destination has room; a new plan supersedes operations not
started yet. Copies share bandwidth with everything else.

The KV of a request that is waiting or running is made ready by the engine
(restore or re-prefill, whichever is cheaper), so the plan's operations on
it are skipped, as are its prefill-from-nothing operations. A waiting
request whose model no operation brings (the plan left it unserved, or the
plan failed) is loaded on demand, evicting what the latest plan does not
keep first (counted in `fallback_loads`).
"""

from __future__ import annotations

import dataclasses
import time
from types import MappingProxyType
from typing import TYPE_CHECKING

from planner_service.domain.problem import Session
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.planner.greedy import PlanningError
from planner_service.planner.operations import Action, Operation
from planner_service.planner.predictor import SwitchPredictor
from planner_service.planner.registry import SolverName, solve
from planner_service.sim.policies.base import Policy, PolicyName
from planner_service.sim.policies.static import apply_placement, static_placement

if TYPE_CHECKING:
    from planner_service.sim.engine import SessionState, Simulator, SimRequest
    from planner_service.sim.cluster import Transfer


class StatebudgetPolicy(Policy):
    name = PolicyName.STATEBUDGET
    kv_offload = True

    def __init__(
        self,
        solver: str = SolverName.GREEDY,
        min_interval_seconds: float = 2.0,
        idle_interval_seconds: float = 30.0,
        fallback_after_seconds: float = 10.0,
        warm_start: bool = True,
    ) -> None:
        self.solver = solver
        self.min_interval_seconds = min_interval_seconds
        self.idle_interval_seconds = idle_interval_seconds
        self.fallback_after_seconds = fallback_after_seconds
        self.warm_start = warm_start
        self.predictor: SwitchPredictor | None = None
        self.ops: list[Operation] = []
        self.status: dict[str, str] = {}
        self.keep: set[tuple[StateObject, Location]] = set()
        self.last_plan = float("-inf")
        self.scheduled_at: float | None = None
        self.plans = 0
        self.failed_plans = 0
        self.changed = False
        self.errors: list[str] = []

    # -- set-up and learning ---------------------------------------------------

    def setup(self, sim: Simulator) -> None:
        self.predictor = SwitchPredictor(list(sim.problem.models), sim.scenario.predictor)
        if self.warm_start:
            apply_placement(sim, static_placement(sim))  # start from the same state as `static`

    def observe(self, sim: Simulator, session: SessionState, req: SimRequest) -> None:
        assert self.predictor is not None
        if session.model is not None:
            self.predictor.observe_handoff(req.t, session.model, req.model)
            self.predictor.observe_turn_gap(req.t, max(0.0, req.t - session.last_t))
        self.changed = True

    # -- when to plan ------------------------------------------------------------

    def request_plan(self, sim: Simulator, interval: float) -> None:
        at = max(sim.now, self.last_plan + interval)
        if self.scheduled_at is not None and self.scheduled_at <= at:
            return
        self.scheduled_at = at
        sim.push(at, "plan", at)

    def on_plan_event(self, sim: Simulator, payload: object) -> None:
        if payload != self.scheduled_at:
            return  # superseded by an earlier call
        self.scheduled_at = None
        self.plan(sim)

    def on_arrival(self, sim: Simulator, req: SimRequest) -> None:
        state = sim.models.get(req.model)
        if state is None or state.status != "ready":
            self.request_plan(sim, self.min_interval_seconds)

    def on_done(self, sim: Simulator, req: SimRequest) -> None:
        self.changed = True
        self.request_plan(sim, self.idle_interval_seconds)

    def on_tick(self, sim: Simulator) -> None:
        if self.changed or sim.waiting:
            self.request_plan(sim, 0.0)

    def on_waiting(self, sim: Simulator, req: SimRequest) -> None:
        if req.model in sim.needs_kv_room:  # the planned group could not hold this KV: load where it fits
            if sim.load_model(req.model):
                sim.fallback_loads += 1
            return
        if self.scheduled_at is not None and sim.now - req.admitted_at < self.fallback_after_seconds:
            return  # a plan is coming
        if self._brings(req.model) and sim.now - req.admitted_at < self.fallback_after_seconds:
            return
        if sim.load_model(req.model):
            sim.fallback_loads += 1

    def _brings(self, model: str) -> bool:
        return any(
            op.object.kind is Kind.WEIGHTS and op.object.model == model and op.dest is not None
            and op.dest.tier is Tier.GPU and self.status.get(op.id) in ("queued", "started")
            for op in self.ops
        )

    def victim_key(self, sim: Simulator, obj: StateObject, loc: Location) -> tuple | None:
        return ((obj, loc) in self.keep, obj.kind is not Kind.EXPERTS, sim.last_used.get(obj, -1.0), obj)

    # -- planning ----------------------------------------------------------------

    def problem(self, sim: Simulator):
        assert self.predictor is not None
        sessions: dict[str, Session] = {}
        for s in sim.sessions.values():
            req = s.request
            if req is not None:
                ctx = s.history_tokens + req.input_tokens + req.output_tokens
                sessions[s.id] = Session(s.id, s.user, s.slo, req.model, True, ctx)
            elif s.model is not None and not s.ended:
                sessions[s.id] = Session(s.id, s.user, s.slo, s.model, False, s.history_tokens)
        residency: dict[tuple[StateObject, Location], int] = {}
        for (obj, loc), nbytes in sim.cluster.placed.items():
            if obj.kind is Kind.KV and obj.session not in sessions:
                continue
            residency[(obj, loc)] = nbytes
        for t in sim.cluster.transfers.values():
            if not t.preallocated and not (t.obj.kind is Kind.KV and t.obj.session not in sessions):
                residency[(t.obj, t.dest)] = residency.get((t.obj, t.dest), 0) + t.bytes
        for (obj, loc), nbytes in list(residency.items()):
            if obj.kind is Kind.KV:  # a KV copy never exceeds the session's context
                size = sessions[obj.session].context_tokens * sim.problem.models[obj.model].kv_bytes_per_token
                residency[(obj, loc)] = min(nbytes, size)
                if residency[(obj, loc)] <= 0:
                    del residency[(obj, loc)]
        next_model = self.predictor.predict_sessions({s.id: s.model for s in sessions.values()}, sim.now)
        return dataclasses.replace(
            sim.problem,
            sessions=MappingProxyType(sessions),
            residency=MappingProxyType(residency),
            next_model=MappingProxyType(next_model),
        )

    def plan(self, sim: Simulator) -> None:
        started = time.perf_counter()
        self.last_plan = sim.now
        self.changed = False
        try:
            plan = solve(self.problem(sim), self.solver)
        except (PlanningError, ValueError, KeyError) as error:
            self.failed_plans += 1
            if len(self.errors) < 5:
                self.errors.append(f"t={sim.now:.1f}: {error}")
            sim.planner_seconds.append(time.perf_counter() - started)
            return
        sim.planner_seconds.append(time.perf_counter() - started)
        self.plans += 1
        # a new plan supersedes the operations not started yet
        for op in self.ops:
            if self.status.get(op.id) == "queued":
                self.status[op.id] = "superseded"
        prefix = f"p{self.plans}-"
        self.ops = []
        for op in plan.operations:
            op = dataclasses.replace(op, id=prefix + op.id, depends_on=[prefix + d for d in op.depends_on])
            self.ops.append(op)
            self.status[op.id] = "queued"
        self.keep = {key for key in plan.placement if key[1].tier is Tier.GPU}
        self.on_dispatch(sim)

    # -- executing operations ----------------------------------------------------

    def on_dispatch(self, sim: Simulator) -> None:
        progressed = True
        while progressed:
            progressed = False
            for op in self.ops:
                if self.status.get(op.id) != "queued":
                    continue
                if any(self.status.get(d) in ("queued", "started") for d in op.depends_on):
                    continue
                outcome = self._start(sim, op)
                if outcome is not None:
                    self.status[op.id] = outcome
                    progressed = progressed or outcome != "started"

    def _busy_kv(self, sim: Simulator, obj: StateObject) -> bool:
        session = sim.sessions.get(obj.session) if obj.session else None
        return session is not None and session.request is not None and session.request.model == obj.model

    def _start(self, sim: Simulator, op: Operation) -> str | None:
        """Start an operation: 'started', 'done' / 'failed' at once, or None to wait for room."""
        obj, c = op.object, sim.cluster
        if obj.kind is Kind.KV and (op.source is None or self._busy_kv(sim, obj)):
            return "done"  # the engine readies the KV of requests it serves (restore or re-prefill)
        if op.action is Action.DROP:
            return self._drop(sim, obj, op.source, op.bytes)
        have = c.bytes_of(obj, op.source)
        nbytes = min(op.bytes, have)
        if nbytes <= 0:
            return "failed"
        if not op.keep_source and (sim.pinned(obj) or c.reading(obj, op.source)):
            return "failed"
        if op.source.tier is Tier.GPU and op.dest.tier is not Tier.GPU and c.free(op.dest) < nbytes:
            return None
        if c.free(op.dest) < nbytes:
            return None
        c.start(sim.now, obj, op.source, op.dest, nbytes, op.keep_source, lambda t, op=op: self._done(sim, op, t))
        sim.operations += 1
        if not op.keep_source and op.source.tier is Tier.GPU:
            self._left_gpu(sim, obj, op.source)
        return "started"

    def _drop(self, sim: Simulator, obj: StateObject, loc: Location, nbytes: int) -> str:
        c = sim.cluster
        if sim.pinned(obj) or c.reading(obj, loc) or c.bytes_of(obj, loc) <= 0:
            return "failed"
        node = sim.problem.node_of(loc)
        if obj.kind is not Kind.KV:
            others = [t for t in (Tier.GPU, Tier.HOST, Tier.NVME) if t is not loc.tier]
            size = c.full_size(obj)
            if not any(c.node_bytes(obj, node, t) >= size for t in others if t is not Tier.GPU):
                return "failed"  # never the last complete copy below GPU
        c.remove(obj, loc, nbytes)
        sim.operations += 1
        if loc.tier is Tier.GPU:
            self._left_gpu(sim, obj, loc)
        elif obj.kind is Kind.KV and loc.tier is Tier.HOST and not c.bytes_of(obj, loc):
            sim.host_tokens[obj] = 0
        return "done"

    def _left_gpu(self, sim: Simulator, obj: StateObject, loc: Location) -> None:
        """Bytes of `obj` left a GPU: weights stop serving, KV stops covering."""
        if obj.kind is Kind.KV:
            sim.gpu_tokens[obj] = 0
        elif obj.kind is Kind.WEIGHTS:
            state = sim.models.get(obj.model)
            if state is not None and state.precision == obj.precision and loc.id in {g.id for g in state.gpus}:
                if state.status == "ready" and not sim.running.get(obj.model):
                    del sim.models[obj.model]

    def _done(self, sim: Simulator, op: Operation, transfer: Transfer) -> None:
        if self.status.get(op.id) in ("started", "superseded"):
            self.status[op.id] = "done"
        obj, c = op.object, sim.cluster
        if not op.keep_source and op.source is not None and op.source.tier is Tier.GPU:
            self._left_gpu(sim, obj, op.source)
        if obj.kind is Kind.KV:
            kvpt = sim.problem.models[obj.model].kv_bytes_per_token or 1
            if op.dest.tier is Tier.GPU:
                on_gpu = c.node_bytes(obj, op.node, Tier.GPU) // kvpt
                sim.gpu_tokens[obj] = min(sim.host_tokens[obj] or on_gpu, on_gpu)
            elif op.dest.tier is Tier.HOST:
                sim.host_tokens[obj] = max(sim.host_tokens[obj], c.bytes_of(obj, op.dest) // kvpt)
        elif obj.kind is Kind.WEIGHTS and op.dest.tier is Tier.GPU and obj.model not in sim.models:
            size = c.full_size(obj)
            if c.node_bytes(obj, op.node, Tier.GPU) >= size:
                gpus = tuple(
                    sim.problem.gpus[g] for g in sim.problem.nodes[op.node].gpus
                    if c.bytes_of(obj, Location.gpu(g)) > 0
                )
                sim.adopt_weights(obj.model, op.node, obj.precision, gpus)
