"""The gateway in front of the simulated engines: session-affine routing and idle-card warm-ups.

The gateway (`clients/gateway/`) holds every session's prompts, so it can do two things a residency policy
cannot, and this module replays them beside any policy (`GatewayMode`):

* **Affinity** routes a session's request to the engine instance that holds its KV where a model has more
  than one (`replicas.py`: the replay's further instances of a model, each under a model id of its own,
  and the choice among them). A model with one instance serves from one group (`SimState.models` is keyed
  by model; an instance on another group sleeps or is stopped, and `Simulator._start` drops the KV left
  outside the serving group), so every request of it already reaches the only instance that can hold its
  KV: there `affinity` replays exactly as `none` does.
* **Warm-ups**: while a session sits in a tool call, the gateway prefills its known history on the model
  it is predicted to hand off to (a 1-token request with prefix caching on), so that the hand-off finds
  that prefix's KV computed. Which warm-ups to run is the planner's rule the product publishes in the
  route table (`planner/gateway_directives.decide_directives`, `decided: true`), fed the same switch
  predictor (`planner/predictor.SwitchPredictor`, given every turn as the `statebudget` policy gives it),
  so the replay and the product share one decision (the service's default target, `priced`: the warm-ups the
  objective values above the HBM price of their KV). Carried out as `clients/gateway/warmups.py` does:

  - a warm-up starts only on cards with nothing else to do: no request of any session running or waiting
    on them (the directive's rule), no prefill on them and no copy into them (the replay's view of the
    plan's open operations), and within the free KV room of every card of the group;
  - it costs what a real prefill costs (`costs.prefill_seconds` on the serving group, a MoE's experts off its
    node's GPUs included, one prefill at a time on a card: warm-ups on one card run one after another), and its KV counts in GPU
    bytes as any KV does from the moment it starts;
  - it gives way at once: a request waiting for, or running on, any of its cards, a copy into them, or
    the session's own next request cancels it, and a cancelled warm-up frees its KV and keeps nothing (an
    engine's prefix cache may keep blocks an aborted request computed: the replay does not count them);
  - a directive is carried out once per tool call: one cancelled is not tried again on that instance
    until the session's next tool call;
  - a warm-up that completes leaves the session's KV on the model's group covering its history, as a
    served turn would (written through to host DRAM where the engine does that for turns), and the
    policy keeps or evicts it as any idle KV.

A warm-up is *used* when the session's next request goes to the warmed model and finds that KV still on
the group; the hand-off then prefills nothing of the history (only what the history grew by since).

`affinity+eager-warmups` is an ablation, a gateway that warms regardless of load: the same directives
decided as if every card were idle, each warm-up taking its cards in their prefill order as a real prefill
does (later real prefills wait behind it), never cancelled but by its KV's eviction or its engine leaving.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from planner_service.domain.state import Location, StateObject, Tier
from planner_service.planner import costs
from planner_service.planner.gateway_directives import (
    DirectiveLimits,
    InstanceView,
    SessionView,
    WarmupPricing,
    decide_directives,
)
from planner_service.planner.greedy import split_evenly
from planner_service.planner.predictor import SwitchPredictor

if TYPE_CHECKING:
    from planner_service.sim.state import ModelState, SessionState, SimRequest, SimState


# the service's defaults for the directives (settings.py: `warmups_per_instance`, `warmup_min_probability`,
# `warmup_target`; the simulator may not import the service's settings, tests/sim/test_gateway.py checks they agree)
DEFAULT_LIMITS = DirectiveLimits(max_warmups_per_instance=2, min_probability=0.5, target="priced")


class GatewayMode(StrEnum):
    NONE = "none"
    AFFINITY = "affinity"
    WARMUPS = "affinity+warmups"
    # an ablation: warm-ups by the same directives that neither wait for idle cards nor give way, each taking its
    # cards as a real prefill does (a gateway that warms regardless of load)
    EAGER = "affinity+eager-warmups"


@dataclass(slots=True)
class Warmup:
    session: str
    model: str
    instance: str
    epoch: int
    gpus: tuple[str, ...]
    tokens: int
    shards: list[tuple[Location, int]]  # the KV bytes it allocated on each card
    starts_at: float
    ends_at: float
    live: bool = True


@dataclass
class GatewayCounts:
    started: int = 0
    completed: int = 0
    used: int = 0  # completed, and the session's next request found the KV on the warmed model
    cancelled: int = 0
    unused: int = 0  # completed, but the next request went elsewhere or the KV had been evicted
    prefill_seconds: float = 0.0  # card time of completed warm-ups
    cancelled_seconds: float = 0.0  # card time cancelled warm-ups ran before giving way
    tokens_warmed: int = 0
    used_tokens: int = 0  # history tokens the used warm-ups spared their hand-offs
    by_cause: dict[str, int] = field(default_factory=dict)  # cancellations by what cancelled them

    def to_json(self) -> dict[str, Any]:
        return {
            "warmups_started": self.started,
            "warmups_completed": self.completed,
            "warmups_used": self.used,
            "warmups_cancelled": self.cancelled,
            "warmups_unused": self.unused,
            "warmup_prefill_seconds": round(self.prefill_seconds, 3),
            "cancelled_prefill_seconds": round(self.cancelled_seconds, 3),
            "tokens_warmed": self.tokens_warmed,
            "used_tokens": self.used_tokens,
            "cancelled_by": dict(sorted(self.by_cause.items())),
        }


def instance_id(model: str, state: ModelState) -> str:
    return f"{model}@{state.node}#{state.epoch}"


class GatewayModel:
    """The gateway's effect on a replay (module doc); the simulator calls it at its events."""

    def __init__(
        self,
        sim: SimState,
        mode: GatewayMode | str,
        limits: DirectiveLimits = DEFAULT_LIMITS,
        *,
        compute_free_at: dict[str, float],
        write_through: Callable[[StateObject, str, int], None] | None = None,
        save_seconds: Callable[[StateObject, ModelState, int], float] | None = None,
    ) -> None:
        """`compute_free_at`: the simulator's per-GPU end of the prefill in progress; `write_through`: how a
        prefill's KV is stored to host DRAM, and `save_seconds` how long its step waits for that store (None where
        the policy keeps no such copy)."""
        self.sim = sim
        self.compute_free_at = compute_free_at
        self.write_through = write_through
        self.save_seconds = save_seconds
        self.mode = GatewayMode(mode)
        self.limits = limits
        self.warmups_on = self.mode in (GatewayMode.WARMUPS, GatewayMode.EAGER)
        self.eager = self.mode is GatewayMode.EAGER
        self.predictor = SwitchPredictor(list(sim.problem.models), sim.scenario.predictor)
        self.counts = GatewayCounts()
        self.running: dict[str, Warmup] = {}  # session -> its warm-up in progress
        # session -> what its completed warm-ups left since its last request: (model, engine epoch, tokens) each (the
        # "handoff" target may warm the next likeliest model once the first holds the KV)
        self.warmed: dict[str, list[tuple[str, int, int]]] = {}
        self.tried: dict[str, set[str]] = {}  # session -> instances tried in its current tool call
        self.card_free_at: dict[str, float] = {}  # per GPU: when the warm-ups queued on it end
        self.dirty = False

    # -- what the simulator tells it ------------------------------------------------------------------------

    def observe(self, session: SessionState, req: SimRequest) -> None:
        """A turn of the trace arrived: the predictor learns from it as the planner's does."""
        if not self.warmups_on or session.requested_model is None:
            return
        self.predictor.observe_handoff(req.t, session.requested_model, req.model)
        self.predictor.observe_turn_gap(req.t, max(0.0, req.t - session.last_t))

    def on_session_end(self, session: SessionState) -> None:
        """The session's trace ended: no next request came after its last one (the predictor's `next_turn`)."""
        if self.warmups_on and session.requested_model is not None:
            self.predictor.observe_session_end(self.sim.now, session.requested_model)

    def on_admit(self, req: SimRequest) -> None:
        """The session's next request arrived: its tool call is over, its warm-up in progress is moot."""
        if not self.warmups_on:
            return
        self.tried.pop(req.session, None)
        running = self.running.get(req.session)
        if running is not None and not self.eager:
            self._cancel(running, "own request")

    def on_start(self, req: SimRequest, covered_tokens: int) -> None:
        """A request starts with `covered_tokens` of its history's KV on its group: was it warmed for?"""
        for model, epoch, tokens in self.warmed.pop(req.session, ()):
            if model == req.model and epoch == req.engine and covered_tokens >= tokens:
                self.counts.used += 1
                self.counts.used_tokens += tokens
            else:
                self.counts.unused += 1

    def changed(self) -> None:
        """A session entered a tool call, a card went idle or an engine came up: look for warm-ups again."""
        self.dirty = True

    # -- giving way -----------------------------------------------------------------------------------------

    def give_way(self) -> None:
        """Cancel every warm-up whose cards something real wants (module doc); run before requests start."""
        if not self.running:
            return
        sim = self.sim
        wanted: set[str] = set()
        for req in sim.waiting:
            state = sim.models.get(req.model)
            if state is not None:
                wanted.update(g.id for g in state.gpus)
        for (model, _), n in sim.running_on.items():
            state = sim.models.get(model)
            if n and state is not None:
                wanted.update(g.id for g in state.gpus)
        copying = {t.dest.id for t in sim.cluster.transfers.values() if t.dest.tier is Tier.GPU}
        for warmup in list(self.running.values()):
            state = sim.models.get(warmup.model)
            kv = StateObject.kv(warmup.model, warmup.session)
            if state is None or state.epoch != warmup.epoch or state.status != "ready":
                self._cancel(warmup, "engine left")
            elif any(sim.cluster.bytes_of(kv, loc) < n for loc, n in warmup.shards):
                self._cancel(warmup, "kv evicted")
            elif self.eager:
                continue  # the ablation never gives way
            elif wanted.intersection(warmup.gpus):
                self._cancel(warmup, "request")
            elif copying.intersection(warmup.gpus):
                self._cancel(warmup, "copy")

    def _end(self, warmup: Warmup) -> StateObject | None:
        """Mark the warm-up ended; its KV object, or None where it had ended already."""
        if not warmup.live:
            return None
        warmup.live = False
        del self.running[warmup.session]
        return StateObject.kv(warmup.model, warmup.session)

    def _cancel(self, warmup: Warmup, cause: str) -> None:
        kv = self._end(warmup)
        if kv is None:
            return
        sim = self.sim
        for loc, _ in warmup.shards:
            if sim.cluster.bytes_of(kv, loc):
                sim.cluster.remove(kv, loc)
        sim.gpu_tokens[kv] = 0  # it never covered anything (a warmed session has no other KV of the model there)
        self.counts.cancelled += 1
        self.counts.cancelled_seconds += max(0.0, min(sim.now, warmup.ends_at) - warmup.starts_at)
        self.counts.by_cause[cause] = self.counts.by_cause.get(cause, 0) + 1
        for g in warmup.gpus:  # the card's warm-up queue ends with the last warm-up still on it
            self.card_free_at[g] = max((w.ends_at for w in self.running.values() if g in w.gpus), default=sim.now)
        self.dirty = True

    # -- starting and finishing ------------------------------------------------------------------------------

    def consider(self) -> None:
        """Decide the warm-ups by the planner's rule and start those that can run now."""
        if not self.warmups_on or not self.dirty:
            return
        self.dirty = False
        sim = self.sim
        # the cards something real wants: a request waiting for or running on them, a prefill, a copy into them
        queued = {g for g, at in self.compute_free_at.items() if at > sim.now}
        queued.update(t.dest.id for t in sim.cluster.transfers.values() if t.dest.tier is Tier.GPU)
        if self.eager:
            queued = set()  # the ablation sees every card as idle
        wanted = set(queued)
        for s in sim.sessions.values():
            state = sim.models.get(s.request.model) if s.request is not None and not self.eager else None
            if state is not None:
                wanted.update(g.id for g in state.gpus)
        instances: list[InstanceView] = []
        by_id: dict[str, tuple[str, ModelState]] = {}
        for model, state in sorted(sim.models.items()):
            iid = instance_id(model, state)
            by_id[iid] = (model, state)
            instances.append(InstanceView(iid, model, tuple(g.id for g in state.gpus), state.status == "ready"))
        if not any(i.routable and not wanted.intersection(i.gpus) for i in instances):
            return  # no idle card: the rule would direct nothing (a shortcut, not a second rule)
        sessions: list[SessionView] = []
        in_tool_call: dict[str, str] = {}
        kv_holders: dict[tuple[str, str], frozenset[str]] = {}
        for sid, s in sim.sessions.items():
            if s.ended or s.model is None:
                continue
            if s.request is not None:
                # a busy session occupies its model's cards (the replay's one instance of it holds its KV); the
                # ablation does not look
                busy = not self.eager
                sessions.append(SessionView(sid, s.request.model, busy, False, s.history_tokens, None, False, s.slo))
                continue
            holder = None
            for iid, (m, state) in by_id.items():
                if sim.cluster.bytes_of(StateObject.kv(m, sid), Location.gpu(state.gpus[0].id)):
                    kv_holders[(sid, m)] = frozenset((iid,))
                    if m == s.model:
                        holder = iid
            if sid in self.running:
                kv_holders[(sid, self.running[sid].model)] = frozenset((self.running[sid].instance,))
            sessions.append(SessionView(sid, s.model, False, True, s.history_tokens, holder, holder is not None, s.slo))
            in_tool_call[sid] = s.model
        rows = {m: self.predictor.next_model_probs(m, sim.now) for m in set(in_tool_call.values())}
        next_model = {sid: rows[m] for sid, m in in_tool_call.items()}
        free = {g: sim.cluster.free(Location.gpu(g)) for g in sim.problem.gpus}
        kvpt = {m: spec.kv_bytes_per_token for m, spec in sim.problem.models.items()}
        # the replay allocates KV in its cards' free room (no engine pool of fixed size: sim/instances.py); a
        # hand-off restores from the serving node's host DRAM what a turn wrote through there (Simulator._start)
        restorable: dict[tuple[str, str], dict[str, tuple[Tier, int]]] = {}
        for sid in in_tool_call:
            for model, state in sim.models.items():
                kv = StateObject.kv(model, sid)
                if sim.cluster.bytes_of(kv, Location.host(state.node)):
                    tokens = min(sim.host_tokens.get(kv, 0), sim.computed_tokens.get(kv, 0))
                    restorable[(sid, model)] = {state.node: (Tier.HOST, tokens * kvpt[model])}
        turns = {m: self.predictor.next_turn(m, sim.c.horizon_seconds, sim.now) for m in rows}
        pricing = WarmupPricing(
            sim.problem.models, sim.problem.gpus, sim.c, nodes=sim.problem.nodes, restorable=restorable, next_turn=turns
        )
        _, directives = decide_directives(
            instances, sessions, next_model, kv_holders, frozenset(queued), free, kvpt, self.limits, pricing
        )
        # the directives count the warm-ups they give at once; those already running count against the same cap
        per_instance: dict[str, int] = {}
        for w in self.running.values():
            per_instance[w.instance] = per_instance.get(w.instance, 0) + 1
        for d in directives:
            if d.session in self.running or d.instance in self.tried.get(d.session, ()):
                continue
            if per_instance.get(d.instance, 0) >= self.limits.max_warmups_per_instance:
                continue
            per_instance[d.instance] = per_instance.get(d.instance, 0) + 1
            model, state = by_id[d.instance]
            self.tried.setdefault(d.session, set()).add(d.instance)
            self._start(d.session, model, state, d.instance, d.tokens)

    def _start(self, session: str, model_id: str, state: ModelState, iid: str, tokens: int) -> None:
        sim = self.sim
        model = sim.problem.models[model_id]
        kv = StateObject.kv(model_id, session)
        shards: list[tuple[Location, int]] = []
        for g, nbytes in zip(state.gpus, split_evenly(tokens * model.kv_bytes_per_token, len(state.gpus)), strict=True):
            loc = Location.gpu(g.id)
            if nbytes > sim.cluster.free(loc):  # the directive counted room per card; keep the replay's own check
                for placed, n in shards:
                    sim.cluster.remove(kv, placed, n)
                return
            sim.cluster.add(kv, loc, nbytes)
            shards.append((loc, nbytes))
        start = max(sim.now, *(self.card_free_at.get(g.id, 0.0) for g in state.gpus))
        if self.eager:  # it queues with the real prefills, and they queue behind it
            start = max(start, *(self.compute_free_at[g.id] for g in state.gpus))
        f, in_dram = sim.expert_share(model_id, state)  # the history from its start, at the node's expert share
        ends = start + costs.prefill_seconds(tokens, 0, model, state.gpus, sim.c, f, in_dram)
        if self.save_seconds is not None:  # a warm-up is a prefill: its step waits for LMCache's store as well
            ends += self.save_seconds(kv, state, tokens)
        for g in state.gpus:
            self.card_free_at[g.id] = ends
            if self.eager:
                self.compute_free_at[g.id] = ends
        warmup = Warmup(
            session, model_id, iid, state.epoch, tuple(g.id for g in state.gpus), tokens, shards, start, ends
        )
        self.running[session] = warmup
        self.counts.started += 1
        sim.push(ends, "call", lambda: self._finish(warmup))

    def _finish(self, warmup: Warmup) -> None:
        self.give_way()  # what arrived at this instant wins the card first
        kv = self._end(warmup)
        if kv is None:
            return
        sim = self.sim
        sim.gpu_tokens[kv] = max(sim.gpu_tokens[kv], warmup.tokens)
        sim.computed_tokens[kv] = max(sim.computed_tokens[kv], warmup.tokens)
        sim.touch(kv)
        state = sim.models[warmup.model]
        if self.write_through is not None and sim.engines.keeps_kv_in_host(state.node, warmup.model):
            self.write_through(kv, state.node, warmup.tokens)
        self.warmed.setdefault(warmup.session, []).append((warmup.model, warmup.epoch, warmup.tokens))
        self.counts.completed += 1
        self.counts.tokens_warmed += warmup.tokens
        self.counts.prefill_seconds += warmup.ends_at - warmup.starts_at
        self.dirty = True

    def report(self) -> dict[str, Any]:
        """The warm-ups' counts; a warm-up whose session never sent another request was not used."""
        self.counts.unused += sum(len(w) for w in self.warmed.values())
        self.warmed.clear()
        return {"mode": str(self.mode), **self.counts.to_json()}
