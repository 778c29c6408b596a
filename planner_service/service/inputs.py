"""What clients send: session events, node reports, what-if changes (validated by pydantic).

These are the service's input types; the API uses them as request bodies so
a malformed field is rejected with its path before the service sees it. Every
number is finite and within the physical bounds of `domain/bounds.py`.

A timestamp is also held to the server's clock, which a request body cannot
know: validating with `context={SERVER_TIME: ServerTime(now, skew)}` checks
it in pydantic, and `check_event_times` checks events already parsed without
that context, against the service's own clock.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from planner_service.domain.bounds import (
    MAX_GPU_BYTES,
    MAX_TOKENS,
    ByteCount,
    BytesPerSecond,
    Fraction,
    GpuByteCount,
    Seconds,
    Tokens,
    UnixSeconds,
)
from planner_service.domain.scenario import Capability, GpuSpecIn, ModelIn, NodeIn, Slo
from planner_service.service.errors import InvalidInput
from planner_service.wire.enums import EngineFeature, EngineState, Management, ReportedEngineState
from planner_service.wire.operations import EngineInstanceRef

EventId = Annotated[str, Field(min_length=1, max_length=200)]
Name = Annotated[str, Field(min_length=1, max_length=200)]

SERVER_TIME = "server_time"
"""The validation-context key under which a `ServerTime` holds timestamps to the server's clock."""


@dataclass(frozen=True, slots=True)
class ServerTime:
    """The server's clock now and how far a client's timestamp may be from it (`max_clock_skew_seconds`)."""

    now: float
    max_skew_seconds: float

    def skew_error(self, at: float) -> str | None:
        """Why `at` is too far from the server's clock, or None when it is within the skew."""
        skew = at - self.now
        if abs(skew) <= self.max_skew_seconds:
            return None
        side = "ahead of" if skew > 0 else "behind"
        now = datetime.fromtimestamp(self.now, UTC).isoformat().replace("+00:00", "Z")
        return (
            f"{at:.0f} is {abs(skew):.0f} s {side} the server clock ({now}); "
            f"at most {self.max_skew_seconds:.0f} s of skew is accepted"
        )


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class _Event(_In):
    id: EventId = Field(description="Unique per event; a repeated id is acknowledged and ignored.")
    session: Name
    at: UnixSeconds | None = Field(
        None,
        description="Unix seconds when it happened, within the server's clock skew "
        "(STATEBUDGET_MAX_CLOCK_SKEW_SECONDS); default: when received.",
    )

    @field_validator("at")
    @classmethod
    def _within_skew(cls, at: float | None, info: ValidationInfo) -> float | None:
        server_time = (info.context or {}).get(SERVER_TIME)
        if at is not None and isinstance(server_time, ServerTime):
            error = server_time.skew_error(at)
            if error is not None:
                raise ValueError(error)
        return at


class RequestEvent(_Event):
    type: Literal["request"]
    model: Name
    user: Name | None = None
    slo: Slo | None = None
    input_tokens: Tokens = 0
    output_tokens: Tokens = 0


class TurnEndEvent(_Event):
    type: Literal["turn_end"]
    output_tokens: Tokens = 0


class ToolCallStartEvent(_Event):
    type: Literal["tool_call_start"]
    tool: Name | None = None


class ToolCallEndEvent(_Event):
    type: Literal["tool_call_end"]
    tool: Name | None = None


class SessionEndEvent(_Event):
    type: Literal["session_end"]


Event = Annotated[
    RequestEvent | TurnEndEvent | ToolCallStartEvent | ToolCallEndEvent | SessionEndEvent,
    Field(discriminator="type"),
]


class EventsIn(_In):
    events: list[Event] = Field(min_length=1, max_length=10_000)


def check_event_times(events: Sequence[_Event], server_time: ServerTime, *, known_ids: Container[str] = ()) -> None:
    """Refuse (422, naming `events.{i}.at`) a batch in which an event's `at` is beyond the clock skew.

    Events whose id is in `known_ids` are resends of acknowledged ones, ignored anyway: an old resend must not
    make a client's whole batch fail for good.
    """
    for i, event in enumerate(events):
        if event.id in known_ids:
            continue
        error = None if event.at is None else server_time.skew_error(event.at)
        if error is not None:
            raise InvalidInput(f"events[{i}].at: {error}", field=f"events.{i}.at")


