"""The one interface every executor implements, and the registry that names them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from clients.agent.executors.names import ExecutorName
from clients.agent.operations import Capability, Operation, Outcome
from planner_service.wire.enums import EngineStatus
from planner_service.wire.state import PlacementEntry

if TYPE_CHECKING:
    from clients.agent.config import AgentConfig


@dataclass(frozen=True, slots=True)
class GpuUsage:
    id: str
    used_bytes: int | None
    free_bytes: int | None


@dataclass(frozen=True, slots=True)
class Telemetry:
    gpus: list[GpuUsage] = field(default_factory=list)
    engines: dict[str, EngineStatus] = field(default_factory=dict)  # engine name -> state


@runtime_checkable
class Executor(Protocol):
    """Carries out one operation on this node and says what it measured.

    `execute` raises `TemporaryError` (retry may help) or `PermanentError` (it cannot).
    """

    capabilities: frozenset[Capability]

    async def execute(self, op: Operation) -> Outcome: ...

    def telemetry(self) -> Telemetry: ...

    def engines(self) -> list[dict[str, Any]]: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class Seedable(Protocol):
    """An executor that can materialize state the service says is already there (the local one)."""

    def seed(self, placement: list[PlacementEntry], node_id: str, gpu_ids: set[str]) -> int: ...


ExecutorFactory = Callable[["AgentConfig"], Executor]


class UnknownExecutor(ValueError):
    pass


class ExecutorRegistry:
    """Executor factories keyed by `ExecutorName`; no global instance (build one with `default_registry()`)."""

    def __init__(self) -> None:
        self._factories: dict[ExecutorName, ExecutorFactory] = {}

    def register(self, name: ExecutorName, factory: ExecutorFactory) -> None:
        if name in self._factories:
            raise ValueError(f"executor {name.value!r} is already registered")
        self._factories[name] = factory

    def names(self) -> list[str]:
        return sorted(n.value for n in self._factories)

    def create(self, name: str, config: AgentConfig) -> Executor:
        try:
            factory = self._factories[ExecutorName(name)]
        except (ValueError, KeyError):
            raise UnknownExecutor(f"unknown executor {name!r}; choices: {', '.join(self.names())}") from None
        return factory(config)


def default_registry() -> ExecutorRegistry:
    # imported here: an engine executor's module is only loaded when a registry is built
    from clients.agent.executors.lmcache import LMCacheExecutor
    from clients.agent.executors.local import LocalExecutor
    from clients.agent.executors.sglang import SGLangExecutor
    from clients.agent.executors.vllm import VLLMExecutor

    registry = ExecutorRegistry()
    registry.register(ExecutorName.LOCAL, LocalExecutor.from_config)
    registry.register(ExecutorName.VLLM, VLLMExecutor.from_config)
    registry.register(ExecutorName.SGLANG, SGLangExecutor.from_config)
    registry.register(ExecutorName.LMCACHE, LMCacheExecutor.from_config)
    return registry
