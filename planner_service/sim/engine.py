"""The discrete-event simulator: a trace replayed through a simulated cluster under one policy.

What is modelled (the same cost model as the planner, `planner/costs.py`):

* **Memory** (`cluster.py`): capacities per GPU / host / NVMe hold at every
  instant; a transfer reserves its destination bytes when it starts, so a
  promote waits for room. Evicting from a GPU is a *drop*, allowed only when a
  complete copy of weights / experts stays below on the node (KV may always
  be dropped: it can be re-prefilled). Loads from NVMe stage through pinned
  host DRAM and leave the copy there when the node has room (ServerlessLLM's
  DRAM cache), for every policy alike.
* **Bandwidth** (`cluster.py`): every GPU's PCIe direction and every node's
  NVMe read/write are shared by processor sharing.
* **Engines** (`instances.py`, the engine model of `domain/engines.py`):
  a model serves from an engine instance of its node's declared kind
  (`local` where the node declares none). Bringing it onto a group is a
  cold start (`cold_start_fixed_seconds` after the copy, 30 s by default:
  perf_anchors.md section 1) or a wake of the instance sleeping there
  (level 1 from its host backup, level 2 reloading from disk); taking it
  off is a sleep (its GPU KV freed, its CUDA context left on the group: the
  one call frees its weights and GPU experts on every GPU of the group, so
  the context it held while it ran keeps its room where a plan drops the
  shards one by one) or, where its kind cannot sleep, a stop. A sleeping engine's residue gives
  way to loads (the engine stops) unless it is adopted. On `vllm` and
  `sglang` a MoE's GPU expert share is fixed while the instance runs.
* **Compute**: prefill is compute-bound (`costs.prefill_seconds` on the serving
  group: per token, a tensor-parallel group's all-reduce included, plus the
  attention, which grows with the context, plus a MoE's routed experts off its
  node's GPUs, streamed over PCIe once per chunk or computed by the CPU where
  host DRAM holds them all, the cheaper: a prefill queued behind its own engine's
  shares its passes, one alone pays each pass it touches whole) and serialised per GPU
  (one prefill at a time on a card, which models sharing the card take in turn: a
  prefill starts when every card of its group is free); decode is memory-bound
  (`costs.decode_seconds_per_token`): concurrent requests of one model on its
  group share decode steps (a batch), each output token one step, which reads
  the weights once, every running request's KV and the routed experts the
  batch's tokens touch from HBM, plus the group's all-reduce of the batch's
  tokens, plus the MoE miss: the experts touched off GPU streamed over PCIe or,
  where host DRAM holds the experts, computed by the CPU (KTransformers), the
  cheaper, the node's CPU shared by the requests of every engine whose misses
  it computes. A request is priced with the batch its engine runs when its
  prefill is scheduled; a batch that changes while it decodes is not re-priced.
* **KV**: a session's history H grows by each turn's input + output tokens.
  Model M's KV for the session covers the history up to M's last turn in it
  while retained. A request allocates its whole KV footprint
  (H + input + output tokens) on the serving group when it starts, then makes
  the uncovered history ready by restoring from host DRAM (shared PCIe) or by
  re-prefilling it, whichever `costs.kv_ready` (the planner's rule) says is
  cheaper. Where the policy keeps LMCache's copy in host DRAM, the prefill's
  step stores the prompt's whole 256-token chunks there and waits for the
  D2H copy before its first token; decoded tokens are not stored (`kv_save.py`).

**Sessions** run one turn at a time and, by default, in a closed loop: an
agent sends its next turn only once the previous answer is back. A trace's
gaps run from one turn's start to the next's (the synthetic ones are fitted
to TraceLab's round-to-round gaps, `synth.py`; imported logs record arrival
times), so they hold the turn's own generation time as the trace saw it
plus the agent's tool and think time. The next turn (or the end record) is
therefore due its trace gap after the previous turn *arrived*, and never
before that turn's answer: turn k+1 arrives at max(t[k+1] + lag[k], done[k])
with lag[k] = arrival[k] - t[k] (how much later than in the trace turn k
arrived). A replay that answers within the gap keeps the trace's times; one
that answers later leaves the agent no think time and the lag grows by the
overrun, which is never the gap and the service time both. At most the
trace's concurrency of sessions is open at once (`slots.py`): a session that
arrives while every seat is taken starts when one ends, its timeline moved
by the wait. A sub-agent with a context of its own (a session whose first
request names a `parent`) is one agent with the session that handed off to
it: the workflow runs one turn at a time and shares one lag, so a hand-off
to a sub-agent (or back) waits for the turn before it as a session's turn
does. With `closed_loop=False` a turn
arrives at its trace time and waits only for the previous turn to end; a
slow cluster then falls ever further behind the trace and runs more
sessions at once than the trace has.

**Switch latency** of a request = from its arrival until its model's weights
are on GPU and ready (the engine's cold start or wake included) and the session's history KV
is ready to prefill (restore and re-prefill of the uncovered history included,
as is waiting for room and for the group's prefill queue).
**TTFT** = switch latency + prefill of the new input tokens. Each request keeps where its switch
latency went (`state.SWITCH_PARTS`): the wait before it starts is split by what its model's engine
was doing meanwhile (nothing: placement; starting: cold start; waking: wake; up: queue for KV room),
then KV restore, the prefill queue on its cards and the re-prefill; the parts sum to the switch latency.

**Failed requests**: a request that has not started `request_timeout_seconds` after its arrival (600 s,
the OpenAI Python client's default read timeout: `DEFAULT_TIMEOUT = httpx.Timeout(timeout=600.0,
connect=5.0)` in openai-python `src/openai/_constants.py`; no byte comes back before the first token)
is answered as failed: the agent's next turn follows (its history unchanged), and the replay goes on.
A request whose prompt (the session's history and its input) leaves no room for one output token in its
model's maximum context (`ModelSpec.max_context_tokens`, the engine's `--max-model-len`) fails at once, as
the engines refuse it with an error before queueing it: vLLM's `_validate_model_input` in
vllm/v1/engine/processor.py (tests/v1/e2e/test_context_length.py: a prompt of max_model_len tokens is refused),
SGLang's `validate_input_length` in python/sglang/srt/managers/utils.py (unless launched with
`--allow-auto-truncate`). The agent then compacts its context and sends the turn again at once, as the
synthetic trace's agents do at their own limit (`synth.py`): the session's history starts afresh, so no KV
of it, on any model, covers the new prompt (`compacted`). Only an input alone beyond the maximum context
fails (`too_long`).
A request no engine of a fixed deployment can hold (a partition whose group is too small for its
KV) thus costs its session the timeout instead of stopping the replay; the metrics count failed
requests per policy and compute latencies over the served ones.

A policy (`policies/`) decides what moves and what is evicted; the mechanism
here is the same for all of them.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from planner_service.domain.engines import EngineConstants
from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.problem import Problem
from planner_service.domain.scenario import Scenario
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.planner import costs
from planner_service.planner.gateway_directives import DirectiveLimits
from planner_service.planner.greedy import split_evenly
from planner_service.sim import kv_save
from planner_service.sim.cluster import Transfer
from planner_service.sim.executor import KV_HEADROOM, Executor, SimulationError
from planner_service.sim.gateway import DEFAULT_LIMITS, GatewayMode, GatewayModel
from planner_service.sim.replicas import Router, replicate
from planner_service.sim.slots import SessionSlots, trace_concurrency
from planner_service.sim.state import ModelState, SessionState, SimRequest, SimState

REQUEST_TIMEOUT_SECONDS = 600.0  # the OpenAI Python client's default read timeout (module doc)
from planner_service.sim.trace import TraceEnd, TraceRecord, TraceRequest
from planner_service.sim.view import SimView

__all__ = [
    "KV_HEADROOM",
    "REQUEST_TIMEOUT_SECONDS",
    "ModelState",
    "PolicyHooks",
    "SessionState",
    "SimRequest",
    "SimResult",
    "SimulationError",
    "Simulator",
    "base_problem",
    "simulate",
]


class PolicyHooks(Protocol):
    """What the engine asks of a policy (`policies/base.py` holds the defaults every policy builds on).

    A policy reads the simulated cluster through a `SimView` and acts only through the `Executor`
    it is given at set-up; the engine calls these hooks and knows no policy class, so the policies
    depend on the engine and not the other way round.
    """

    @property
    def name(self) -> str: ...

    @property
    def kv_offload(self) -> bool:
        """Keep LMCache's copy of every prompt's KV in host DRAM (`kv_save.py`)."""
        ...

    @property
    def sleeps_engines(self) -> bool:
        """Engines taken off their GPUs sleep where their kind allows (False: they stop, as llama-swap's do)."""
        ...

    def deployment(self, scenario: Scenario) -> Scenario: ...

    def setup(self, sim: SimView, act: Executor) -> None: ...

    def observe(self, sim: SimView, session: SessionState, req: SimRequest) -> None: ...

    def on_arrival(self, sim: SimView, req: SimRequest) -> None: ...

    def on_waiting(self, sim: SimView, req: SimRequest) -> None: ...

    def on_start(self, sim: SimView, req: SimRequest) -> None: ...

    def on_done(self, sim: SimView, req: SimRequest) -> None: ...

    def on_tick(self, sim: SimView) -> None: ...

    def on_session_end(self, sim: SimView, session: SessionState) -> None: ...

    def on_dispatch(self, sim: SimView) -> None: ...

    def on_plan_event(self, sim: SimView, payload: object) -> None: ...

    def on_evicted(self, sim: SimView, obj: StateObject, loc: Location) -> None: ...

    def on_model_ready(self, sim: SimView, model: str) -> None: ...

    def on_stuck(self, sim: SimView, req: SimRequest) -> None: ...

    def kv_reserve(self, sim: SimView, model: str) -> int: ...

    def victim_key(self, sim: SimView, obj: StateObject, loc: Location) -> tuple | None: ...


@dataclass
class SimResult:
    policy: str
    requests: list[SimRequest]
    duration_seconds: float
    gpu_byte_seconds: float
    peak_gpu_bytes: int
    warm_idle_byte_seconds: float
    bytes_moved: int
    operations: int
    planner_seconds: list[float]
    violations: int
    timeline: list[tuple[float, int]]
    link_peak_ratio: float  # max over links of peak total rate / bandwidth (<= 1)
    fallback_loads: int = 0
    extra: dict = field(default_factory=dict)


def base_problem(scenario: Scenario) -> Problem:
    """The scenario's cluster and catalog, with only the copies below GPU and no sessions."""
    data = scenario.model_dump(mode="json")
    data["sessions"] = []
    data["residency"] = [r for r in data["residency"] if r["location"]["tier"] != "gpu" and r["object"]["kind"] != "kv"]
    return problem_from_scenario(Scenario.model_validate(data))


class Simulator(SimState):
    """The event loop: trace records, requests and compute; the policy decides, the executor applies."""

    def __init__(
        self,
        scenario: Scenario,
        records: Sequence[TraceRecord],
        policy: PolicyHooks,
        *,
        seed: int = 0,
        tick_seconds: float = 60.0,
        on_progress: Callable[[float], None] | None = None,
        expert_miss_decode: bool = True,
        closed_loop: bool = True,
        engine_constants: EngineConstants | None = None,
        request_timeout_seconds: float = REQUEST_TIMEOUT_SECONDS,
        gateway: GatewayMode | str = GatewayMode.NONE,
        gateway_limits: DirectiveLimits = DEFAULT_LIMITS,
        replicas: Mapping[str, int] | None = None,
    ) -> None:
        """`replicas`: model -> how many engine instances of it the cluster runs (`replicas.py`; default one)."""
        scenario = policy.deployment(replicate(scenario, replicas or {}))
        super().__init__(scenario, base_problem(scenario), records, engine_constants)
        self.policy = policy
        self.seed = seed
        self.tick_seconds = tick_seconds
        self.on_progress = on_progress
        self.expert_miss_decode = expert_miss_decode  # False: decode ignores routed experts off GPU
        self.closed_loop = closed_loop  # False: turns are due at their trace times
        if not request_timeout_seconds > 0:
            raise ValueError(f"request_timeout_seconds: must be > 0, got {request_timeout_seconds}")
        self.request_timeout_seconds = request_timeout_seconds
        # closed loop: at most the trace's concurrency of sessions open at once (`slots.py`)
        self.slots = SessionSlots(records, trace_concurrency(records)) if closed_loop else None
        self._xfer_gen = 0
        self._xfer_at: float | None = None
        self.deadlock_breaks = 0
        self.compute_free_at: dict[str, float] = defaultdict(float)  # per GPU: when its current prefill ends
        self.compute_engine: dict[str, tuple[str, int]] = {}  # per GPU: the engine of its latest prefill
        # per (model, engine epoch): the running requests' mean decode contexts, summed (a step reads every KV)
        self.context_on: dict[tuple[str, int], float] = defaultdict(float)
        self._gpu_byte_seconds = 0.0
        self._idle_byte_seconds = 0.0
        self._last_sample = 0.0
        self.timeline: list[tuple[float, int]] = [(0.0, 0)]
        self._queues: dict[str, deque[SimRequest | TraceEnd]] = defaultdict(deque)  # per session: not yet released
        self._workflow: dict[str, str] = {}  # a sub-agent's session -> the session at the root of its hand-offs
        self._members: dict[str, list[str]] = {}  # a root session with sub-agents -> its workflow's sessions
        self.kv_offload = policy.kv_offload
        self.view = SimView(self, policy)  # what the policy reads of the cluster
        self.executor = Executor(self, self.view, policy)  # the one place that changes it for the policy
        # the gateway in front of the engines: affinity and warm-ups (`gateway.py`)
        self.gateway = GatewayModel(
            self,
            gateway,
            gateway_limits,
            compute_free_at=self.compute_free_at,
            write_through=self.write_through if self.kv_offload else None,
            save_seconds=self.save_seconds if self.kv_offload else None,
        )
        # which instance of a model with several each request goes to (`replicas.py`)
        self.router = Router(self, replicas or {}, affinity=self.gateway.mode is not GatewayMode.NONE, seed=seed)

    # -- events --------------------------------------------------------------

    def run(self) -> SimResult:
        for i, rec in enumerate(self.records):
            self.push(rec.t, "record", i)
        end_of_trace = self.records[-1].t if self.records else 0.0
        self.policy.setup(self.view, self.executor)
        self.executor.adopted_asleep()
        for model_id in sorted(self.models):
            if self.models[model_id].status == "ready":
                self.policy.on_model_ready(self.view, model_id)  # what the policy does next to a model it placed
        if self.tick_seconds > 0:
            self.push(self.tick_seconds, "tick")
        self._reschedule_transfers()
        # each kind of event carries its own payload (`push` takes any object)
        handlers: dict[str, Callable[[Any], None]] = {
            "record": self._on_record,
            "xfer": self._on_transfers,
            "model_ready": self.executor.on_model_ready,
            "kv_restored": self._on_kv_restored,
            "done": self._on_done,
            "tick": self._on_tick,
            "release": self._on_release,
            "timeout": self._on_timeout,
            "call": lambda payload: payload(),
            "plan": lambda payload: self.policy.on_plan_event(self.view, payload),
        }
        last_progress = 0.0
        idle_ticks = 0
        while self._heap:
            at, _, kind, payload = heapq.heappop(self._heap)
            if kind == "timeout" and isinstance(payload, SimRequest) and payload.state != "waiting":
                continue  # the request started in time: its timer moves nothing, not even the clock
            if kind in ("tick", "plan"):
                idle_ticks += kind == "tick"
                stalled = self.waiting and not any(self.running.values()) and not self.cluster.transfers
                if idle_ticks > 10 and stalled and self.deadlock_breaks < 100:
                    idle_ticks = 0
                    self._break_deadlock()  # waiting requests pin each other's room: free it for the oldest
                elif self.now >= end_of_trace and (not self._busy() or idle_ticks > 10):
                    continue  # nothing left to do, or nothing but ticks for 10 ticks: deadlock, reported below
            elif kind != "xfer" or payload == self._xfer_gen:
                idle_ticks = 0
            if kind == "xfer" and payload != self._xfer_gen:
                continue
            self._sample(at)
            self.now = at
            if kind in ("done", "timeout", "model_ready"):
                self.gateway.changed()  # a tool call began, a card went idle or an engine came up
            handlers[kind](payload)
            self.dispatch()
            self._reschedule_transfers()
            if self.on_progress is not None and at - last_progress >= 60.0:
                last_progress = at
                self.on_progress(at)
        unfinished = [r for r in self.requests if r.state not in ("done", "failed")]
        if unfinished:
            r = unfinished[0]
            raise SimulationError(
                f"{len(unfinished)} request(s) never finished under policy {self.policy.name}; first: request "
                f"{r.index} of session {r.session} on {r.model} at t={r.t:.1f}s ({r.state})"
            )
        duration = max(self.now, end_of_trace)
        peak_ratio = max(
            (l.peak_rate_bytes_per_s / l.bandwidth_bytes_per_s for l in self.cluster.links.values()), default=0.0
        )
        return SimResult(
            policy=str(self.policy.name),
            requests=self.requests,
            duration_seconds=duration,
            gpu_byte_seconds=self._gpu_byte_seconds,
            peak_gpu_bytes=self.cluster.peak_gpu_bytes,
            warm_idle_byte_seconds=self._idle_byte_seconds,
            bytes_moved=self.cluster.bytes_moved,
            operations=self.executor.operations,
            planner_seconds=self.planner_seconds,
            violations=self.cluster.violations,
            timeline=self.timeline,
            link_peak_ratio=peak_ratio,
            fallback_loads=self.executor.fallback_loads,
            extra={
                "deadlock_breaks": self.deadlock_breaks,
                "engine_transitions": dict(self.executor.transitions),
                "session_seats": self.slots.seats if self.slots else None,
                "peak_open_sessions": self.slots.peak_open if self.slots else None,
                "gateway": {**self.gateway.report(), **self.router.to_json()},
            },
        )

    def _break_deadlock(self) -> None:
        """Nothing has moved for 10 ticks: evict every model no request runs on, then serve the oldest waiter."""
        self.deadlock_breaks += 1
        oldest = min(self.waiting, key=lambda r: (r.admitted_at, r.index))
        for model_id, state in sorted(self.models.items()):
            if not self.running.get(model_id) and model_id != oldest.model and state.status == "ready":
                self.executor.evict(
                    StateObject.weights(model_id, state.precision), Location.gpu(state.gpus[0].id), force=True
                )
        self.needs_kv_room.discard(oldest.model)
        serving = self.models.get(oldest.model)
        if serving is not None and not self.running.get(oldest.model) and serving.status == "ready":
            self.executor.evict(
                StateObject.weights(oldest.model, serving.precision), Location.gpu(serving.gpus[0].id), force=True
            )
        self.executor.load_model(oldest.model)

    def _busy(self) -> bool:
        return bool(self.cluster.transfers) or any(r.state not in ("done", "failed") for r in self.requests[-50:])

    def _sample(self, at: float) -> None:
        dt = at - self._last_sample
        if dt > 0:
            self._gpu_byte_seconds += self.cluster.gpu_bytes * dt
            idle = sum(b for m, b in self.cluster.model_gpu_bytes.items() if not self.demand.get(m))
            self._idle_byte_seconds += idle * dt
            self._last_sample = at
        if self.timeline[-1][1] != self.cluster.gpu_bytes:
            self.timeline.append((at, self.cluster.gpu_bytes))

    def _reschedule_transfers(self) -> None:
        nxt = self.cluster.next_finish()
        if nxt is not None and nxt != self._xfer_at:
            self._xfer_gen += 1
            self._xfer_at = nxt
            self.push(max(nxt, self.now), "xfer", self._xfer_gen)
        elif nxt is None:
            self._xfer_at = None

    def _on_transfers(self, _: object) -> None:
        self._xfer_at = None
        for t in self.cluster.finish_due(self.now):
            t.on_done(t)

    def _on_tick(self, _: object) -> None:
        self.policy.on_tick(self.view)
        self.push(self.now + self.tick_seconds, "tick")

    # -- requests ------------------------------------------------------------

    def _on_record(self, index: int) -> None:
        rec = self.records[index]
        session = self.sessions.get(rec.session)
        if isinstance(rec, TraceEnd):
            if session is not None:
                self._queues[rec.session].append(rec)
                self._pump(rec.session)
            return
        assert isinstance(rec, TraceRequest)
        if session is None:
            session = self.sessions[rec.session] = SessionState(rec.session, rec.user or rec.session, rec.slo)
            if rec.parent is not None and rec.parent in self.sessions:  # a sub-agent with a context of its own
                root_id = self._workflow[rec.session] = self._workflow.get(rec.parent, rec.parent)
                self._members.setdefault(root_id, [root_id]).append(rec.session)
                session.last_t = self.sessions[rec.parent].last_t
        root = self.sessions[self._workflow.get(rec.session, rec.session)]
        if root is not session:  # a hand-off is a change of model from the last turn of the workflow
            session.requested_model = root.requested_model
        # a hand-off is a change of the model the trace names, not of the instance that serves it
        handoff = session.requested_model is not None and self.router.model(session.requested_model) != rec.model
        model = self.router.route(session, rec.model)
        req = SimRequest(
            len(self.requests), rec.t, rec.session, model, rec.input_tokens, rec.output_tokens, rec.slo, handoff
        )
        self.requests.append(req)
        self.policy.observe(self.view, session, req)
        self.gateway.observe(session, req)
        session.requested_model = root.requested_model = model
        self._queues[rec.session].append(req)
        if self.slots is None or self.slots.arrive(rec.session):
            self._pump(rec.session)

    def _pump(self, session_id: str) -> None:
        """Release a session's next turn (or end) when it is due; one turn runs at a time.

        Closed loop (default): a turn is due at its trace time plus the session's lag (how much later
        than in the trace its previous turn arrived), and only after the previous answer (this loop
        runs once `session.request` is None): the trace's start-to-start gap is kept from the previous
        arrival, never added to the replay's service time. Otherwise a turn is due at its trace time
        and waits only for the previous turn to end.
        """
        session = self.sessions[session_id]
        owner = self._lag_owner(session_id)
        queue = self._queues[session_id]
        if self.slots is not None and not self.slots.may_run(session_id):
            return  # waiting for a seat: `_close_slot` releases it
        while queue and not self._turn_running(session) and not session.release_pending:
            item = queue[0]
            due = item.t + owner.lag_seconds
            if due > self.now:
                session.release_pending = True
                self.push(due, "release", session_id)
                return
            queue.popleft()
            if self.slots is not None:
                self.slots.consumed(session_id)
            if isinstance(item, TraceEnd):
                session.ended = True
                self.gateway.on_session_end(session)
                self._drop_session_kv(session.id)
                self.policy.on_session_end(self.view, session)
                self._close_slot(session_id)
            else:
                self._admit(session, item)

    def _lag_owner(self, session_id: str) -> SessionState:
        """The session whose lag a session's turns keep: the root of its workflow (itself without sub-agents)."""
        return self.sessions[self._workflow.get(session_id, session_id)]

    def _turn_running(self, session: SessionState) -> bool:
        """Whether a turn of the session's workflow is waiting or running (one runs at a time)."""
        members = self._members.get(self._workflow.get(session.id, session.id))
        if members is None:
            return session.request is not None
        return any(self.sessions[m].request is not None for m in members)

    def _pump_workflow(self, session_id: str) -> None:
        """A turn of the workflow ended: release the next one, in whichever of its sessions it waits."""
        self._pump(session_id)
        for member in self._members.get(self._workflow.get(session_id, session_id), ()):
            if member != session_id and self._queues[member]:
                self._pump(member)

    def _close_slot(self, session_id: str) -> None:
        """A session has nothing left: its seat goes to the oldest waiting session, whose timeline moves by
        its wait (its first turn is due now)."""
        if self.slots is None or not self.slots.finished(session_id) or self._queues[session_id]:
            return
        nxt = self.slots.close(session_id)
        if nxt is not None:
            queue = self._queues[nxt]
            if queue:
                owner = self._lag_owner(nxt)
                owner.lag_seconds = max(owner.lag_seconds, self.now - queue[0].t)
            self._pump(nxt)

    def _on_release(self, session_id: str) -> None:
        self.sessions[session_id].release_pending = False
        self._pump(session_id)

    def _admit(self, session: SessionState, req: SimRequest) -> None:
        session.ended = False
        session.slo = req.slo
        req.admitted_at = self.now
        if self.closed_loop:  # later turns (of the workflow) keep their gaps from here
            owner = self._lag_owner(session.id)
            owner.lag_seconds = max(owner.lag_seconds, self.now - req.t)
        session.request = req
        limit = self.problem.models[req.model].max_context_tokens
        if limit and session.history_tokens + req.input_tokens >= limit:  # refused at once (module doc)
            if req.input_tokens >= limit:
                req.too_long = True
                self._fail(req)
                return
            self._compact(session, req)
        self.demand[req.model] += 1
        self.waiting.append(req)
        self.push(self.now + self.request_timeout_seconds, "timeout", req)
        self.gateway.on_admit(req)
        self.policy.on_arrival(self.view, req)

    def _compact(self, session: SessionState, req: SimRequest) -> None:
        """The agent compacts a context its model refused and starts its history afresh (module doc): every
        KV of the session's history is stale, its bytes left to the policies' eviction as any stale KV."""
        req.compacted_tokens = session.history_tokens
        session.history_tokens = 0
        for tokens in (self.gpu_tokens, self.host_tokens, self.computed_tokens):
            for kv in [kv for kv in tokens if kv.session == session.id]:
                tokens[kv] = 0

    def _on_timeout(self, req: SimRequest) -> None:
        """The client gives up on a request that has not started (module doc): the session's next turn follows."""
        if req.state != "waiting":
            return
        self.waiting.remove(req)
        self.demand[req.model] -= 1
        self._fail(req)

    def _fail(self, req: SimRequest) -> None:
        """Answer the request as failed (not waiting): the session's next turn follows."""
        session = self.sessions[req.session]
        req.state = "failed"
        req.failed_at = self.now
        req.parts = self.waited_parts(req.model, req.admitted_at, self.now)
        session.request = None
        session.last_t = self.now
        self._pump_workflow(req.session)
        if session.request is None:
            self._close_slot(req.session)

    def dispatch(self) -> None:
        """Start waiting requests whose model is ready and whose KV fits; ask the policy for the rest.

        First come, first served per model, as vLLM's scheduler does: when the oldest waiting request
        of a model does not fit, the later ones of that model wait behind it (no large-context
        request starves behind a stream of small ones).
        """
        self.policy.on_dispatch(self.view)
        self.gateway.give_way()  # a warm-up never holds a card a real request wants
        progressed = True
        while progressed:
            progressed = False
            blocked: set[str] = set()
            for req in list(self.waiting):
                if req.model in blocked:
                    continue
                state = self.models.get(req.model)
                if state is None:
                    self.policy.on_waiting(self.view, req)
                    state = self.models.get(req.model)
                if state is not None and state.status == "ready":
                    if self._start(req, state):
                        self.waiting.remove(req)
                        progressed = True
                        continue
                    if self._stuck(state):
                        self.needs_kv_room.add(req.model)
                        self.policy.on_stuck(self.view, req)
                        progressed = req.model not in self.models
                blocked.add(req.model)
        self.gateway.consider()

    def _stuck(self, state: ModelState) -> bool:
        """Nothing running or copying on the group will ever free room for the waiting KV."""
        group = {g.id for g in state.gpus}
        if any(t.dest.tier is Tier.GPU and t.dest.id in group for t in self.cluster.transfers.values()):
            return False
        return not any(self.running.get(m) and {g.id for g in st.gpus} & group for m, st in self.models.items())

    def _start(self, req: SimRequest, state: ModelState) -> bool:
        model = self.problem.models[req.model]
        session = self.sessions[req.session]
        kv = StateObject.kv(req.model, req.session)
        kvpt = model.kv_bytes_per_token
        history = session.history_tokens
        footprint = (history + req.input_tokens + req.output_tokens) * kvpt
        group = state.gpus
        group_ids = {g.id for g in group}
        # KV left on GPUs outside the serving group is stale: drop it
        for gpu_id in self.problem.gpus:
            if gpu_id not in group_ids and self.cluster.bytes_of(kv, Location.gpu(gpu_id)):
                self.cluster.remove(kv, Location.gpu(gpu_id))
                self.gpu_tokens[kv] = 0
        shards = split_evenly(footprint, len(group))
        needs = []
        for g, b in zip(group, shards, strict=True):
            loc = Location.gpu(g.id)
            need = b - self.cluster.bytes_of(kv, loc)
            if need > self.cluster.free(loc):
                self.executor.make_room(loc, need - self.cluster.free(loc), protect={req.model})
            if need > self.cluster.free(loc):
                return False
            needs.append((loc, need))
        for loc, need in needs:
            if need > 0:
                self.cluster.add(kv, loc, need)
            elif need < 0:
                self.cluster.remove(kv, loc, -need)
        req.state = "running"
        req.started_at = self.now
        self.needs_kv_room.discard(req.model)
        req.history_tokens = history
        req.engine = state.epoch
        self.running[req.model] += 1
        self.running_on[(req.model, state.epoch)] += 1
        self.context_on[(req.model, state.epoch)] += decode_context(req)
        self.running_kv.add(kv)
        self.touch(StateObject.weights(req.model, state.precision))
        self.touch(kv)
        self.policy.on_start(self.view, req)
        # make the uncovered history ready: restore from host or re-prefill, the cheaper (the planner's rule)
        computed = min(self.computed_tokens[kv], history)
        have = min(self.gpu_tokens[kv], computed)
        missing = history - have
        self.gateway.on_start(req, have)
        restorable = max(0, self._host_covered(req, state.node, history) - have)
        node = self.problem.nodes[state.node]
        fraction, in_dram = self.expert_share(req.model, state)
        restored, _ = costs.kv_ready(
            missing, restorable * kvpt, model, group, Tier.HOST, node, self.c, have, fraction, in_dram
        )
        if restored > 0:
            self._restore(req, state, kv, restored, math.ceil(restored * kvpt / len(group)), missing - restored)
            return True
        self._compute(req, state, missing)
        return True

    def _host_covered(self, req: SimRequest, node: str, history: int) -> int:
        """How much of the request's session history a KV copy in the node's host DRAM covers: its instance's
        own, or one another instance of its model on the node wrote (they share LMCache's tier: `replicas.py`)."""
        host = Location.host(node)
        return max(
            (
                min(self.host_tokens[x], self.computed_tokens[x], history)
                for x in (StateObject.kv(m, req.session) for m in self.router.siblings(req.model))
                if self.cluster.bytes_of(x, host)
            ),
            default=0,
        )

    def _restore(self, req: SimRequest, state: ModelState, kv: StateObject, tokens: int, shard: int, rest: int) -> None:
        left = {"n": len(state.gpus)}

        def done(_: Transfer) -> None:
            left["n"] -= 1
            if left["n"] == 0:
                self.push(self.now, "kv_restored", (req, state, tokens, rest))

        host = Location.host(state.node)
        for g in state.gpus:
            self.cluster.start(self.now, kv, host, Location.gpu(g.id), shard, True, done, preallocated=True)
        self.executor.operations += 1

    def _on_kv_restored(self, payload: tuple) -> None:
        req, state, tokens, rest = payload
        kv = StateObject.kv(req.model, req.session)
        self.gpu_tokens[kv] = max(self.gpu_tokens[kv], tokens + min(self.gpu_tokens[kv], req.history_tokens))
        self._compute(req, state, rest)

    def _compute(self, req: SimRequest, state: ModelState, reprefill_tokens: int) -> None:
        """Re-prefill the uncovered history, prefill the input, decode: once every card of the group is free."""
        model = self.problem.models[req.model]
        free_at = self.compute_free_at
        start = max(self.now, *(free_at[g.id] for g in state.gpus))
        req.prefill_queue_seconds = start - self.now
        req.reprefill_tokens = reprefill_tokens
        req.degraded = state.precision != model.preferred
        # queued behind its own engine's prefill, its tokens share that engine's passes (`costs.expert_prefill_seconds`)
        engine = (req.model, state.epoch)
        packed = start > self.now and all(self.compute_engine.get(g.id) == engine for g in state.gpus)
        # the re-prefill follows the history the group holds or restored, the input follows the whole history
        history = req.history_tokens
        f, in_dram = self.expert_share(req.model, state)
        ready = start + costs.prefill_seconds(
            reprefill_tokens, history - reprefill_tokens, model, state.gpus, self.c, f, in_dram, packed
        )
        first_token = ready + costs.prefill_seconds(
            req.input_tokens, history, model, state.gpus, self.c, f, in_dram, packed
        )
        # the prompt's KV is stored to host DRAM as the prefill's step ends, and the step waits for it (`kv_save.py`)
        kv = StateObject.kv(req.model, req.session)
        prompt = history + req.input_tokens
        save = self.save_seconds(kv, state, prompt)
        first_token += save
        req.save_seconds = save
        if self.writes_through(state, req.model):
            self.push(first_token, "call", lambda: self.write_through(kv, state.node, prompt))
        for g in state.gpus:
            free_at[g.id] = first_token
            self.compute_engine[g.id] = engine
        req.switch_seconds = ready - req.admitted_at
        req.ttft_seconds = first_token - req.admitted_at
        parts = self.waited_parts(req.model, req.admitted_at, req.started_at)
        parts["kv_restore"] = self.now - req.started_at
        parts["prefill_queue"] = req.prefill_queue_seconds
        parts["reprefill"] = ready - start
        req.parts = parts
        # decode in the batch its engine runs now (this request and every other running there), each output
        # token one step of that batch; a batch that changes while the request decodes is not re-priced
        decode = req.output_tokens * self.decode_seconds_per_token(
            req.model, state, self.context_on[engine], self.running_on[engine]
        )
        self.push(first_token + decode, "done", req)

    def decode_seconds_per_token(
        self, model_id: str, state: ModelState, context_tokens: float = 0.0, batch: int = 1
    ) -> float:
        """`costs.decode_seconds_per_token` of a step of `batch` requests on the serving group, at their
        `context_tokens` of context summed and at the share of the model's routed experts on its node's GPUs.
        A missed expert is computed by the CPU where host DRAM holds them all; the node's CPU is then shared by
        the requests running on every engine of the node whose misses it computes, this engine's steps getting
        `batch` / (those requests) of its rate (processor sharing per request)."""
        model = self.problem.models[model_id]
        fraction, in_dram = self._expert_residency(model_id, state)
        cpu_share = 1.0
        if in_dram and fraction < 1:
            on_cpu = sum(n for engine, n in self.running_on.items() if self._cpu_computes_misses(*engine, state.node))
            cpu_share = batch / max(batch, on_cpu)
        return costs.decode_seconds_per_token(
            model,
            state.precision,
            state.gpus,
            fraction,
            self.c,
            context_tokens=context_tokens,
            cpu_experts=in_dram,
            expert_misses=self.expert_miss_decode,
            batch=batch,
            cpu_share=cpu_share,
        )

    def _expert_residency(self, model_id: str, state: ModelState) -> tuple[float, bool]:
        """The share of a MoE's routed experts on its node's GPUs, and whether host DRAM holds them all
        ((0, False) for a dense model, or where decode ignores the experts off GPU)."""
        if not self.problem.models[model_id].is_moe or not self.expert_miss_decode:
            return 0.0, False
        return self.expert_share(model_id, state)

    def _cpu_computes_misses(self, model_id: str, epoch: int, node: str) -> bool:
        """Whether the model's serving engine `epoch` is on `node` and its CPU computes the experts it misses."""
        state = self.models.get(model_id)
        if state is None or state.epoch != epoch or state.node != node:
            return False
        fraction, in_dram = self._expert_residency(model_id, state)
        return in_dram and fraction < 1

    def _on_done(self, req: SimRequest) -> None:
        session = self.sessions[req.session]
        kv = StateObject.kv(req.model, req.session)
        req.state = "done"
        req.done_at = self.now
        session.history_tokens = req.history_tokens + req.input_tokens + req.output_tokens
        session.model = req.model
        session.last_t = self.now
        self.gpu_tokens[kv] = self.computed_tokens[kv] = session.history_tokens
        self.running_kv.discard(kv)
        self.demand[req.model] -= 1
        self.running[req.model] -= 1
        engine = (req.model, req.engine)
        self.running_on[engine] -= 1
        self.context_on[engine] -= decode_context(req)
        if not self.running_on[engine]:
            del self.running_on[engine]
            del self.context_on[engine]
        self.touch(kv)
        state = self.models.get(req.model)
        if state is not None:
            self.touch(StateObject.weights(req.model, state.precision))
        session.request = None
        self.policy.on_done(self.view, req)
        self._pump_workflow(req.session)
        if session.request is None:
            self._close_slot(req.session)  # (a session whose trace has no end record ends with its last turn)

    def writes_through(self, state: ModelState, model_id: str) -> bool:
        """The policy keeps LMCache's copy of the prompts' KV in host DRAM, and this engine offloads KV."""
        return self.kv_offload and self.engines.keeps_kv_in_host(state.node, model_id)

    def save_seconds(self, kv: StateObject, state: ModelState, prompt_tokens: int) -> float:
        """How long the step that prefilled `prompt_tokens` of `kv` on `state`'s group waits for LMCache's store of
        the whole chunks the node's host DRAM does not hold yet (`kv_save.py`); 0 where nothing is written through."""
        if not self.writes_through(state, kv.model):
            return 0.0
        kvpt = self.problem.models[kv.model].kv_bytes_per_token
        nbytes = kv_save.saved_tokens(prompt_tokens) * kvpt - self.cluster.bytes_of(kv, Location.host(state.node))
        return kv_save.save_seconds(nbytes, state.gpus)

    def write_through(self, kv: StateObject, node: str, prompt_tokens: int) -> None:
        """LMCache's store of a prompt's KV in the node's host DRAM, whole chunks only (`kv_save.py`); its D2H
        copy was charged to the prefill (`save_seconds`)."""
        tokens = kv_save.saved_tokens(prompt_tokens)
        nbytes = tokens * self.problem.models[kv.model].kv_bytes_per_token
        host = Location.host(node)
        for other in self.problem.nodes:
            if other != node and self.cluster.bytes_of(kv, Location.host(other)):
                self.cluster.remove(kv, Location.host(other))
        grow = nbytes - self.cluster.bytes_of(kv, host)
        if grow <= 0:  # the host copy covers the prompt's whole chunks already (a demote copied the decode too)
            return
        if grow > self.cluster.free(host):
            self._free_host(host, grow - self.cluster.free(host))
        if grow <= self.cluster.free(host):
            self.cluster.add(kv, host, grow)
            self.host_tokens[kv] = tokens

    def _free_host(self, host: Location, nbytes: int) -> None:
        victims = sorted(
            (self.last_used.get(o, 0.0), o)
            for o in self.cluster.objects_at(host)
            if o.kind is Kind.KV and o not in self.running_kv
        )
        for _, o in victims:
            if nbytes <= 0:
                break
            nbytes -= self.cluster.remove(o, host)
            self.host_tokens[o] = 0

    def _drop_session_kv(self, session_id: str) -> None:
        """A session that ended needs no KV: free it everywhere (except a turn still running)."""
        for obj, loc in [k for k in self.cluster.placed if k[0].kind is Kind.KV and k[0].session == session_id]:
            if obj not in self.running_kv:
                self.cluster.remove(obj, loc)
                self.gpu_tokens.pop(obj, None)
                self.host_tokens.pop(obj, None)
                self.computed_tokens.pop(obj, None)


def decode_context(req: SimRequest) -> float:
    """The mean context of a request's output tokens: token k attends to history + input + k tokens, and
    their mean over the output is exact for the KV read, linear in the context."""
    return req.history_tokens + req.input_tokens + (req.output_tokens - 1) / 2


def simulate(scenario: Scenario, records: Sequence[TraceRecord], policy: PolicyHooks, **options: object) -> SimResult:
    started = time.perf_counter()
    result = Simulator(scenario, records, policy, **options).run()  # type: ignore[arg-type]  # the replay options, checked by the signature
    result.extra["wall_seconds"] = time.perf_counter() - started
    return result
