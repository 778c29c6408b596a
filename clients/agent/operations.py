"""Operations as leased from the service, and what executing one measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The wire vocabulary is the planner's own.
from planner_service.domain.scenario import Capability
from planner_service.domain.state import Kind, Tier
from planner_service.planner.operations import Action

__all__ = ["Action", "Capability", "Kind", "Location", "Operation", "Outcome", "StateObject", "Tier"]


@dataclass(frozen=True, slots=True)
class Location:
    tier: Tier
    id: str  # a GPU id, or a node id for host / nvme

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Location | None:
        if data is None:
            return None
        tier = Tier(data["tier"])
        return cls(tier, data["gpu"] if tier is Tier.GPU else data["node"])

    def to_json(self) -> dict[str, str]:
        return {"tier": self.tier.value, ("gpu" if self.tier is Tier.GPU else "node"): self.id}

    def label(self) -> str:
        return f"{self.tier.value}:{self.id}"


@dataclass(frozen=True, slots=True)
class StateObject:
    kind: Kind
    model: str
    precision: str | None = None
    session: str | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StateObject:
        return cls(Kind(data["kind"]), data["model"], data.get("precision"), data.get("session"))

    def to_json(self) -> dict[str, str]:
        out = {"kind": self.kind.value, "model": self.model}
        if self.kind is Kind.WEIGHTS:
            out["precision"] = self.precision or ""
        elif self.kind is Kind.KV:
            out["session"] = self.session or ""
        return out

    def key(self) -> str:
        """One file / store entry per object: `weights__coder__bf16`, `kv__coder__s07`, `experts__reasoner`."""
        extra = self.precision if self.kind is Kind.WEIGHTS else self.session if self.kind is Kind.KV else None
        return "__".join(p for p in (self.kind.value, self.model, extra) if p)

    def label(self) -> str:
        extra = self.precision if self.kind is Kind.WEIGHTS else self.session
        return f"{self.kind.value}({self.model}{', ' + extra if extra else ''})"


@dataclass(frozen=True, slots=True)
class Operation:
    id: str
    action: Action
    object: StateObject
    source: Location | None
    dest: Location | None
    bytes: int
    keep_source: bool
    node: str
    priority: str = "background"
    depends_on: tuple[str, ...] = ()
    estimated_seconds: float = 0.0
    epoch: int | None = None
    reason: str = ""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Operation:
        return cls(
            id=data["id"],
            action=Action(data["action"]),
            object=StateObject.from_json(data["object"]),
            source=Location.from_json(data.get("from")),
            dest=Location.from_json(data.get("to")),
            bytes=int(data["bytes"]),
            keep_source=bool(data.get("keep_source", False)),
            node=data.get("node", ""),
            priority=data.get("priority", "background"),
            depends_on=tuple(data.get("depends_on") or ()),
            estimated_seconds=float(data.get("estimated_seconds") or 0.0),
            epoch=data.get("epoch"),
            reason=data.get("reason", ""),
        )

    @property
    def frees(self) -> Location | None:
        """Where this operation takes bytes away (its source, unless it keeps it)."""
        return None if self.keep_source else self.source

    def label(self) -> str:
        src = self.source.label() if self.source else "prefill"
        dst = self.dest.label() if self.dest else "nothing"
        return f"{self.id} {self.action.value} {self.object.label()} {src} -> {dst} ({self.bytes} B)"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What an executor measured: wall seconds and bytes actually moved (or reclaimed, for a drop)."""

    measured_seconds: float
    measured_bytes: int | None
    details: dict[str, Any] = field(default_factory=dict)
