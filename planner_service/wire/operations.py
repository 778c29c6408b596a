"""Operations as the planner emits them, as a node leases them, and as the queues record them; a node's lease
request and its report of an operation."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, Strict

from planner_service.wire.base import WireIn, WireModel
from planner_service.wire.bounds import ByteCount, Name, Seconds
from planner_service.wire.enums import (
    Action,
    EngineFeature,
    EngineKind,
    EngineState,
    Management,
    OperationState,
    Priority,
    Transition,
)
from planner_service.wire.state import Location, StateObject


class EngineInstanceRef(WireModel):
    """One engine instance: an engine kind serving one model at one precision on one GPU group with fixed
    launch settings (planner_service/domain/engines.py). Changing a launch setting is a restart into another
    instance; `id` names the model, precision and group, so a restart keeps it when only settings change."""

    id: str = Field(description="`<model>@<precision>@<gpu>+<gpu>...`, the group in the order of its ranks.")
    node: str
    kind: EngineKind
    model: str
    precision: str
    gpus: list[str] = Field(description="The tensor-parallel group; a shard per GPU.")
    kv_pool_bytes_per_gpu: int = Field(ge=0, description="The fixed KV pool on each GPU of the group.")
    kv_pool_tokens: int = Field(
        0,
        ge=0,
        description="The pool in tokens of the model's KV, each token's bytes split over the group as the planner "
        "splits KV (SGLang's --max-total-tokens); 0: the model's KV per token is unknown.",
    )
    gpu_expert_fraction: float = Field(1.0, ge=0, le=1, description="A MoE's routed experts kept on GPU.")
    max_context_tokens: int | None = Field(None, gt=0, description="Null: the model's own limit.")
    features: list[EngineFeature] = Field(default_factory=list, description="Launch features.")
    management: Management = Management.MANAGED

    @staticmethod
    def instance_id(model: str, precision: str, gpus: list[str] | tuple[str, ...]) -> str:
        return f"{model}@{precision}@{'+'.join(gpus)}"


class EngineStep(WireModel):
    """The engine transition an operation carries out on an engine node: one call to the engine (or to the
    node agent's process manager) for the whole instance, never one per shard.

    The operation's `object`, `from`, `to` and `bytes` say what the step does to the SRV (the operator's
    view: start and wake promote the weights to the group's GPUs, a level-1 sleep demotes them to host RAM, a
    level-2 sleep and a stop drop them, a read-ahead copies the checkpoint into the page cache of host RAM).
    """

    transition: Transition
    instance: EngineInstanceRef = Field(description="The instance after the step (a restart's new settings).")
    from_state: EngineState = Field(description="The state the planner expects the instance in before the step.")
    previous: EngineInstanceRef | None = Field(None, description="Restart only: the instance it stops first.")


class Operation(WireModel):
    """`promote` / `demote` / `drop` of one state object between tiers of one node.

    `from` is null for KV created by prefill; `to` is null for a drop. With `keep_source` the source keeps
    its copy (a promotion copies). An operation may run once every id in `depends_on` is done. On an engine
    node (vLLM, SGLang) the move is an engine transition, named by `engine`; null: a move of the bytes
    themselves, which only the `local` executor carries out.
    """

    id: str
    action: Action
    object: StateObject
    source: Location | None = Field(alias="from", description="Where the bytes come from; null: made by prefill.")
    dest: Location | None = Field(alias="to", description="Where the bytes go; null: dropped.")
    bytes: int
    keep_source: bool
    priority: Priority
    depends_on: list[str]
    estimated_seconds: float
    reason: str = Field(description="What the planner expects the operation to buy, in words.")
    node: str = Field(description="The node it runs on: a move never leaves its node.")
    engine: EngineStep | None = Field(None, description="The engine transition that carries the move out.")

    @property
    def frees(self) -> Location | None:
        """The location this operation takes bytes from, if any."""
        return None if self.keep_source else self.source

    def label(self) -> str:
        src = self.source.label() if self.source else "prefill"
        dst = self.dest.label() if self.dest else "nothing"
        return f"{self.id} {self.action.value} {self.object.label()} {src} -> {dst} ({self.bytes} B)"


class LeasedOperation(Operation):
    epoch: int = Field(description="The plan epoch that made it.")


class OperationRecord(Operation):
    """An operation of one plan epoch and where it is in its lifecycle."""

    epoch: int
    seq: int = Field(description="Its position in its plan's topological order.")
    state: OperationState
    created_at: float = Field(description="Unix seconds.")
    updated_at: float = Field(description="Unix seconds.")
    lease_id: str | None
    lease_expires_at: float | None = Field(description="Unix seconds.")
    leases: int = Field(description="Times leased (a lease that expired counts too).")
    measured_seconds: float | None
    measured_bytes: int | None
    error: str | None
    superseded_by: int | None = Field(description="The plan epoch that superseded it.")
    conflict: str | None = Field(
        None,
        description="Why a `done` report was recorded but not applied: it would break a physical invariant "
        "(the source without the bytes, the destination without room, an object over its size).",
    )


class LeaseOut(WireModel):
    """Operations leased to a node; none when nothing was ready within the wait."""

    lease_id: str | None
    expires_at: str | None = Field(description="ISO 8601, UTC.")
    expires_in_seconds: float | None
    operations: list[LeasedOperation]


class RenewOut(WireModel):
    """A lease renewed: the operations it still holds keep it until `expires_at`."""

    lease_id: str
    node: str
    expires_at: str = Field(description="ISO 8601, UTC: `lease_seconds` from the renewal.")
    expires_in_seconds: float
    operations: list[str] = Field(
        description="The ids of the operations the lease still holds (those not reported yet), in plan order."
    )


class ReportOut(WireModel):
    operation: OperationRecord
    srv_version: int
    duplicate: bool = Field(description="The same report was received before; nothing changed.")


class HeldBack(WireModel):
    """A move of the plan kept out of the queue until `until`: the same move failed on the node recently."""

    operation: Operation
    until: str | None = Field(description="ISO 8601, UTC.")
    failures: int
    error: str | None


class LeaseIn(WireIn):
    # strict: a `true` or a "5" is refused, not read as 1 or 5 (the fuzzing of docs/reliability.md found it)
    max_operations: Annotated[int, Strict(), Field(ge=1, le=1000)] = 8
    wait_seconds: Annotated[float, Strict(), Field(ge=0, le=300)] = 0.0


class ReportIn(WireIn):
    lease_id: Name
    status: Literal["done", "failed"]
    measured_seconds: Seconds | None = None
    measured_bytes: ByteCount | None = None
    error: Annotated[str, Field(max_length=2000)] | None = None
