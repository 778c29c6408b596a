"""State objects, locations and placements as the API writes them.

`{"kind": "weights", "model": "coder", "precision": "bf16"}`, `{"kind": "kv", "model": "coder", "session":
"s1"}`, `{"kind": "experts", "model": "reasoner"}`; `{"tier": "gpu", "gpu": "n1/0"}` or `{"tier": "host",
"node": "n1"}`. A field that does not apply to the kind or tier is absent (validated here: present where it
applies).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from planner_service.wire.base import WireModel
from planner_service.wire.enums import Kind, Tier


class StateObject(WireModel):
    """`weights(model, precision)`, `experts(model)` or `kv(model, session)`."""

    kind: Kind
    model: str
    precision: str | None = Field(None, description="Weights only: the precision they are stored at.")
    session: str | None = Field(None, description="KV only: the session it belongs to.")

    @model_validator(mode="after")
    def _fields_for_kind(self) -> StateObject:
        if self.kind is Kind.WEIGHTS and self.precision is None:
            raise ValueError("a weights object needs 'precision'")
        if self.kind is Kind.KV and self.session is None:
            raise ValueError("a kv object needs 'session'")
        return self

    def key(self) -> str:
        """A stable name, fit for a file or a store entry: `weights__coder__bf16`, `kv__coder__s07`,
        `experts__reasoner`."""
        extra = self.precision if self.kind is Kind.WEIGHTS else self.session if self.kind is Kind.KV else None
        return "__".join(p for p in (self.kind.value, self.model, extra) if p)

    def label(self) -> str:
        if self.kind is Kind.WEIGHTS:
            return f"weights({self.model}, {self.precision})"
        if self.kind is Kind.KV:
            return f"kv({self.model}, {self.session})"
        return f"experts({self.model})"


class Location(WireModel):
    """A GPU (`gpu`: its id) or a node's host DRAM or NVMe (`node`: the node's id)."""

    tier: Tier
    gpu: str | None = Field(None, description="Tier gpu only: the GPU's id.")
    node: str | None = Field(None, description="Tiers host and nvme only: the node's id.")

    @model_validator(mode="after")
    def _fields_for_tier(self) -> Location:
        if self.tier is Tier.GPU and self.gpu is None:
            raise ValueError("a gpu location needs 'gpu'")
        if self.tier is not Tier.GPU and self.node is None:
            raise ValueError(f"a {self.tier.value} location needs 'node'")
        return self

    @classmethod
    def at(cls, tier: Tier, id: str) -> Location:
        """The location of tier `tier` whose GPU id (tier gpu) or node id (host, nvme) is `id`."""
        return cls(tier=tier, gpu=id) if tier is Tier.GPU else cls(tier=tier, node=id)

    @property
    def id(self) -> str:
        """The GPU id for tier gpu, the node id otherwise."""
        value = self.gpu if self.tier is Tier.GPU else self.node
        assert value is not None  # checked on construction
        return value

    def label(self) -> str:
        return f"{self.tier.value}:{self.id}"


class PlacementEntry(WireModel):
    """Bytes of one state object held at one location."""

    object: StateObject
    location: Location
    bytes: int


class SrvRow(WireModel):
    """The resident fraction r[m, s, t] of one model's state kind on one tier, and its bytes."""

    model: str
    state: Kind
    tier: Tier
    fraction: float
    bytes: int


class SrvOut(WireModel):
    """The State Residency Vector and the confirmed placement; `version` changes only when they do."""

    version: int
    srv: list[SrvRow]
    placement: list[PlacementEntry]
