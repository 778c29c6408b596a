"""What clients send: session events, node reports, what-if changes (validated by pydantic).

These are the service's input types; the API uses them as request bodies so
a malformed field is rejected with its path before the service sees it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from planner_service.domain.scenario import Capability, GpuSpecIn, ModelIn, NodeIn, Slo

NonNegInt = Annotated[int, Field(ge=0)]
Tokens = Annotated[int, Field(ge=0, le=100_000_000, description="Tokens (at most 100 million).")]
EventId = Annotated[str, Field(min_length=1, max_length=200)]
Name = Annotated[str, Field(min_length=1, max_length=200)]

MAX_UNIX_SECONDS = 253_402_300_799  # 9999-12-31T23:59:59Z, the last instant a timestamp can show


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Event(_In):
    id: EventId = Field(description="Unique per event; a repeated id is acknowledged and ignored.")
    session: Name
    at: float | None = Field(
        None,
        ge=0,
        le=MAX_UNIX_SECONDS,
        description="Unix seconds when it happened; default: when received.",
    )


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


class GpuInventoryIn(_In):
    id: Name
    type: str | None = None
    hbm_bytes: NonNegInt | None = None


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


class RegisterIn(_In):
    capabilities: list[Capability] | None = Field(
        None, description="Moves this node's engines can carry out; replaces the node's capabilities."
    )
    gpus: list[GpuInventoryIn] = Field(default_factory=list, description="GPUs the agent sees.")
    host_dram_bytes: NonNegInt | None = None
    nvme_bytes: NonNegInt | None = None
    engines: list[EngineIn] = Field(
        default_factory=list,
        description="The node's engines. Where they name models, the node serves only those (each from its "
        "engine's `gpus` where given); where none does, any model on any group.",
    )
    agent_version: str | None = None


class GpuTelemetryIn(_In):
    id: Name
    used_bytes: NonNegInt | None = None
    free_bytes: NonNegInt | None = None
    h2d_bytes_per_s: Annotated[float, Field(gt=0)] | None = None
    d2h_bytes_per_s: Annotated[float, Field(gt=0)] | None = None


class HeartbeatIn(_In):
    gpus: list[GpuTelemetryIn] = Field(default_factory=list)
    nvme_read_bytes_per_s: Annotated[float, Field(gt=0)] | None = None
    nvme_write_bytes_per_s: Annotated[float, Field(gt=0)] | None = None
    engines: dict[str, str] = Field(default_factory=dict, description="Engine name -> state (awake, sleeping, ...).")
    expert_hit_rates: dict[str, Annotated[float, Field(ge=0, le=1)]] = Field(
        default_factory=dict, description="Model -> fraction of routed-expert reads served from GPU."
    )


class LeaseIn(_In):
    max_operations: Annotated[int, Field(ge=1, le=1000)] = 8
    wait_seconds: Annotated[float, Field(ge=0, le=300)] = 0.0


class ReportIn(_In):
    lease_id: Name
    status: Literal["done", "failed"]
    measured_seconds: Annotated[float, Field(ge=0)] | None = None
    measured_bytes: NonNegInt | None = None
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
