"""The simulated requests, sessions and serving engines: the records the simulator and its policies share."""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from planner_service.domain.engines import EngineConstants, EngineInstance
from planner_service.domain.problem import Gpu, Problem
from planner_service.domain.scenario import Scenario, Slo
from planner_service.domain.state import StateObject, Tier
from planner_service.sim.cluster import SimCluster
from planner_service.sim.instances import EngineBook
from planner_service.sim.trace import TraceRecord


@dataclass(slots=True)
class SimRequest:
    index: int
    t: float
    session: str
    model: str
    input_tokens: int
    output_tokens: int
    slo: Slo
    handoff: bool
    admitted_at: float = 0.0  # when the session released it (its arrival in the simulated cluster)
    history_tokens: int = 0  # the session's history when the request starts
    state: str = "waiting"  # waiting -> running -> done, or waiting -> failed (no first byte within the timeout)
    switch_seconds: float = math.nan
    ttft_seconds: float = math.nan
    done_at: float = math.nan
    started_at: float = math.nan  # when its model was ready and its KV had room
    prefill_queue_seconds: float = 0.0  # waited for earlier prefills on its group's cards
    save_seconds: float = 0.0  # its prefill's step waited for LMCache's D2H store of the prompt's KV (`kv_save.py`)
    reprefill_tokens: int = 0  # uncovered history it prefilled again
    degraded: bool = False  # served at a precision other than its model's preferred one
    engine: int = 0  # epoch of the engine that serves it (`ModelState.epoch`)
    failed_at: float = math.nan  # when the client gave up on it (state "failed")
    too_long: bool = False  # failed at once: its input alone left no room in its model's maximum context
    compacted_tokens: int = 0  # history its agent compacted away when its model refused the prompt as too long
    # where its switch latency went, in seconds (`SWITCH_PARTS`; they sum to `switch_seconds`)
    parts: dict[str, float] | None = None


# The parts of a request's switch latency, in the order they happen:
# - placement: waiting while its model had no engine on any GPU and none starting (for the policy to
#   place it, for room, for its old engine to stop; a planner's control path falls here)
# - cold_start / wake: waiting while its model's engine was being started / woken (weight copies included)
# - queue: waiting while its model's engine was up, for KV room on the group
# - kv_restore: copying the session's history KV from host DRAM
# - prefill_queue: waiting for earlier prefills on the group's cards
# - reprefill: prefilling again the history no KV copy covered
SWITCH_PARTS = ("placement", "cold_start", "wake", "queue", "kv_restore", "prefill_queue", "reprefill")
# an engine's phase in `SimState.engine_phases`: what a request of its model that waits then is waiting for
ENGINE_PHASE_PART = {"none": "placement", "cold_start": "cold_start", "wake": "wake", "ready": "queue"}


@dataclass(slots=True)
class SessionState:
    id: str
    user: str
    slo: Slo
    history_tokens: int = 0
    model: str | None = None  # the model of the last turn served
    requested_model: str | None = None  # the model of the last turn that arrived (hand-offs are in trace order)
    last_t: float = 0.0
    request: SimRequest | None = None  # waiting or running
    ended: bool = False
    lag_seconds: float = 0.0  # how much later than in the trace its last turn arrived (closed loop)
    release_pending: bool = False


@dataclass(slots=True)
class ModelState:
    status: str  # loading | warming | ready
    node: str
    precision: str
    gpus: tuple[Gpu, ...]
    epoch: int
    instance: EngineInstance
    warmup_seconds: float = 0.0  # the start's or wake's fixed part, after the weights are complete
    can_leave: bool = True  # whether the instance can sleep or stop (an adopted one without sleep mode cannot)
    pending: int = 0  # shards still copying


