"""The documents the service publishes: the SRV of the confirmed placement and the plan the queues carry out.

Each is immutable: a publish or an installed plan replaces it whole, so a reader holding one never sees it
change. They are stored as the `srv` and `plan` meta rows, in the JSON they have always had there.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import Field, ValidationError

from planner_service.planner.srv import SrvRow
from planner_service.wire.base import WireModel
from planner_service.wire.enums import EngineFeature, EngineKind, EngineState, Management
from planner_service.wire.plan import CurrentPlanOut

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PublishedSrv:
    """The SRV as last published; `version` moves exactly when `rows` or the placement it was computed from do."""

    version: int
    rows: tuple[SrvRow, ...]
    # the stored JSON, made once: a done report stores the SRV row with every placement change it commits
    _json: dict[str, Any] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_json", {"version": self.version, "srv": [r.to_json() for r in self.rows]})

    def to_json(self) -> dict[str, Any]:
        """`{version, srv}`, as stored (shared: not to be changed)."""
        return self._json

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PublishedSrv:
        return cls(int(data["version"]), tuple(SrvRow.from_json(r) for r in data["srv"]))


class PlannedInstance(WireModel):
    """An engine instance as the plan leaves it (`planner/engine_instances.py`'s `InstanceView`)."""

    node: str
    model: str
    kind: EngineKind
    state: EngineState
    precision: str | None
    gpus: list[str]
    features: list[EngineFeature]
    management: Management


class InstalledPlan(CurrentPlanOut):
    """The plan the queues carry out, as `GET /v1/plan` answers it, with the engine instances it ends with on
    engine nodes (stored, not published). Fields its solver does not set stay unset, and out of its JSON."""

    engines: list[PlannedInstance] | None = Field(None, description="Engine nodes only: the instances it ends with.")

    def to_json(self) -> dict[str, Any]:
        """As stored in the `plan` meta row."""
        return self.model_dump(mode="json", exclude_unset=True)

    def placement_json(self) -> list[dict[str, Any]]:
        return [entry.model_dump(mode="json") for entry in self.placement]

    def public_json(self) -> dict[str, Any]:
        """As `GET /v1/plan` answers it."""
        return self.model_dump(mode="json", exclude_unset=True, exclude={"engines"})

    @classmethod
    def from_stored(cls, data: Mapping[str, Any] | None) -> InstalledPlan | None:
        """The stored plan. One that no longer validates (a database of an older build) is dropped and logged,
        not fatal: with no plan the planning loop plans at once."""
        if data is None:
            return None
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            log.error("the stored plan is not valid any more, planning anew: %s", error)
            return None
