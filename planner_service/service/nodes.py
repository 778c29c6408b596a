"""What the service keeps of each node's agent: its registration, its latest heartbeat, and what that heartbeat
said against the confirmed placement.

Each record is immutable and replaced whole when a registration or heartbeat lands, so a reader holding one
never sees it change. The registration and the telemetry are the request bodies as validated on arrival
(`wire/nodes.py`). All of it is stored as the JSON of the `nodes` meta row, in the shape it has always had:
`{node: {registration, registered_at, telemetry, last_heartbeat, reconcile}}`, each key present once set.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import ValidationError

from planner_service.domain.state import Location, StateObject, entry_json, location_from_json, object_from_json
from planner_service.service.reconcile import Gone, Shortfall
from planner_service.wire.nodes import HeartbeatIn, RegisterIn

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Correction:
    """A placement entry taken out of the confirmed state because the node's engine reported it gone."""

    object: StateObject
    location: Location
    bytes: int
    why: str
    at: str  # ISO 8601, UTC

    @classmethod
    def of(cls, gone: Gone, at: str) -> Correction:
        return cls(gone.object, gone.location, gone.bytes, gone.why, at)

    def to_json(self) -> dict[str, Any]:
        return entry_json(self.object, self.location, self.bytes) | {"why": self.why, "at": self.at}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Correction:
        return cls(
            object_from_json(data["object"]),
            location_from_json(data["location"]),
            int(data["bytes"]),
            str(data["why"]),
            str(data["at"]),
        )


@dataclass(frozen=True, slots=True)
class Pending:
    """Findings of the latest heartbeat waiting for the next one to repeat them before they count."""

    gpus: tuple[str, ...] = ()  # GPUs short of the confirmed bytes
    gone: tuple[str, ...] = ()  # `Gone.key()` of entries an engine reported gone

    def to_json(self) -> dict[str, Any]:
        return {"gpus": list(self.gpus), "gone": list(self.gone)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Pending:
        data = data or {}
        return cls(tuple(data.get("gpus", ())), tuple(data.get("gone", ())))


@dataclass(frozen=True, slots=True)
class ReconcileStatus:
    """What a node's latest heartbeats said against the confirmed placement (`service/reconcile.py`)."""

    checked_at: str  # ISO 8601, UTC: the latest heartbeat
    lost: tuple[Shortfall, ...]  # GPUs two heartbeats in a row found short
    corrected: tuple[Correction, ...]  # the latest corrections, oldest first
    pending: Pending

    def to_json(self) -> dict[str, Any]:
        return {
            "checked_at": self.checked_at,
            "lost": [s.to_json() for s in self.lost],
            "corrected": [c.to_json() for c in self.corrected],
            "pending": self.pending.to_json(),
        }

    def public_json(self) -> dict[str, Any]:
        """As `GET /v1/cluster` shows it: without the findings still waiting for a second heartbeat."""
        out = self.to_json()
        del out["pending"]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ReconcileStatus:
        return cls(
            str(data["checked_at"]),
            tuple(Shortfall.from_json(s) for s in data.get("lost", ())),
            tuple(Correction.from_json(c) for c in data.get("corrected", ())),
            Pending.from_json(data.get("pending")),
        )


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """One node's agent as the service last heard it; a field stays None until its first message."""

    registration: RegisterIn | None = None
    registered_at: str | None = None  # ISO 8601, UTC
    telemetry: HeartbeatIn | None = None
    last_heartbeat: str | None = None  # ISO 8601, UTC
    reconcile: ReconcileStatus | None = None
    # the stored JSON, made once: the `nodes` row is written whole on every heartbeat of any node
    _json: dict[str, Any] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        out: dict[str, Any] = {}
        if self.registration is not None:
            out["registration"] = self.registration.model_dump(mode="json")
            out["registered_at"] = self.registered_at
        if self.reconcile is not None:
            out["reconcile"] = self.reconcile.to_json()
        if self.telemetry is not None:
            out["telemetry"] = self.telemetry.model_dump(mode="json")
            out["last_heartbeat"] = self.last_heartbeat
        object.__setattr__(self, "_json", out)

    @property
    def scale(self) -> float:
        """The scale its agent registered (1 where none did: real copies)."""
        return self.registration.scale if self.registration is not None else 1.0

    def registered(self, body: RegisterIn, at: str | None) -> NodeRecord:
        return dataclasses.replace(self, registration=body, registered_at=at)

    def heard(self, body: HeartbeatIn, at: str | None, reconciled: ReconcileStatus) -> NodeRecord:
        return dataclasses.replace(self, telemetry=body, last_heartbeat=at, reconcile=reconciled)

    def to_json(self) -> dict[str, Any]:
        """As stored (shared: not to be changed)."""
        return self._json

    @classmethod
    def from_json(cls, node_id: str, data: Mapping[str, Any]) -> NodeRecord:
        """A stored record. A part that no longer validates (a database of an older build) is forgotten and
        logged, not fatal: the node's next registration or heartbeat brings it back."""
        reconcile = data.get("reconcile")
        return cls(
            registration=_validated(RegisterIn, data.get("registration"), node_id, "registration"),
            registered_at=data.get("registered_at"),
            telemetry=_validated(HeartbeatIn, data.get("telemetry"), node_id, "telemetry"),
            last_heartbeat=data.get("last_heartbeat"),
            reconcile=ReconcileStatus.from_json(reconcile) if reconcile else None,
        )


Body = TypeVar("Body", RegisterIn, HeartbeatIn)


def _validated(model: type[Body], data: Any, node_id: str, part: str) -> Body | None:
    if data is None:
        return None
    try:
        return model.model_validate(data)
    except ValidationError as error:
        log.error(
            "the stored %s of node %s is not valid any more, forgotten until the next one: %s", part, node_id, error
        )
        return None


def nodes_to_json(nodes: Mapping[str, NodeRecord]) -> dict[str, dict[str, Any]]:
    """The `nodes` meta row."""
    return {node_id: record.to_json() for node_id, record in nodes.items()}


def nodes_from_json(data: Mapping[str, Any] | None) -> dict[str, NodeRecord]:
    return {node_id: NodeRecord.from_json(node_id, record) for node_id, record in (data or {}).items()}
