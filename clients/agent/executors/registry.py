"""The registry that names the executors: a factory per `ExecutorName`, no global instance."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from clients.agent.config import ExecutorName
from clients.agent.executors.base import Executor

if TYPE_CHECKING:
    from clients.agent.config import AgentConfig


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
    from clients.agent.executors.local import LocalExecutor
    from clients.agent.executors.sglang import SGLangExecutor
    from clients.agent.executors.vllm import VLLMExecutor

    registry = ExecutorRegistry()
    registry.register(ExecutorName.LOCAL, LocalExecutor.from_config)
    registry.register(ExecutorName.VLLM, VLLMExecutor.from_config)
    registry.register(ExecutorName.SGLANG, SGLangExecutor.from_config)
    return registry