class GpuInventoryIn(_In):
    id: Name
    type: str | None = None
    hbm_bytes: GpuByteCount | None = None


class EngineIn(_In):
    name: Name = Field(description="e.g. 'vllm-coder'")
    kind: Literal["vllm", "sglang", "lmcache", "local", "other"] = "other"
    models: list[str] = Field(default_factory=list)
    url: str | None = None
    gpus: list[Name] = Field(
        default_factory=list,
        description="The cluster GPU ids the engine was launched on (its tensor-parallel group): the planner "
        "serves its models on this node only from these GPUs. Empty: the engine loads wherever the plan says.",
    )
    features: list[EngineFeature] | None = Field(
        None,
        description="vllm/sglang: the launch features it runs with (sleep_mode, dev_mode, lmcache; sleep_mode, "
        "cpu_backup). Null: those the topology declares for the model's engine of this kind.",
    )
    management: Management | None = Field(
        None,
        description="vllm/sglang: managed (the agent starts and stops it) or adopted (only sleep and wake). "
        "Null: the topology's declaration, else managed.",
    )


class RegisterIn(_In):
    capabilities: list[Capability] | None = Field(
        None, description="Moves this node's engines can carry out; replaces the node's capabilities."
    )
    gpus: list[GpuInventoryIn] = Field(default_factory=list, description="GPUs the agent sees.")
    host_dram_bytes: ByteCount | None = None
    nvme_bytes: ByteCount | None = None
    engines: list[EngineIn] = Field(
        default_factory=list,
        description="The node's engines. Where they name models, the node serves only those (each from its "
        "engine's `gpus` where given); where none does, any model on any group.",
    )
    agent_version: str | None = None
    scale: Annotated[float, Field(gt=0, le=1)] = Field(
        1.0,
        description="Bytes the agent materializes per planned byte: 1 for real copies; below 1 a scaled test run "
        "(`statebudget-agent run --executor local --scale 1e-6`), whose measured copies time its own overheads, "
        "not the links, so its reports and heartbeats do not calibrate bandwidths.",
    )


class GpuTelemetryIn(_In):
    id: Name
    used_bytes: GpuByteCount | None = Field(
        None,
        description="HBM in use as the driver counts it (NVML's used memory: every process's allocations and "
        "contexts); null: unknown. Below what the confirmed state holds on the GPU by more than the tolerance, "
        "two heartbeats in a row, the node has lost state there: recorded, and the planner replans.",
    )
    free_bytes: GpuByteCount | None = None
    total_bytes: GpuByteCount | None = Field(
        None, description="The GPU's HBM as the driver counts it (NVML's total memory); null: unknown."
    )
    h2d_bytes_per_s: BytesPerSecond | None = None
    d2h_bytes_per_s: BytesPerSecond | None = None

    @model_validator(mode="after")
    def _one_gpu_of_memory(self) -> GpuTelemetryIn:
        if self.used_bytes is not None and self.free_bytes is not None:
            if self.used_bytes + self.free_bytes > MAX_GPU_BYTES:
                raise ValueError(
                    f"used_bytes + free_bytes: {self.used_bytes + self.free_bytes} is more memory than one GPU "
                    f"holds (at most {MAX_GPU_BYTES})"
                )
        if self.total_bytes is not None:
            for name in ("used_bytes", "free_bytes"):
                value = getattr(self, name)
                if value is not None and value > self.total_bytes:
                    raise ValueError(f"{name}: {value} is more than the GPU's total_bytes {self.total_bytes}")
        return self


