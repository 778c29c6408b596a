"""The simulator's executor: the one place that changes the simulated cluster for a policy.

Policies decide (`policies/`); they read the cluster through `SimView` and hand what they decided to
this executor: load a model on demand, evict, place at t=0, fill experts, apply a plan's operation,
serve a model from a group its weights are complete on. The executor keeps the rules every policy
shares: an eviction never drops the last complete copy on a node nor what running requests read, a
load stages through host DRAM, an engine warms up before it serves, and a KV copy never covers more
than its source did.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Protocol

from planner_service.domain import engines
from planner_service.domain.engines import EngineState, Management, Transition
from planner_service.domain.problem import Gpu
from planner_service.domain.scenario import Capability
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.planner.greedy import split_evenly
from planner_service.planner.operations import Action, Operation
from planner_service.sim.cluster import Transfer
from planner_service.sim.instances import SleepingEngine
from planner_service.sim.state import ModelState, SimState
from planner_service.sim.view import SimView

KV_HEADROOM = 0.10  # share of each GPU a baseline's expert fill leaves free for KV
OperationDone = Callable[[Operation, Transfer], None]


class ExecutorHooks(Protocol):
    """What the executor tells the policy, and asks of it (the engine's `PolicyHooks` include these)."""

    @property
    def name(self) -> str: ...

    @property
    def sleeps_engines(self) -> bool:
        """Whether an engine the policy takes off its GPUs sleeps where its kind allows (False: it stops)."""
        ...

    def kv_reserve(self, sim: SimView, model: str) -> int: ...

    def on_evicted(self, sim: SimView, obj: StateObject, loc: Location) -> None: ...

    def on_model_ready(self, sim: SimView, model: str) -> None: ...


class SimulationError(RuntimeError):
    """The replay could not finish (a request waits forever); the message names it."""


class Executor:
    """Applies what policies decide to the simulated cluster, by the rules every policy shares."""

    def __init__(self, sim: SimState, view: SimView, policy: ExecutorHooks) -> None:
        self.sim = sim
        self.view = view
        self.policy = policy
        self.problem = sim.problem
        self.c = sim.c
        self.cluster = sim.cluster
        self.models = sim.models
        self.operations = 0  # operations applied (copies started, drops)
        self.loads = 0  # on-demand loads
        self.fallback_loads = 0  # loads a policy counted as falling back from its plan
        self.transitions: Counter[str] = Counter()  # engine transitions: cold starts, wakes, sleeps, stops

    # -- what policies ask for besides moving bytes --------------------------------

    def count_fallback(self) -> None:
        self.fallback_loads += 1

    def schedule_plan(self, at: float, payload: object) -> None:
        """Call the policy's `on_plan_event(payload)` at simulated time `at`."""
        self.sim.push(at, "plan", payload)

    def look_again_at(self, at: float) -> None:
        """Run a dispatch pass at `at` (the policy's hooks see the waiting requests then)."""
        self.sim.push(at, "call", lambda: None)

    def report_plan_seconds(self, seconds: float) -> None:
        self.sim.planner_seconds.append(seconds)

    # -- weights, experts and eviction ----------------------------------------------

    def evict(self, obj: StateObject, loc: Location, force: bool = False) -> int:
        """Drop an object from a GPU (all its shards for weights and KV); returns the bytes freed at `loc`.

        `force` also evicts weights that only waiting requests want (to reload them where their KV fits).
        """
        if self.view.pinned(obj, force) or self.cluster.reading(obj, loc) or self.view.experts_fixed(obj, loc):
            return 0
        node = self.problem.gpus[loc.id].node
        if obj.kind is not Kind.KV and self.cluster.complete_below(obj, node) is None:
            return 0  # the last complete copy on the node is never dropped
        before = self.cluster.bytes_of(obj, loc)
        if obj.kind is Kind.EXPERTS:
            self.cluster.remove(obj, loc)
        else:
            for g in self.problem.nodes[node].gpus:
                self.cluster.remove(obj, Location.gpu(g))
            if obj.kind is Kind.KV:
                self.sim.gpu_tokens[obj] = 0
            else:
                state = self.models.get(obj.model)
                if state is not None and state.node == node and state.precision == obj.precision:
                    self._take_down(state, obj.model)
                    self._drop_experts(obj.model)
        self.operations += 1
        if before:
            self.policy.on_evicted(self.view, obj, loc)
        return before

    def _drop_experts(self, model_id: str) -> None:
        """An unloaded engine frees its expert buffers: the model's routed experts leave every GPU."""
        experts = StateObject.experts(model_id)
        for gpu in self.problem.gpus.values():
            loc = Location.gpu(gpu.id)
            if self.cluster.bytes_of(experts, loc) and not self.cluster.reading(experts, loc):
                if self.cluster.complete_below(experts, gpu.node) is not None:
                    self.cluster.remove(experts, loc)

    def make_room(self, loc: Location, nbytes: int, protect: Iterable[str] = ()) -> bool:
        """Evict the policy's victims at `loc` (lowest key first) until `nbytes` more are free."""
        target = self.cluster.free(loc) + nbytes
        for _, obj in self.view.evictable(loc, protect):
            if self.cluster.free(loc) >= target:
                break
            self.evict(obj, loc)
        if self.cluster.free(loc) < target:
            self.stop_sleeping(loc, target, protect)  # a later load of theirs is a cold start, not a wake
        return self.cluster.free(loc) >= target

    def load_model(
        self, model_id: str, allowed: Callable[[str], bool] = lambda g: True, protect: Iterable[str] = ()
    ) -> bool:
        """Load a model's weights on demand where they and the waiting requests' KV fit: evict, then copy.

        The group must hold the policy's KV reserve (`Policy.kv_reserve`), else the largest waiting
        request's KV; when no group has room for that either, the weights alone decide (the KV then
        waits for room).
        """
        if model_id in self.models:
            return True
        choice = None
        for kv_bytes in dict.fromkeys(
            (self.policy.kv_reserve(self.view, model_id), self.sim.largest_waiting_kv(model_id))
        ):
            choice = choice or self.view.choose_group(model_id, allowed, protect, kv_bytes)
        if choice is None and model_id not in self.sim.needs_kv_room:
            choice = self.view.choose_group(model_id, allowed, protect)
        if choice is None:
            return False
        self.loads += 1
        if self.loads > 50 * len(self.sim.requests) + 1000:
            raise SimulationError(
                f"policy {self.policy.name} thrashes: {self.loads} loads for {len(self.sim.requests)} requests"
            )
        node_id, precision, group = choice
        model = self.problem.models[model_id]
        obj = StateObject.weights(model_id, precision)
        shards = split_evenly(model.weights_bytes[precision], len(group))
        for g, b in zip(group, shards, strict=True):
            loc = Location.gpu(g.id)
            need = (
                b
                - self.cluster.bytes_of(obj, loc)
                + self.view.bring_up_bytes(model_id, node_id, precision, group, g.id)
            )
            if need > self.cluster.free(loc):
                self.make_room(loc, need - self.cluster.free(loc), protect={*protect, model_id})
            if need > self.cluster.free(loc):
                return False
        self.promote_weights(model_id, node_id, precision, group)
        return True

    def promote_weights(self, model_id: str, node_id: str, precision: str, group: tuple[Gpu, ...]) -> None:
        model = self.problem.models[model_id]
        obj = StateObject.weights(model_id, precision)
        source_tier = self.cluster.complete_below(obj, node_id)
        assert source_tier is not None, f"no copy of {obj.label()} below GPU on {node_id}"
        source = Location(source_tier, node_id)
        state = self._bring_up(model_id, node_id, precision, group, "loading")
        shards = split_evenly(model.weights_bytes[precision], len(group))
        for g, b in zip(group, shards, strict=True):
            need = b - self.cluster.bytes_of(obj, Location.gpu(g.id))
            if need > 0:
                state.pending += 1
                self.cluster.start(
                    self.sim.now, obj, source, Location.gpu(g.id), need, True, partial(self._shard_done, state)
                )
        self.operations += 1
        if state.pending == 0:
            self._weights_complete(state, model_id)

    def adopt_weights(self, model_id: str, node_id: str, precision: str, gpus: tuple[Gpu, ...]) -> None:
        """Weights a policy's own operations completed on GPUs: the engine warms them up and serves them."""
        if model_id in self.models:
            return
        state = self._bring_up(model_id, node_id, precision, tuple(sorted(gpus, key=lambda g: g.id)), "loading")
        self._weights_complete(state, model_id)

    def _shard_done(self, state: ModelState, transfer: Transfer) -> None:
        state.pending -= 1
        if state.pending == 0 and self.models.get(transfer.obj.model) is state:
            self._weights_complete(state, transfer.obj.model)

    def _weights_complete(self, state: ModelState, model_id: str) -> None:
        obj = StateObject.weights(model_id, state.precision)
        host = Location.host(state.node)
        nbytes = self.cluster.full_size(obj)
        if self.cluster.complete_below(obj, state.node) is Tier.NVME and self.cluster.free(
            host
        ) >= nbytes - self.cluster.bytes_of(obj, host):
            # the load staged through pinned host buffers; the copy stays in DRAM
            if Capability.WEIGHTS_OFFLOAD in self.problem.nodes[state.node].capabilities:
                self.cluster.add(obj, host, nbytes - self.cluster.bytes_of(obj, host))
        state.status = "warming"
        self.sim.push(self.sim.now + state.warmup_seconds, "model_ready", (model_id, state.epoch))

    def on_model_ready(self, payload: tuple[str, int]) -> None:
        model_id, epoch = payload
        state = self.models.get(model_id)
        if state is None or state.epoch != epoch:
            return
        state.status = "ready"
        self.sim.mark_engine(model_id, "ready")
        self.sim.touch(StateObject.weights(model_id, state.precision))
        self.policy.on_model_ready(self.view, model_id)

    def place_now(self, model_id: str, node_id: str, precision: str, group: Sequence[Gpu]) -> None:
        """Set-up only: put a model's weights on its GPUs at t=0, ready (the policy's offline placement)."""
        model = self.problem.models[model_id]
        obj = StateObject.weights(model_id, precision)
        self._bring_up(model_id, node_id, precision, tuple(group), "ready")  # first: a wake frees its residue
        for g, b in zip(group, split_evenly(model.weights_bytes[precision], len(group)), strict=True):
            self.cluster.add(obj, Location.gpu(g.id), b - self.cluster.bytes_of(obj, Location.gpu(g.id)))

    # -- engine instances ---------------------------------------------------------------

    def _bring_up(self, model_id: str, node_id: str, precision: str, group: tuple[Gpu, ...], status: str) -> ModelState:
        """The model's new serving engine on `group`: a wake of the instance sleeping there, else a cold
        start (a set-up placement, `status` ready, is up at t=0 and pays neither)."""
        book = self.sim.engines
        instance = book.instance(node_id, model_id, precision, group)
        warmup = book.start_fixed_seconds(node_id, model_id, precision, group) if status != "ready" else 0.0
        sleeping = book.asleep.get((model_id, node_id))
        if status != "ready":
            woken = sleeping is not None and sleeping.instance == instance
            if not woken:
                self.transitions["cold_start"] += 1
            elif sleeping is not None:  # (always, when woken)
                level = 1 if sleeping.state is EngineState.ASLEEP_HOST else 2
                self.transitions[f"wake_level_{level}"] += 1
            self.sim.mark_engine(model_id, "wake" if woken else "cold_start")
        else:
            self.sim.mark_engine(model_id, "ready")
        if sleeping is not None and (sleeping.instance == instance or book.may_stop(sleeping.instance)):
            self._release_residue(model_id, node_id)  # woken (its context serves again) or stopped
        self._hold_context(model_id, node_id, group)
        state = ModelState(
            status, node_id, precision, group, self.sim.next_epoch(), instance, warmup, book.may_leave(instance)
        )
        self.models[model_id] = state
        return state

    def _hold_context(self, model_id: str, node_id: str, group: tuple[Gpu, ...]) -> None:
        """The running instance's CUDA context on each GPU of its group (`EngineBook.context_bytes`; a woken
        one's residue was released for it just before), room made for it where a set-up placement or a
        plan's completed weights left none."""
        context = self.sim.engines.context_bytes(node_id, model_id)
        for g in group if context else ():
            loc = Location.gpu(g.id)
            if self.cluster.free(loc) < context:
                self.make_room(loc, context - self.cluster.free(loc), protect={model_id})
            self.cluster.hold(model_id, loc, context)

    def _release_context(self, state: ModelState, model_id: str) -> None:
        context = self.sim.engines.context_bytes(state.node, model_id)
        for g in state.gpus if context else ():
            self.cluster.release(model_id, Location.gpu(g.id), context)

    def _release_residue(self, model_id: str, node_id: str) -> None:
        sleeping = self.sim.engines.asleep.pop((model_id, node_id))
        for gpu_id in sleeping.instance.gpus:
            self.cluster.release(model_id, Location.gpu(gpu_id), self.sim.engines.residue_bytes())

    def _take_down(self, state: ModelState, model_id: str) -> None:
        """The serving engine leaves its GPUs: it sleeps where its kind allows (its GPU KV discarded, its CUDA
        context left on each GPU of the group: the context it held while it ran, or taken now where it was
        not charged running), else it stops."""
        del self.models[model_id]
        self.sim.mark_engine(model_id, "none")
        book, c = self.sim.engines, self.cluster
        weights = StateObject.weights(model_id, state.precision)
        host = Location.host(state.node)
        host_copy = c.bytes_of(weights, host) + c.incoming(weights, host) >= c.full_size(weights)  # (or a demote's)
        level = book.sleep_level(state.instance, host_copy) if self.policy.sleeps_engines else None
        if (model_id, state.node) in book.asleep:
            self._release_residue(model_id, state.node)  # one instance of a model sleeps per node
        residue = book.residue_bytes()
        context = book.context_bytes(state.node, model_id)
        extra = residue - context  # what the sleep takes beyond the context it held running
        locs = [Location.gpu(g.id) for g in state.gpus]
        if level is not None:
            for loc in locs:
                for obj in [o for o in c.objects_at(loc) if o.kind is Kind.KV and o.model == model_id]:
                    if obj not in self.sim.running_kv:  # the sleep frees the KV pool
                        c.remove(obj, loc)
                        self.sim.gpu_tokens[obj] = 0
                if c.free(loc) < extra:
                    self._sleep_frees(model_id, weights, loc, extra)
            if all(c.free(loc) >= extra for loc in locs):
                for loc in locs:
                    c.release(model_id, loc, context)
                    c.hold(model_id, loc, residue)
                asleep = EngineState.ASLEEP_HOST if level is Transition.SLEEP_LEVEL_1 else EngineState.ASLEEP_DISCARDED
                book.asleep[(model_id, state.node)] = SleepingEngine(state.instance, state.node, asleep)
                self.transitions[level.value] += 1
                return
        self._release_context(state, model_id)
        self.transitions["stop"] += 1

    def _sleep_frees(self, model_id: str, weights: StateObject, loc: Location, extra: int) -> None:
        """The engine's sleep call frees its weights and GPU experts on every GPU of its group with its KV
        (level 1 to its host backup, level 2 discarded), keeping the CUDA context: where the `extra` bytes
        of context its running instance was not charged find no room, the bytes of them still on the GPU (the
        plan drops a group's shards one by one) leave at once. None that a copy reads, nor the last complete
        copy on the node."""
        c, node = self.cluster, self.problem.node_of(loc)
        for obj in (StateObject.experts(model_id), weights):
            if c.free(loc) >= extra:
                return
            if c.bytes_of(obj, loc) and not c.reading(obj, loc) and c.complete_below(obj, node) is not None:
                c.remove(obj, loc)

    def adopted_asleep(self) -> None:
        """Set-up: an adopted engine on fixed GPUs that no placement put there runs already (its owner started
        it) and sleeps, so bringing its model up is a wake, never a start."""
        book, c = self.sim.engines, self.cluster
        for node_id, node in sorted(self.problem.nodes.items()):
            for model_id, declared in sorted(node.declared_engines.items()):
                gpu_ids = node.engine_gpus.get(model_id)
                state = self.models.get(model_id)
                if declared.management is not Management.ADOPTED or not gpu_ids or (model_id, node_id) in book.asleep:
                    continue
                if state is not None and state.node == node_id:
                    continue
                model = self.problem.models[model_id]
                gpus = tuple(self.problem.gpus[g] for g in gpu_ids)
                instance = book.instance(node_id, model_id, model.preferred, gpus)
                weights = StateObject.weights(model_id, model.preferred)
                level = book.sleep_level(instance, c.complete_below(weights, node_id) is Tier.HOST)
                locs = [Location.gpu(g) for g in gpu_ids]
                if level is None or any(c.free(loc) < book.residue_bytes() for loc in locs):
                    continue
                for loc in locs:
                    c.hold(model_id, loc, book.residue_bytes())
                asleep = EngineState.ASLEEP_HOST if level is Transition.SLEEP_LEVEL_1 else EngineState.ASLEEP_DISCARDED
                book.asleep[(model_id, node_id)] = SleepingEngine(instance, node_id, asleep)

    def stop_sleeping(self, loc: Location, free_target: int, protect: Iterable[str] = ()) -> None:
        """Stop engines sleeping on a GPU (managed ones, not of the `protect` models: an adopted engine is its
        owner's to stop) until `free_target` bytes are free there."""
        book, protect = self.sim.engines, set(protect)
        for sleeping in list(book.sleeping_on(loc.id)):
            if self.cluster.free(loc) >= free_target:
                return
            if sleeping.instance.model not in protect and book.may_stop(sleeping.instance):
                self.transitions["stop_asleep"] += 1
                self._release_residue(sleeping.instance.model, sleeping.node)

    def fill_experts(self, model_id: str, headroom: float = KV_HEADROOM, gpu_ids: Iterable[str] | None = None) -> None:
        """Copy a MoE's routed experts into the free room of its node's GPUs, leaving `headroom` of each GPU.

        Where the engine fixes its expert share at launch (vLLM, SGLang), the experts never give way to KV
        later, so the launch leaves each serving GPU its shard of the policy's KV reserve as well (the KV
        pool an operator sizes at launch): else a request whose KV needs more than the headroom waits on
        a group that can never hold it, and every reload fills the same room again.
        """
        model = self.problem.models[model_id]
        state = self.models.get(model_id)
        if not model.is_moe or state is None:
            return
        obj = StateObject.experts(model_id)
        source_tier = self.cluster.complete_below(obj, state.node)
        if source_tier is None:
            return
        have = self.cluster.node_bytes(obj, state.node, Tier.GPU) + sum(
            t.bytes for t in self.cluster.transfers.values() if t.obj == obj
        )
        want = model.experts_bytes - have
        # routed experts may sit on any GPU of the serving node (expert parallel), as the planner places them
        serving = {g.id for g in state.gpus}
        order = sorted(self.problem.nodes[state.node].gpus, key=lambda g: (g not in serving, g))
        pool_bytes = 0  # per serving GPU
        if not self.sim.engines.runtime_experts(state.node, model_id):
            # the pool the engine is launched with, by the planner's rule: never below one longest request
            instance = self.sim.engines.instance(state.node, model_id, state.precision, state.gpus)
            pool_bytes = engines.launch_kv_pool_bytes_per_gpu(
                instance.min_kv_pool_bytes_per_gpu,
                -(-self.policy.kv_reserve(self.view, model_id) // len(state.gpus)),
            )
        for gid in gpu_ids if gpu_ids is not None else order:
            loc = Location.gpu(gid)
            kept = int(headroom * self.cluster.capacity[loc])
            room = self.cluster.free(loc) - (max(kept, pool_bytes) if gid in serving else kept)
            nbytes = min(want, room) // model.expert_bytes * model.expert_bytes
            if nbytes <= 0:
                continue
            self.cluster.start(self.sim.now, obj, Location(source_tier, state.node), loc, nbytes, True, lambda t: None)
            self.operations += 1
            want -= nbytes

    def serve_from(self, model_id: str, node_id: str, precision: str, gpus: tuple[Gpu, ...]) -> None:
        """A new engine of the model on `gpus`, whose weights are complete there: it replaces the model's
        current engine (requests running on that one finish there)."""
        old = self.models.pop(model_id, None)
        if old is not None:
            self.sim.mark_engine(model_id, "none")
            self._release_context(old, model_id)  # the replaced engine stops
        self.adopt_weights(model_id, node_id, precision, gpus)

    def add_experts(self, obj: StateObject, loc: Location, nbytes: int) -> bool:
        """Set-up only: place expert bytes on a GPU at t=0 where they fit."""
        if self.cluster.free(loc) < nbytes:
            return False
        self.cluster.add(obj, loc, nbytes)
        return True

    # -- a plan's operations ----------------------------------------------------------

    def apply(self, op: Operation, on_done: OperationDone) -> str | None:
        """Start a planned promote, demote or drop: 'started', 'done' / 'failed' at once, or None to wait
        for room. `on_done(op, transfer)` runs when a started copy finishes (after the executor's own
        book-keeping of what the copy covers and what stops serving)."""
        obj, c, source, dest = op.object, self.cluster, op.source, op.dest
        if source is None:
            return "failed"  # only KV is made from nothing, by the requests that need it
        if self.view.experts_fixed(obj, source) or (dest is not None and self.view.experts_fixed(obj, dest)):
            return "failed"  # the running engine's expert share is a launch setting
        if obj.kind is Kind.KV and not self.sim.engines.moves_session_kv(self.problem.node_of(source), obj.model):
            return "failed"  # vLLM and SGLang cannot move or free one request's KV: it is predicted, not commanded
        if op.action is Action.DROP:
            return self._drop(obj, source, op.bytes)
        if dest is None:
            return "failed"  # a promote or demote names where it goes
        if self._stored_already(obj, source, dest):  # the write-through copy holds what this one covers
            return "done" if op.keep_source else self._drop(obj, source, op.bytes)
        have = c.bytes_of(obj, source)
        nbytes = min(op.bytes, have)
        if nbytes <= 0:
            return "failed"
        if not op.keep_source and (self.view.pinned(obj) or c.reading(obj, source)):
            return "failed"
        if c.free(dest) < nbytes:
            return None
        tokens = self.valid_tokens(obj, source)  # before the source copy leaves a GPU below
        c.start(self.sim.now, obj, source, dest, nbytes, op.keep_source, partial(self._copied, op, tokens, on_done))
        self.operations += 1
        if obj.kind is Kind.WEIGHTS and dest.tier is Tier.GPU and obj.model not in self.models:
            # a planned copy of weights to a GPU is the first part of the engine's start or wake, as an
            # on-demand load's copy is (`_bring_up` names which when the copy is complete)
            sleeping = self.sim.engines.asleep.get((obj.model, self.problem.node_of(dest)))
            self.sim.mark_engine(obj.model, "wake" if sleeping and dest.id in sleeping.instance.gpus else "cold_start")
        if not op.keep_source and source.tier is Tier.GPU:
            self._left_gpu(obj, source)
        return "started"

    def _drop(self, obj: StateObject, loc: Location, nbytes: int) -> str:
        c = self.cluster
        # weights a busy engine does not read (the surplus of a group it left for a wider one) may go
        spare = obj.kind is Kind.WEIGHTS and loc.tier is Tier.GPU and nbytes <= self.view.spare_weight_bytes(obj, loc)
        if (self.view.pinned(obj) and not spare) or c.reading(obj, loc) or c.bytes_of(obj, loc) <= 0:
            return "failed"
        node = self.problem.node_of(loc)
        if obj.kind is not Kind.KV:
            size = c.full_size(obj)
            if not any(c.node_bytes(obj, node, t) >= size for t in (Tier.HOST, Tier.NVME) if t is not loc.tier):
                return "failed"  # never the last complete copy below GPU
        c.remove(obj, loc, nbytes)
        self.operations += 1
        if loc.tier is Tier.GPU and not spare:
            self._left_gpu(obj, loc)
        elif obj.kind is Kind.KV and loc.tier is Tier.HOST and not c.bytes_of(obj, loc):
            self.sim.host_tokens[obj] = 0
        return "done"

    def _left_gpu(self, obj: StateObject, loc: Location) -> None:
        """Bytes of `obj` left a GPU: weights stop serving, KV stops covering."""
        if obj.kind is Kind.KV:
            self.sim.gpu_tokens[obj] = 0
        elif obj.kind is Kind.WEIGHTS:
            state = self.models.get(obj.model)
            if state is not None and state.precision == obj.precision and loc.id in {g.id for g in state.gpus}:
                if state.status == "ready" and not self.sim.running.get(obj.model):
                    self._take_down(state, obj.model)

    def _stored_already(self, obj: StateObject, source: Location, dest: Location) -> bool:
        """Whether a KV copy to host DRAM would add nothing: the host copy covers what the source covers."""
        if obj.kind is not Kind.KV or dest.tier is not Tier.HOST or not self.cluster.bytes_of(obj, dest):
            return False
        return self.sim.host_tokens.get(obj, 0) >= self.valid_tokens(obj, source)

    def valid_tokens(self, obj: StateObject, loc: Location) -> int:
        """The history tokens a KV copy covers (what a copy made from it covers at most; 0 for other kinds)."""
        if obj.kind is not Kind.KV:
            return 0
        if loc.tier is Tier.GPU:
            return self.sim.gpu_tokens.get(obj, 0)
        return self.sim.host_tokens.get(obj, 0) if loc.tier is Tier.HOST else 0

    def _copied(self, op: Operation, tokens: int, on_done: OperationDone, transfer: Transfer) -> None:
        obj, c, dest, sim = op.object, self.cluster, transfer.dest, self.sim
        if not op.keep_source and op.source is not None and op.source.tier is Tier.GPU:
            self._left_gpu(obj, op.source)
        if obj.kind is Kind.KV:
            kvpt = self.problem.models[obj.model].kv_bytes_per_token or 1
            # a copy covers what its source covered, at most what its bytes hold (bytes are not tokens: a
            # plan sizes KV for the whole history, the model's copy covers the history up to its last turn)
            if dest.tier is Tier.GPU:
                on_gpu = c.node_bytes(obj, op.node, Tier.GPU) // kvpt
                sim.gpu_tokens[obj] = min(max(sim.gpu_tokens.get(obj, 0), tokens), on_gpu)
            elif dest.tier is Tier.HOST:
                on_host = c.bytes_of(obj, dest) // kvpt
                sim.host_tokens[obj] = min(max(sim.host_tokens.get(obj, 0), tokens), on_host)
                c.remove(obj, dest, c.bytes_of(obj, dest) - sim.host_tokens[obj] * kvpt)  # one copy, no more
        on_done(op, transfer)
        if obj.kind is Kind.WEIGHTS and dest.tier is Tier.GPU and obj.model not in self.models:
            if not any(t.obj == obj and t.dest.tier is Tier.GPU for t in c.transfers.values()):
                sim.mark_engine(obj.model, "none")  # the copies that would start its engine ended without one
