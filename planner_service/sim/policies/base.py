"""The policy interface and its registry.

A policy decides what the simulated cluster keeps warm and what it evicts. It
reads the cluster through a read-only `SimView` and acts only through the
`Executor` it is given at set-up (`sim/executor.py`: loads, evictions, a
plan's operations); the engine (`sim/engine.py`) owns time, requests and
compute, and names the hooks it calls (`PolicyHooks`). Every hook has a
do-nothing (or load-on-demand) default here, so each policy is a small class
that overrides what makes it different.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING, ClassVar

from planner_service.domain.state import Kind, Location, StateObject

if TYPE_CHECKING:
    from planner_service.domain.scenario import Scenario
    from planner_service.sim.executor import Executor
    from planner_service.sim.state import SessionState, SimRequest
    from planner_service.sim.view import SimView


class PolicyName(StrEnum):
    STATEBUDGET = "statebudget"
    STATEBUDGET_GROUPS = "statebudget-groups"
    STATIC = "static"
    LRU = "lru"
    INDEPENDENT = "independent"
    STATIC_NOKV = "static-nokv"
    LRU_NOKV = "lru-nokv"
    SLEEP_ROUTER = "sleep-router"
    SWAP_TTL = "swap-ttl"
    STATIC_TUNED = "static-tuned"
    ORACLE = "oracle"
    CLAIRVOYANT = "clairvoyant"


class Policy:
    """Load on demand, evict the least recently used; subclasses change what differs."""

    name: ClassVar[PolicyName]
    # every baseline keeps a write-through copy of each turn's KV in host DRAM (LMCache's CPU tier, which
    # teams deploy today); a policy without it is a named ablation (`static-nokv`, `lru-nokv`)
    kv_offload: ClassVar[bool] = True
    sleeps_engines: ClassVar[bool] = True  # an engine taken off its GPUs sleeps where its kind allows

    act: Executor  # how the policy acts on the cluster; set at `setup`

    def deployment(self, scenario: Scenario) -> Scenario:
        """The cluster as this policy's operator deploys it (its engines' declared groups); the scenario's own
        by default."""
        return scenario

    def setup(self, sim: SimView, act: Executor) -> None:
        """Take the executor the policy acts through, then put its offline placement in place at t=0."""
        self.act = act
        self.place(sim)

    def place(self, sim: SimView) -> None:
        """The policy's offline placement at t=0 (none by default: everything loads on demand)."""

    def observe(self, sim: SimView, session: SessionState, req: SimRequest) -> None:
        """A request arrived (before it is queued): what an online policy may learn from."""

    def on_arrival(self, sim: SimView, req: SimRequest) -> None:
        self.ensure(sim, req)

    def on_waiting(self, sim: SimView, req: SimRequest) -> None:
        """The request's model is not on GPU (and not loading)."""
        self.ensure(sim, req)

    def ensure(self, sim: SimView, req: SimRequest) -> None:
        if req.model not in sim.models:
            self.act.load_model(req.model, self.allowed(sim, req.model))

    def allowed(self, sim: SimView, model: str) -> Callable[[str], bool]:
        return lambda gpu: True

    def on_start(self, sim: SimView, req: SimRequest) -> None: ...

    def on_done(self, sim: SimView, req: SimRequest) -> None: ...

    def on_tick(self, sim: SimView) -> None: ...

    def on_session_end(self, sim: SimView, session: SessionState) -> None: ...

    def on_dispatch(self, sim: SimView) -> None: ...

    def on_plan_event(self, sim: SimView, payload: object) -> None: ...

    def on_evicted(self, sim: SimView, obj: StateObject, loc: Location) -> None:
        """The engine evicted `obj` from the GPU `loc` to make room."""

    def on_model_ready(self, sim: SimView, model: str) -> None:
        self.act.fill_experts(model)

    def on_stuck(self, sim: SimView, req: SimRequest) -> None:
        """The model is ready but its group can never hold the request's KV: move the model."""
        state = sim.models.get(req.model)
        if state is not None:
            obj = StateObject.weights(req.model, state.precision)
            self.act.evict(obj, Location.gpu(state.gpus[0].id), force=True)

    def kv_reserve(self, sim: SimView, model: str) -> int:
        """KV bytes an on-demand load leaves room for next to the weights: the largest waiting request's."""
        return sim.largest_waiting_kv(model)

    def victim_key(self, sim: SimView, obj: StateObject, loc: Location) -> tuple | None:
        """Eviction order on a GPU, lowest first; None: never evict. Default: experts first, then LRU."""
        return (0 if obj.kind is Kind.EXPERTS else 1, sim.last_used.get(obj, -1.0), obj)


class PolicyRegistry:
    def __init__(self) -> None:
        self._policies: dict[str, Callable[..., Policy]] = {}

    def register(self, name: PolicyName, factory: Callable[..., Policy]) -> None:
        if name in self._policies:
            raise ValueError(f"policy {name!r} is registered already")
        self._policies[name] = factory

    def create(self, name: str, **options: object) -> Policy:
        try:
            factory = self._policies[name]
        except KeyError:
            raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(self.names())}") from None
        return factory(**options)

    def names(self) -> list[str]:
        return [str(n) for n in PolicyName if n in self._policies]