class EngineInstanceIn(EngineInstanceRef):
    """An engine instance as a node agent reports it: the wire's `EngineInstanceRef`, strictly validated."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    id: Name = Field(description="`<model>@<precision>@<gpu>+<gpu>...`, the group in the order of its ranks.")
    node: Name
    model: Name
    precision: Name
    gpus: list[Name] = Field(min_length=1, max_length=64, description="The tensor-parallel group; a shard per GPU.")
    kv_pool_bytes_per_gpu: GpuByteCount = Field(description="The fixed KV pool on each GPU of the group.")
    max_context_tokens: Annotated[int, Field(gt=0, le=MAX_TOKENS)] | None = Field(
        None, description="Null: the model's own limit."
    )

    @model_validator(mode="after")
    def _id_names_the_instance(self) -> EngineInstanceIn:
        if len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"gpus: {self.gpus} names a GPU twice")
        expected = self.instance_id(self.model, self.precision, self.gpus)
        if self.id != expected:
            raise ValueError(f"id: {self.id!r} is not the instance's id {expected!r} (<model>@<precision>@<gpus>)")
        return self


class EngineInstanceStateIn(_In):
    instance: EngineInstanceIn
    state: EngineState = Field(
        description="As the engine reports it. `stopped`, `asleep_discarded` and `asleep_host` mean the model's "
        "weights, experts and KV are not on the group's GPUs: two heartbeats in a row correct the confirmed state "
        "to that (objects an operation in flight is moving excepted), and the planner replans."
    )


class HeartbeatIn(_In):
    gpus: list[GpuTelemetryIn] = Field(default_factory=list, max_length=1024)
    nvme_read_bytes_per_s: BytesPerSecond | None = None
    nvme_write_bytes_per_s: BytesPerSecond | None = None
    engines: dict[str, ReportedEngineState] = Field(
        default_factory=dict, description="Engine name -> its state (running, asleep_host, ...) or status (ready, ...)."
    )
    instances: list[EngineInstanceStateIn] = Field(
        default_factory=list,
        max_length=1024,
        description="The node's engine instances and the state each is in.",
    )
    expert_hit_rates: dict[str, Fraction] = Field(
        default_factory=dict, description="Model -> fraction of routed-expert reads served from GPU."
    )

    @model_validator(mode="after")
    def _each_instance_once(self) -> HeartbeatIn:
        seen: dict[str, int] = {}
        for i, entry in enumerate(self.instances):
            if entry.instance.id in seen:
                raise ValueError(
                    f"instances[{i}].instance.id: {entry.instance.id!r} is instances[{seen[entry.instance.id]}] "
                    "too; each instance is reported once"
                )
            seen[entry.instance.id] = i
        return self


class LeaseIn(_In):
    max_operations: Annotated[int, Field(ge=1, le=1000)] = 8
    wait_seconds: Annotated[float, Field(ge=0, le=300)] = 0.0


class ReportIn(_In):
    lease_id: Name
    status: Literal["done", "failed"]
    measured_seconds: Seconds | None = None
    measured_bytes: ByteCount | None = None
    error: Annotated[str, Field(max_length=2000)] | None = None


class ModelPutIn(_In):
    """A model of the catalog (the id comes from the path)."""

    model: dict[str, Any] = Field(description="The model as in a scenario file's `models[]`, without `id`.")
    nvme_nodes: list[Name] | None = Field(
        None, description="Nodes whose NVMe holds a full copy of the weights (default: every node)."
    )


# -- what-if changes -----------------------------------------------------------


class AddGpu(_In):
    type: Literal["add_gpu"]
    node: Name
    gpu: GpuSpecIn


class RemoveGpu(_In):
    type: Literal["remove_gpu"]
    gpu: Name


class AddNode(_In):
    type: Literal["add_node"]
    node: NodeIn
    copy_models: bool = Field(True, description="Put a full copy of every model's weights on its NVMe.")


class RemoveNode(_In):
    type: Literal["remove_node"]
    node: Name


class AddModel(_In):
    type: Literal["add_model"]
    model: ModelIn
    nvme_nodes: list[Name] | None = None


class RemoveModel(_In):
    type: Literal["remove_model"]
    model: Name


class AddSessions(_In):
    type: Literal["add_sessions"]
    model: Name
    count: Annotated[int, Field(ge=1, le=10_000)]
    slo: Slo = Slo.INTERACTIVE
    context_tokens: Tokens = 8000
    active: bool = True
    user: Name = "whatif"


class SetSlo(_In):
    type: Literal["set_slo"]
    session: Name
    slo: Slo


Change = Annotated[
    AddGpu | RemoveGpu | AddNode | RemoveNode | AddModel | RemoveModel | AddSessions | SetSlo,
    Field(discriminator="type"),
]


class WhatIfIn(_In):
    changes: list[Change] = Field(default_factory=list, max_length=100)
    solver: Literal["greedy", "search", "milp"] = "greedy"
    time_limit_seconds: Annotated[float, Field(gt=0, le=120)] = 10.0
