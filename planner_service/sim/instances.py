"""The simulated nodes' engine instances, by the engine model (`domain/engines.py`, DESIGN.md §5).

Every model a node serves runs in an engine instance of the node's declared kind for it (`vllm`,
`sglang`, `local`; a node that declares no engines runs `local` ones, which offer every transition).
What the simulator takes from the engine model:

* **Bringing a model onto a group** is a cold start of a new instance, or a wake of the instance that
  sleeps on that group at that precision. Beyond the simulated copy of the weights (shared links, as
  every copy), it costs the transition's fixed part: `cold_start_fixed_seconds` (perf_anchors.md §1:
  a full reload is 30-100+ s per switch), `wake_fixed_seconds` for a level-1 wake (weights back from
  the host backup), `wake_fixed_seconds + reload_fixed_seconds` for a level-2 wake (weights reloaded
  from disk).
* **A vLLM or SGLang instance up holds its CUDA context** on each GPU of its group
  (`context_bytes_per_gpu`, `engines.context_bytes_per_gpu`), running or asleep, where the planner counts
  it (`engine_holdings.context_bytes`): a start takes it, a wake finds it held. A `local` engine is charged its
  context asleep only (the residue), as before.
* **Taking a model off its GPUs** puts its instance to sleep where its kind and launch features allow
  (level 1 when host RAM holds a complete copy of the weights, the backup; level 2 otherwise), else
  stops it. A sleep discards the instance's GPU KV and keeps the CUDA context on every GPU of the group
  (the residue); a stop frees everything. An adopted engine is never stopped (its owner starts and stops
  it), so its residue stays.
* **A MoE's GPU expert share is fixed at launch** on `vllm` and `sglang`: what is on the group's GPUs
  when the instance becomes ready stays until it sleeps; only `local` moves experts at run time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from planner_service.domain import engines
from planner_service.domain.engines import DeclaredEngine, EngineKind, EngineState, Management, Transition
from planner_service.domain.problem import Gpu, Problem
from planner_service.planner.engine_instances import ENGINE_NODE_KINDS

# a node that declares no engines: the node agent's own executor, which offers every transition
UNDECLARED = DeclaredEngine(EngineKind.LOCAL, frozenset(engines.EngineFeature), Management.MANAGED)


@dataclass(slots=True)
class SleepingEngine:
    """An instance asleep on its group: its CUDA context stays on each GPU until it is woken or stopped."""

    instance: engines.EngineInstance
    node: str
    state: EngineState  # asleep_host or asleep_discarded


class EngineBook:
    """Which kind of engine serves each model on each node, what each transition costs, and the sleeping
    instances (one per model and node) with their residue."""

    def __init__(self, problem: Problem, constants: engines.EngineConstants) -> None:
        self.problem = problem
        self.constants = constants
        self.asleep: dict[tuple[str, str], SleepingEngine] = {}  # (model, node) -> its sleeping instance
        # the engine model's verdicts per instance, remembered: they are asked on every eviction choice
        self._levels: dict[tuple[engines.EngineInstance, bool], Transition | None] = {}
        self._stoppable: dict[engines.EngineInstance, bool] = {}

    def declared(self, node_id: str, model_id: str) -> DeclaredEngine:
        return self.problem.nodes[node_id].declared_engines.get(model_id, UNDECLARED)

    def instance(self, node_id: str, model_id: str, precision: str, gpus: tuple[Gpu, ...]) -> engines.EngineInstance:
        """The instance that serves `model_id` at `precision` on `gpus`, launched with its minimum KV pool
        (engines.min_kv_pool_bytes_per_gpu; the simulator allocates KV per request inside the room the
        launch leaves: `Executor.fill_experts`)."""
        model = self.problem.models[model_id]
        declared = self.declared(node_id, model_id)
        least = engines.min_kv_pool_bytes_per_gpu(
            model.kv_bytes_per_token, model.max_context_tokens, len(gpus), model.kv_heads
        )
        return engines.EngineInstance(
            kind=declared.kind,
            model=model_id,
            precision=precision,
            gpus=tuple(g.id for g in gpus),
            weights_bytes=model.weights_bytes[precision],
            launch=engines.LaunchSettings(kv_pool_bytes_per_gpu=least, features=declared.features),
            experts_bytes=model.experts_bytes,
            management=declared.management,
            kv_bytes_per_token=model.kv_bytes_per_token,
            model_max_context_tokens=model.max_context_tokens,
            kv_heads=model.kv_heads,
        )

    def moves_session_kv(self, node_id: str, model_id: str) -> bool:
        """Whether the model's engine on the node moves or frees one session's KV on request (only `local`)."""
        return engines.offers(self.declared(node_id, model_id).kind, engines.RuntimeMove.SESSION_KV)

    def keeps_kv_in_host(self, node_id: str, model_id: str) -> bool:
        """Whether the engine stores each turn's KV to host RAM as it is produced: `local` (the agent's own
        executor), or a vLLM engine launched with LMCache (its CPU tier)."""
        declared = self.declared(node_id, model_id)
        return declared.kind is EngineKind.LOCAL or engines.EngineFeature.LMCACHE in declared.features

    def runtime_experts(self, node_id: str, model_id: str) -> bool:
        """Whether the model's engine on the node changes its GPU expert share while it runs."""
        return engines.offers(self.declared(node_id, model_id).kind, engines.RuntimeMove.EXPERT_SHARE)

    def start_fixed_seconds(self, node_id: str, model_id: str, precision: str, gpus: tuple[Gpu, ...]) -> float:
        """The fixed part of bringing the model up on `gpus`: a wake of the instance sleeping there, else a
        cold start (the copy of the weights is simulated on its own); `engines.bring_up_fixed_seconds`, as
        the planner prices it."""
        sleeping = self.asleep.get((model_id, node_id))
        if sleeping is not None and sleeping.instance == self.instance(node_id, model_id, precision, gpus):
            return engines.bring_up_fixed_seconds(sleeping.state, True, self.constants)
        return engines.bring_up_fixed_seconds(EngineState.STOPPED, False, self.constants)

    def sleep_level(self, instance: engines.EngineInstance, host_copy: bool) -> Transition | None:
        """How a running instance leaves its GPUs (`engines.leaving_transition`), remembered per instance."""
        key = (instance, host_copy)
        if key not in self._levels:
            self._levels[key] = engines.leaving_transition(instance, host_copy)
        return self._levels[key]

    def may_leave(self, instance: engines.EngineInstance) -> bool:
        """Whether a running instance can leave its GPUs at all: sleep at some level, or stop."""
        return self.sleep_level(instance, host_copy=True) is not None or self.may_stop(instance)

    def may_stop(self, instance: engines.EngineInstance) -> bool:
        if instance not in self._stoppable:
            self._stoppable[instance] = engines.may(instance, EngineState.ASLEEP_DISCARDED, Transition.STOP).allowed
        return self._stoppable[instance]

    def residue_bytes(self) -> int:
        """The CUDA context a sleeping instance keeps on each GPU of its group."""
        return engines.context_bytes_per_gpu(EngineState.ASLEEP_DISCARDED, self.constants)

    def context_bytes(self, node_id: str, model_id: str) -> int:
        """The CUDA context the model's running instance on the node holds on each GPU of its group, where the
        planner counts it: on a vLLM or SGLang engine (its residue once asleep); none charged on `local`."""
        if self.declared(node_id, model_id).kind not in ENGINE_NODE_KINDS:
            return 0
        return engines.context_bytes_per_gpu(EngineState.RUNNING, self.constants)

    def frees_on_bring_up(self, node_id: str, model_id: str, precision: str, gpus: tuple[Gpu, ...]) -> bool:
        """Whether bringing the model up on `gpus` takes the residue of its own sleeping instance off the
        GPUs' room: its wake there (the context serves again) or its stop (a managed one started anew)."""
        sleeping = self.asleep.get((model_id, node_id))
        if sleeping is None:
            return False
        return sleeping.instance == self.instance(node_id, model_id, precision, gpus) or self.may_stop(
            sleeping.instance
        )

    def sleeping_on(self, gpu_id: str) -> Iterator[SleepingEngine]:
        """The instances whose residue sits on a GPU, in a stable order."""
        for key in sorted(self.asleep):
            engine = self.asleep[key]
            if gpu_id in engine.instance.gpus:
                yield engine
