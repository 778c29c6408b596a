"""Operations as leased from the service, and what executing one measured.

The vocabulary is the API's own (`planner_service.wire`): the agent reads operations, objects and
locations as the service writes them, and imports nothing of the planner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from planner_service.wire.enums import Action, Capability, Kind, Tier
from planner_service.wire.operations import LeasedOperation, Operation
from planner_service.wire.state import Location, StateObject

__all__ = [
    "Action",
    "Capability",
    "Kind",
    "LeasedOperation",
    "Location",
    "Operation",
    "Outcome",
    "StateObject",
    "Tier",
]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What an executor measured: wall seconds and bytes actually moved (or reclaimed, for a drop)."""

    measured_seconds: float
    measured_bytes: int | None
    details: dict[str, Any] = field(default_factory=dict)
