"""The one interface every executor implements, and what it reports (the registry is in `registry.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from clients.agent.operations import Capability, Operation, Outcome
from planner_service.wire.enums import ReportedEngineState
from planner_service.wire.state import PlacementEntry


@dataclass(frozen=True, slots=True)
class GpuUsage:
    id: str
    used_bytes: int | None
    free_bytes: int | None
    total_bytes: int | None = None
    processes: tuple[tuple[int, int, str | None], ...] = ()  # (pid, bytes, the agent's engine it belongs to)


@dataclass(frozen=True, slots=True)
class Telemetry:
    gpus: list[GpuUsage] = field(default_factory=list)
    engines: dict[str, ReportedEngineState] = field(default_factory=dict)  # engine name -> its state or status
    instances: list[dict[str, Any]] = field(default_factory=list)  # {instance: EngineInstanceRef, state}


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
class Reconciling(Protocol):
    """An executor that reads its engines' real state (at start, before each heartbeat): what differs from
    what it last knew is returned as drift, one line each."""

    async def reconcile(self) -> list[str]: ...


@runtime_checkable
class Seedable(Protocol):
    """An executor that can materialize state the service says is already there (the local one)."""

    def seed(self, placement: list[PlacementEntry], node_id: str, gpu_ids: set[str]) -> int: ...
