"""The service's live records: sessions, queued operations and quarantined placement entries, with their JSON
forms."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, MutableSet
from collections.abc import Set as AbstractSet
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from planner_service.domain.scenario import Slo
from planner_service.domain.state import Location, StateObject, entry_json, location_from_json, object_from_json
from planner_service.planner.operations import Action, Operation, Priority
from planner_service.wire.operations import EngineStep


@dataclass(frozen=True, slots=True)
class Quarantined:
    """A placement entry a start took out of the stored state because it broke a physical invariant."""

    object: StateObject
    location: Location
    bytes: int
    why: str

    def to_json(self) -> dict[str, Any]:
        return entry_json(self.object, self.location, self.bytes) | {"why": self.why}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Quarantined:
        return cls(
            object_from_json(data["object"]), location_from_json(data["location"]), int(data["bytes"]), str(data["why"])
        )


class OpState(StrEnum):
    QUEUED = "queued"
    LEASED = "leased"
    DONE = "done"
    FAILED = "failed"
    SUPERSEDED = "superseded"


FINAL_STATES = frozenset({OpState.DONE, OpState.FAILED, OpState.SUPERSEDED})


def operation_from_json(data: dict[str, Any]) -> Operation:
    return Operation(
        id=data["id"],
        action=Action(data["action"]),
        object=object_from_json(data["object"]),
        source=location_from_json(data["from"]) if data.get("from") else None,
        dest=location_from_json(data["to"]) if data.get("to") else None,
        bytes=int(data["bytes"]),
        keep_source=bool(data["keep_source"]),
        priority=Priority(data["priority"]),
        depends_on=list(data["depends_on"]),
        estimated_seconds=float(data["estimated_seconds"]),
        why=data.get("reason", ""),
        node=data["node"],
        engine=EngineStep.model_validate(data["engine"]) if data.get("engine") else None,
    )


@dataclass
class OpRecord:
    """One operation of one plan epoch and where it is in its lifecycle."""

    op: Operation  # ids already qualified by the epoch ("3.op-1")
    epoch: int
    seq: int  # position in its plan's topological order
    state: OpState = OpState.QUEUED
    created_at: float = 0.0
    updated_at: float = 0.0
    lease_id: str | None = None
    lease_expires_at: float | None = None
    leases: int = 0  # times leased (re-queued after an expiry counts again)
    measured_seconds: float | None = None
    measured_bytes: int | None = None
    error: str | None = None
    superseded_by: int | None = None
    conflict: str | None = None  # why a `done` report was not applied: it would break a physical invariant

    @property
    def id(self) -> str:
        return self.op.id

    @property
    def node(self) -> str:
        return self.op.node

    def to_json(self) -> dict[str, Any]:
        return {
            **self.op.to_json(),
            "epoch": self.epoch,
            "seq": self.seq,
            "state": self.state.value,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "lease_id": self.lease_id,
            "lease_expires_at": self.lease_expires_at,
            "leases": self.leases,
            "measured_seconds": self.measured_seconds,
            "measured_bytes": self.measured_bytes,
            "error": self.error,
            "superseded_by": self.superseded_by,
            "conflict": self.conflict,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OpRecord:
        return cls(
            op=operation_from_json(data),
            epoch=int(data["epoch"]),
            seq=int(data["seq"]),
            state=OpState(data["state"]),
            created_at=float(data["created_at"]),
            updated_at=float(data["updated_at"]),
            lease_id=data.get("lease_id"),
            lease_expires_at=data.get("lease_expires_at"),
            leases=int(data.get("leases", 0)),
            measured_seconds=data.get("measured_seconds"),
            measured_bytes=data.get("measured_bytes"),
            error=data.get("error"),
            superseded_by=data.get("superseded_by"),
            conflict=data.get("conflict"),
        )


class OpenOps(MutableSet[str]):
    """The ids of the queued and leased operations, indexed by node: a lease looks only at its node's, so
    its cost does not grow with the other nodes' queues."""

    def __init__(self, ops: Mapping[str, OpRecord], ids: Iterable[str] = ()) -> None:
        self._ops = ops
        self._node: dict[str, str] = {}  # id -> node, kept here: a pruned record may be discarded after
        self._by_node: dict[str, set[str]] = {}
        for oid in ids:
            self.add(oid)

    def __contains__(self, oid: object) -> bool:
        return oid in self._node

    def __iter__(self) -> Iterator[str]:
        return iter(self._node)

    def __len__(self) -> int:
        return len(self._node)

    def add(self, oid: str) -> None:
        if oid not in self._node:
            node = self._ops[oid].node
            self._node[oid] = node
            self._by_node.setdefault(node, set()).add(oid)

    def discard(self, oid: str) -> None:
        node = self._node.pop(oid, None)
        if node is not None:
            ids = self._by_node[node]
            ids.discard(oid)
            if not ids:
                del self._by_node[node]

    def of_node(self, node: str) -> AbstractSet[str]:
        return self._by_node.get(node, frozenset())


@dataclass
class SessionState:
    id: str
    user: str
    slo: Slo
    model: str
    active: bool = False
    context_tokens: int = 0
    cached_tokens: dict[str, int] = field(default_factory=dict)  # model -> context tokens its KV holds
    requests: int = 0
    tool_calls: int = 0
    in_tool_call: bool = False
    ended: bool = False
    created_at: float = 0.0
    last_activity: float = 0.0
    last_turn_end: float | None = None
    waiting_since: float | None = None  # a request not yet served on GPU (observed switch latency)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["slo"] = self.slo.value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SessionState:
        return cls(**{**data, "slo": Slo(data["slo"])})