class SimState:
    """The simulated cluster's state: the clock and its event queue, memory and transfers, the engines,
    sessions and requests, and what each KV copy covers. The simulator (`engine.py`) advances it; the
    executor changes it for the policy; the policy reads it through `SimView`."""

    def __init__(
        self,
        scenario: Scenario,
        problem: Problem,
        records: Sequence[TraceRecord],
        engine_constants: EngineConstants | None = None,
    ) -> None:
        self.scenario = scenario
        self.problem = problem
        self.c = problem.constants
        self.records = list(records)
        self.cluster = SimCluster(problem)
        for (obj, loc), nbytes in sorted(problem.residency.items()):
            self.cluster.add(obj, loc, nbytes)
        self.now = 0.0
        self._heap: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self.sessions: dict[str, SessionState] = {}
        self.requests: list[SimRequest] = []
        self.waiting: list[SimRequest] = []
        self.models: dict[str, ModelState] = {}  # the engine serving each model
        self.engines = EngineBook(problem, engine_constants or EngineConstants())  # kinds, costs, sleepers
        self._epochs = itertools.count(1)
        self.demand: dict[str, int] = defaultdict(int)  # waiting + running requests per model
        self.running: dict[str, int] = defaultdict(int)  # running requests per model
        self.running_on: dict[tuple[str, int], int] = defaultdict(int)  # running requests per (model, engine epoch)
        self.needs_kv_room: set[str] = set()  # models whose last group could not hold a waiting request's KV
        self.running_kv: set[StateObject] = set()  # KV of running requests: pinned
        self.gpu_tokens: dict[StateObject, int] = defaultdict(int)  # valid KV tokens on the serving GPUs
        self.host_tokens: dict[StateObject, int] = defaultdict(int)  # KV tokens in host DRAM
        # the history up to each KV's model's last turn in its session: no copy of it covers more
        self.computed_tokens: dict[StateObject, int] = defaultdict(int)
        self.last_used: dict[StateObject, float] = {}
        self.planner_seconds: list[float] = []
        # per model, when its serving engine changed phase (`ENGINE_PHASE_PART`'s keys): times, then phases
        self.engine_phases: dict[str, tuple[list[float], list[str]]] = {}

    def push(self, at: float, kind: str, payload: object = None) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), kind, payload))

    def next_epoch(self) -> int:
        """A new engine's number: requests remember the engine that served them."""
        return next(self._epochs)

    def mark_engine(self, model_id: str, phase: str) -> None:
        """The model's serving engine is now in `phase` (none, cold_start, wake or ready)."""
        times, phases = self.engine_phases.setdefault(model_id, ([0.0], ["none"]))
        if phases[-1] == phase:
            return
        if times[-1] == self.now:
            phases[-1] = phase  # two changes at one instant: the later one holds
            if len(phases) > 1 and phases[-2] == phase:
                times.pop()
                phases.pop()
            return
        times.append(self.now)
        phases.append(phase)

    def waited_parts(self, model_id: str, start: float, end: float) -> dict[str, float]:
        """Seconds of [start, end] a request of the model spent in each waiting part (placement, cold_start,
        wake, queue), by its model's engine phases then; they sum to end - start."""
        parts = dict.fromkeys(ENGINE_PHASE_PART.values(), 0.0)
        times, phases = self.engine_phases.get(model_id, ([0.0], ["none"]))
        i = max(0, bisect.bisect_right(times, start) - 1)
        at = start
        while at < end:
            until = min(end, times[i + 1]) if i + 1 < len(times) else end
            parts[ENGINE_PHASE_PART[phases[i]]] += until - at
            at = until
            i += 1
        return parts

    def touch(self, obj: StateObject) -> None:
        self.last_used[obj] = self.now

    def expert_share(self, model_id: str, state: ModelState) -> tuple[float, bool]:
        """The share of a MoE's routed experts on its serving node's GPUs (1 for a dense model), and whether
        host DRAM there holds them all (the CPU may compute the rest)."""
        model = self.problem.models[model_id]
        if not model.is_moe:
            return 1.0, False
        experts = StateObject.experts(model_id)
        fraction = self.cluster.node_bytes(experts, state.node, Tier.GPU) / model.experts_bytes
        return fraction, self.cluster.complete_below(experts, state.node) is Tier.HOST

    def kv_footprint(self, req: SimRequest) -> int:
        history = self.sessions[req.session].history_tokens
        return (history + req.input_tokens + req.output_tokens) * self.problem.models[req.model].kv_bytes_per_token

    def largest_waiting_kv(self, model_id: str) -> int:
        return max((self.kv_footprint(r) for r in self.waiting if r.model == model_id), default=0)
