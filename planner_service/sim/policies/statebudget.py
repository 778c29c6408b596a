"""`statebudget`: the real planner, called online with only what it could know at the time.

When to plan: as the service does (`planner/online.py`). On a request whose
model is not ready (at most one plan every `min_interval_seconds`, the
service's debounce) and otherwise every `replan_seconds` when requests arrived
since the last plan. A turn ending does not trigger a plan: LMCache stored
its prompt's KV to host DRAM as it prefilled (`sim/kv_save.py`). Between plans, a request whose
model is cold is loaded on demand (below), as `lru` would.

What a plan sees, and when it is adopted: as the service plans (`planner/online.py`). The policy builds
a `Problem` from the simulated cluster: confirmed placement = simulated residency (copies still in flight
count as there), sessions with their context and an active flag for requests waiting or running, and
next-model probabilities from a `SwitchPredictor` fed the hand-offs observed so far; the online rules add
stand-in sessions for the last hour's load (`RecentLoad`), pin the engines that served within the window
unless their requests waited over `unpin_after_seconds` (`pins`), and adopt a plan only when it is worth
its moves (`worth_adopting`), their tail included (`move_price`, from the window's arrival rates). It calls the greedy (`plan_greedy`) and prices its target with `make_plan`.
An adopted plan's operations start `control_path_seconds` after it was made: what the service's path from
an event to an agent's engine call and back to the gateway's route table takes, as baselines pay their own
direct wake. At t=0 the replay starts where `static` does (`warm_start`), and every other engine has been
launched once and sleeps on the operator's group (`prelaunch`), as `sleep-router`'s engines have: both
start from a deployment that ran before, not one whose first requests pay cold starts.

Hysteresis in execution, so that engines and plans do not undo what the other just did:

* **No undo within a window.** Weights or experts that arrived on a GPU less
  than `min_residency_seconds` ago are not dropped or moved off by a plan.
* **Keep-warm.** Weights of a model that served a turn within the window are
  not dropped by a plan either: agent sessions come back to it.
  Neither rule holds while a request waits for a model that is not loaded:
  they stop speculative reshuffles, never the room a waiting request needs.
  When the engine makes room on a GPU, such weights go after idle KV (which
  has a copy in host DRAM) and experts.
* **No return within a window.** Experts the engine evicted from a GPU to
  make room are not promoted back there by a plan for `min_residency_seconds`:
  the room went to KV or weights that requests needed, and a plan priced on
  its instant would hand it back to the experts, to be evicted again. The
  price is slower MoE decode while the experts stay out.

Executing. The adopted plan's operations run in simulated time, each as
soon as its `depends_on` are done and its destination has room; a newly
adopted plan supersedes operations not started yet. Copies share bandwidth
with everything else. The KV of a request that is waiting or running is
made ready by the engine (restore or re-prefill, whichever is cheaper), so
the plan's operations on it are skipped, as are its prefill-from-nothing
operations. A model whose planned weights are complete on their GPUs serves
from there (a new engine on that group) as soon as they are, also when the
plan copies nothing for it: a plan widening a group onto shards an earlier
engine left only drops the surplus on the old GPU, and without this rule the
model would keep serving from the narrower group, plan after plan. A plan may
drop weights the model's engine does not read (beyond its shard on a GPU, or
off its group) while the model is busy, once no request runs on an earlier
engine of it: otherwise they would hold GPU memory for as long as the model
stays busy. The rest of a busy model's weights stay. A KV copy an
operation makes covers what its source covered (the engine never lets a
copy cover more than its model computed), and a copy to host DRAM that the
write-through copy already holds frees the GPU copy at once instead of
moving the bytes again. A waiting request whose model no operation brings
is loaded on demand after `fallback_after_seconds`, evicting what the
latest plan does not keep first (counted in `fallback_loads`), onto a group
with room for the model's working set: the KV of its waiting requests and
of the sessions it served within the window. A model that becomes ready
gets no expert fill of its own (other policies fill the free room): which
expert chunks are worth their HBM is the plan's call, and its operations
bring them.

What each of these rules bought in the replays: docs/studies/ablations.md.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from functools import partial
from types import MappingProxyType
from typing import TYPE_CHECKING

from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.problem import Session
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.planner.errors import PlanningError
from planner_service.planner.greedy import plan_greedy
from planner_service.planner.online import (
    ACROSS_MARGIN_STARTS,
    DEBOUNCE_SECONDS,
    REPLAN_SECONDS,
    Engine,
    RecentLoad,
    move_price,
    pins,
    worth_adopting,
)
from planner_service.planner.operations import Action, Operation
from planner_service.planner.plan import Plan, make_plan
from planner_service.planner.predictor import SwitchPredictor
from planner_service.planner.registry import SolverName
from planner_service.sim.policies.base import Policy, PolicyName
from planner_service.sim.policies.groups import declared_on_groups, launch_asleep, operator_partition
from planner_service.sim.policies.static import apply_placement, static_placement

if TYPE_CHECKING:
    from planner_service.domain.scenario import Scenario
    from planner_service.sim.cluster import Transfer
    from planner_service.sim.state import SessionState, SimRequest
    from planner_service.sim.view import SimView


# What the service's control path adds to a plan's engine calls: the gateway's event flush, the replan (at once
# on a quiet planner: its debounce throttles on the leading edge, as this replay plans) and its install, the node
# agent's lease, its report and the gateway's route fetch. The p50 of `statebudget bench wake`'s
# `routed_with_flush`, with the engine's own time left out (docs/benchmarks/control-path.md).
CONTROL_PATH_SECONDS = 0.12


class StatebudgetPolicy(Policy):
    name = PolicyName.STATEBUDGET

    def __init__(
        self,
        min_interval_seconds: float = DEBOUNCE_SECONDS,
        replan_seconds: float = REPLAN_SECONDS,
        fallback_after_seconds: float = 10.0,
        min_residency_seconds: float | None = None,
        warm_start: bool = True,
        prelaunch: bool = True,
        demand_window_seconds: float = 3600.0,
        demand_seats: int = 10,
        demand_min_requests: int = 1000,
        unpin_after_seconds: float = 60.0,
        control_path_seconds: float = CONTROL_PATH_SECONDS,
        price_moves: bool = True,
        across_margin: float = ACROSS_MARGIN_STARTS,
        stand_ins_expected: bool = True,
        predict_switches: bool = True,
    ) -> None:
        self.predict_switches = predict_switches  # False: plans see no session's next model (the ablation)
        self.price_moves = price_moves  # charge a plan's moves their outage and stranded KV (`move_price`)
        self.across_margin = across_margin  # hysteresis on moves across nodes, in cold starts
        self.stand_ins_expected = stand_ins_expected  # adoption prices stand-ins as predicted requests
        self.min_interval_seconds = min_interval_seconds
        self.control_path_seconds = control_path_seconds
        self.replan_seconds = replan_seconds  # periodic replan, at most; None of it when nothing changed
        self.fallback_after_seconds = fallback_after_seconds
        self.min_residency_seconds = min_residency_seconds  # None: the planner's horizon
        self.warm_start = warm_start
        self.prelaunch = prelaunch
        self.unpin_after_seconds = unpin_after_seconds
        # the load stand-in sessions are made for
        self.load = RecentLoad(demand_window_seconds, demand_seats, demand_min_requests)
        self.predictor: SwitchPredictor | None = None
        self.ops: list[Operation] = []
        self.status: dict[str, str] = {}
        self.keep: set[tuple[StateObject, Location]] = set()
        self.target: dict[tuple[StateObject, Location], int] = {}  # the adopted plan's GPU entries
        self.queued: list[Operation] = []  # the adopted plan's operations not started yet
        self._waiting_models: set[str] = set()
        self.arrived: dict[tuple[StateObject, Location], float] = {}  # when bytes last came onto a GPU
        self.evicted: dict[tuple[StateObject, Location], float] = {}  # when the engine last evicted experts from a GPU
        self.last_plan = float("-inf")
        self.scheduled_at: float | None = None
        self.adopting: Plan | None = None  # made, and on its way through the control path
        self.plans = 0
        self.adopted = 0
        self.failed_plans = 0
        self.changed = False
        self.errors: list[str] = []

    # -- set-up and learning ---------------------------------------------------

    def place(self, sim: SimView) -> None:
        self.predictor = SwitchPredictor(list(sim.problem.models), sim.scenario.predictor)
        if self.min_residency_seconds is None:
            self.min_residency_seconds = sim.c.horizon_seconds
        if self.warm_start:
            apply_placement(sim, self.act, static_placement(sim))  # start from the same state as `static`
        if self.prelaunch:
            # every other engine launched once before the trace and asleep, on the operator's group, as
            # `sleep-router`'s are: a deployment that has run before starts no engine cold for its first request
            partition = operator_partition(sim.problem)
            for model_id in sorted(partition):
                if model_id not in sim.models:
                    launch_asleep(sim, self, partition[model_id])

    def observe(self, sim: SimView, session: SessionState, req: SimRequest) -> None:
        assert self.predictor is not None
        self.load.add(sim.now, req.model, session.history_tokens + req.input_tokens + req.output_tokens)
        if session.requested_model is not None:
            self.predictor.observe_handoff(req.t, session.requested_model, req.model)
            self.predictor.observe_turn_gap(req.t, max(0.0, req.t - session.last_t))
        self.changed = True

    # -- when to plan ------------------------------------------------------------

    def request_plan(self, sim: SimView, interval: float) -> None:
        at = max(sim.now, self.last_plan + interval)
        if self.scheduled_at is not None and self.scheduled_at <= at:
            return
        self.scheduled_at = at
        self.act.schedule_plan(at, at)

    def on_plan_event(self, sim: SimView, payload: object) -> None:
        if isinstance(payload, Plan):  # through the control path: its operations may start now
            if payload is self.adopting:  # (unless a newer plan overtook it)
                self.adopting = None
                self.adopt(sim, payload)
            return
        if payload != self.scheduled_at:
            return  # superseded by an earlier call
        self.scheduled_at = None
        self.plan(sim)

    def on_arrival(self, sim: SimView, req: SimRequest) -> None:
        state = sim.models.get(req.model)
        if state is None or state.status != "ready":
            self.request_plan(sim, self.min_interval_seconds)
            self.act.look_again_at(sim.now + self.fallback_after_seconds)

    def on_tick(self, sim: SimView) -> None:
        if self.changed:
            self.request_plan(sim, self.replan_seconds)

    def on_waiting(self, sim: SimView, req: SimRequest) -> None:
        if req.model in sim.needs_kv_room:  # the planned group could not hold this KV: load where it fits
            if self.act.load_model(req.model):
                self.act.count_fallback()
            return
        if sim.now - req.admitted_at < self.fallback_after_seconds:
            if self.scheduled_at is not None or self.adopting is not None or self._brings(req.model):
                return  # a plan is coming, or its operations are on the way
        if self.act.load_model(req.model):
            self.act.count_fallback()

    def _brings(self, model: str) -> bool:
        return any(
            op.object.kind is Kind.WEIGHTS
            and op.object.model == model
            and op.dest is not None
            and op.dest.tier is Tier.GPU
            and self.status.get(op.id) in ("queued", "started")
            for op in self.ops
        )

    def on_model_ready(self, sim: SimView, model: str) -> None:
        """Experts on GPU are the plan's call (its operations bring the chunks worth their room): no fill."""

    def kv_reserve(self, sim: SimView, model: str) -> int:
        """An on-demand load leaves room for the model's working set: the KV of its waiting requests and
        of the sessions it served within the window (agent sessions come back to it)."""
        window = self.min_residency_seconds or 0.0
        kvpt = sim.problem.models[model].kv_bytes_per_token
        total = sum(sim.kv_footprint(r) for r in sim.waiting if r.model == model)
        for s in sim.sessions.values():
            if s.request is None and not s.ended and s.model == model and sim.now - s.last_t < window:
                total += s.history_tokens * kvpt
        return total

    def victim_key(self, sim: SimView, obj: StateObject, loc: Location) -> tuple | None:
        """What the plan keeps goes last; before it experts, then idle KV and weights idle for the window, then
        weights that served within it (least recently used first within each)."""
        used = sim.last_used.get(obj, -1.0)
        if obj.kind is Kind.EXPERTS:
            rank = 0
        elif obj.kind is Kind.WEIGHTS and sim.now - used < (self.min_residency_seconds or 0.0):
            rank = 2
        else:
            rank = 1
        return ((obj, loc) in self.keep, rank, used, obj)

    # -- planning ----------------------------------------------------------------

    def problem(self, sim: SimView):
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
            if obj.session is not None:  # a KV copy never exceeds the session's context
                size = sessions[obj.session].context_tokens * sim.problem.models[obj.model].kv_bytes_per_token
                residency[(obj, loc)] = min(nbytes, size)
                if residency[(obj, loc)] <= 0:
                    del residency[(obj, loc)]
        in_flight: dict[str, int] = {}
        for session in sessions.values():
            in_flight[session.model] = in_flight.get(session.model, 0) + session.active
        for stand_in in self.load.stand_ins(sim.now, in_flight):
            sessions[stand_in.id] = stand_in
        return dataclasses.replace(
            sim.problem,
            sessions=MappingProxyType(sessions),
            residency=MappingProxyType(residency),
            next_model=MappingProxyType(self.next_models(sim, sessions)),
            observed_engines=MappingProxyType(sim.sleeping_engines()),  # what the nodes' heartbeats report
        )

    def next_models(self, sim: SimView, sessions: Mapping[str, Session]) -> dict[str, dict[str, float]]:
        """Next-model probabilities of each session: the predictor's, fed the hand-offs observed so far."""
        assert self.predictor is not None
        if not self.predict_switches:
            return {}
        return self.predictor.predict_sessions({s.id: s.model for s in sessions.values()}, sim.now)

    def pins(self, sim: SimView) -> tuple[dict[str, str], dict[str, str]]:
        """Node and precision of every model that served within the window, unless its requests are stuck."""
        stuck = {r.model for r in sim.waiting if sim.now - r.admitted_at > self.unpin_after_seconds}
        engines: dict[str, Engine] = {}
        for model_id, state in sim.models.items():
            if state.status == "ready":
                last_used = sim.last_used.get(StateObject.weights(model_id, state.precision), -math.inf)
                engines[model_id] = Engine(state.node, state.precision, last_used)
        return pins(engines, stuck, sim.now, self.min_residency_seconds or 0.0)

    def plan(self, sim: SimView) -> None:
        started = time.perf_counter()
        self.last_plan = sim.now
        self.changed = False
        self.plans += 1
        try:
            problem = self.problem(sim)
            self._waiting_models = {r.model for r in sim.waiting if r.model not in sim.models}
            target = plan_greedy(problem, *self.pins(sim))
            plan = make_plan(
                problem,
                SolverName.GREEDY,
                target.placement,
                target.unserved,
                target.reasons,
                now=target.now,
                demand=target.demand,
            )
            price = None
            if self.price_moves or self.across_margin > 0:
                rates = self.load.rates(sim.now) if self.price_moves else {}
                price = move_price(problem, plan, rates, now=target.now, across_margin=self.across_margin)
            adopt = worth_adopting(
                problem,
                plan,
                self._waiting_models,
                pending=bool(self.queued),
                now=target.now,
                demand=target.demand,
                price=price,
                stand_ins_expected=self.stand_ins_expected,
            )
        except (PlanningError, ValueError, KeyError) as error:
            self.failed_plans += 1
            if len(self.errors) < 5:
                self.errors.append(f"t={sim.now:.1f}: {error}")
            self.act.report_plan_seconds(time.perf_counter() - started)
            return
        self.act.report_plan_seconds(time.perf_counter() - started)
        if adopt and self.control_path_seconds > 0:
            self.adopting = plan
            self.act.schedule_plan(sim.now + self.control_path_seconds, plan)
        elif adopt:
            self.adopt(sim, plan)

    def adopt(self, sim: SimView, plan: Plan) -> None:
        self.adopted += 1
        for op in self.ops:  # a new plan supersedes the operations not started yet
            if self.status.get(op.id) == "queued":
                self.status[op.id] = "superseded"
        prefix = f"p{self.adopted}-"
        self.ops = []
        for op in plan.operations:  # the plan is this policy's alone: name its operations in place
            op.id = prefix + op.id
            op.depends_on = [prefix + d for d in op.depends_on]
            self.ops.append(op)
            self.status[op.id] = "queued"
        self.queued = list(self.ops)
        self.target = {key: nbytes for key, nbytes in plan.placement.items() if key[1].tier is Tier.GPU}
        self.keep = set(self.target)
        # a group whose weights are complete already (shards left by an earlier engine) gets no promote:
        # serve from it now, or the plan's regroup would wait for a copy that never comes
        for obj in {o for o, _ in self.target if o.kind is Kind.WEIGHTS}:
            if obj.precision is not None:  # (weights always name theirs)
                self._serve_planned_group(sim, obj, obj.precision)
        self.on_dispatch(sim)

    def on_evicted(self, sim: SimView, obj: StateObject, loc: Location) -> None:
        if obj.kind is Kind.EXPERTS:
            self.evicted[(obj, loc)] = sim.now

    def _evicted_lately(self, sim: SimView, obj: StateObject, loc: Location) -> bool:
        """Experts the engine evicted from this GPU within the window (a plan does not bring them back yet)."""
        return sim.now - self.evicted.get((obj, loc), float("-inf")) < (self.min_residency_seconds or 0.0)

    def _settled(self, sim: SimView, obj: StateObject, loc: Location) -> bool:
        """What a plan may not take off this GPU yet: no undo of recent arrivals, keep-warm of served weights."""
        if obj.kind is Kind.KV or loc.tier is not Tier.GPU:
            return False
        if any(r.model not in sim.models for r in sim.waiting):
            return False  # hysteresis holds back speculative moves, never the room a waiting request needs
        window = self.min_residency_seconds or 0.0
        if obj.kind is Kind.EXPERTS:
            return sim.now - self.arrived.get((obj, loc), float("-inf")) < window
        state = sim.models.get(obj.model)
        serving = state is not None and state.precision == obj.precision and any(g.id == loc.id for g in state.gpus)
        if not serving:
            return False  # a stale shard (the model moved to another group) may always go
        recent = max(self.arrived.get((obj, loc), float("-inf")), sim.last_used.get(obj, float("-inf")))
        return sim.now - recent < window

    # -- executing operations ----------------------------------------------------

    def on_dispatch(self, sim: SimView) -> None:
        progressed = bool(self.queued)
        while progressed:
            progressed = False
            still: list[Operation] = []
            for op in self.queued:
                if self.status.get(op.id) != "queued":
                    continue
                outcome = None
                if not any(self.status.get(d) in ("queued", "started") for d in op.depends_on):
                    outcome = self._start(sim, op)
                if outcome is None:
                    still.append(op)
                    continue
                self.status[op.id] = outcome
                progressed = progressed or outcome != "started"
            self.queued = still

    def _busy_kv(self, sim: SimView, obj: StateObject) -> bool:
        session = sim.sessions.get(obj.session) if obj.session else None
        return session is not None and session.request is not None and session.request.model == obj.model

    def _start(self, sim: SimView, op: Operation) -> str | None:
        """Hand an operation to the executor unless a rule holds it back: 'started', 'done' / 'failed' at
        once, or None to wait for room."""
        obj, source, dest = op.object, op.source, op.dest
        if obj.kind is Kind.KV and (source is None or self._busy_kv(sim, obj)):
            return "done"  # the engine readies the KV of requests it serves (restore or re-prefill)
        if source is not None and (op.action is Action.DROP or not op.keep_source) and self._settled(sim, obj, source):
            return "failed"  # hysteresis: it arrived or served too recently to leave this GPU
        if dest is not None and dest.tier is Tier.GPU and self._evicted_lately(sim, obj, dest):
            return "failed"  # hysteresis: the engine gave this room to requests within the window
        return self.act.apply(op, partial(self._done, sim))

    def _done(self, sim: SimView, op: Operation, transfer: Transfer) -> None:
        if self.status.get(op.id) in ("started", "superseded"):
            self.status[op.id] = "done"
        obj, dest = op.object, transfer.dest
        if dest.tier is Tier.GPU:
            self.arrived[(obj, dest)] = sim.now
        if obj.kind is Kind.WEIGHTS and obj.precision is not None and dest.tier is Tier.GPU:
            self._serve_from_plan(sim, obj, obj.precision, op.node)

    def _serve_from_plan(self, sim: SimView, obj: StateObject, precision: str, node: str) -> None:
        """Weights complete on the group the plan chose: serve from there (a new engine on that group).

        Requests already running finish where they are; the next ones start on the new group.
        """
        c = sim.cluster
        if self._serve_planned_group(sim, obj, precision):
            return
        if obj.model not in sim.models and c.node_bytes(obj, node, Tier.GPU) >= c.full_size(obj):
            gpus = tuple(
                sim.problem.gpus[g] for g in sim.problem.nodes[node].gpus if c.bytes_of(obj, Location.gpu(g)) > 0
            )
            self.act.adopt_weights(obj.model, node, precision, gpus)

    def _serve_planned_group(self, sim: SimView, obj: StateObject, precision: str) -> bool:
        """Serve `obj` from the GPUs the adopted plan puts it on, if every shard is there (True: it is or will be)."""
        planned = [(loc, nbytes) for (o, loc), nbytes in self.target.items() if o == obj]
        if not planned or any(sim.cluster.bytes_of(obj, loc) < nbytes for loc, nbytes in planned):
            return False
        gpus = tuple(sorted((sim.problem.gpus[loc.id] for loc, _ in planned), key=lambda g: g.id))
        state = sim.models.get(obj.model)
        if state is not None and (state.status != "ready" or state.precision == precision and state.gpus == gpus):
            return True  # served there already, or another load of it is on the way
        self.act.serve_from(obj.model, sim.problem.gpus[planned[0][0].id].node, precision, gpus)
        return True


class StatebudgetGroupsPolicy(StatebudgetPolicy):
    """`statebudget-groups`: the same planner on the operator's engine groups (`groups.operator_partition`, the
    config `sleep-router` and `swap-ttl` run): each node declares an engine only for the models assigned to
    it, on their groups, so the plans choose which engines run, sleep or stop, and where KV and experts
    live, but start no engine on another group. What moving engines between groups adds or costs is the
    difference from `statebudget` (docs/evidence.md)."""

    name = PolicyName.STATEBUDGET_GROUPS

    def deployment(self, scenario: Scenario) -> Scenario:
        return declared_on_groups(scenario, operator_partition(problem_from_scenario(scenario)))
