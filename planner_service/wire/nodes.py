"""A node agent's registration and heartbeats, and what the service answers them: the one definition the
service validates and the agent builds."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from planner_service.wire.base import WireIn, WireModel
from planner_service.wire.bounds import (
    MAX_GPU_BYTES,
    MAX_TOKENS,
    ByteCount,
    BytesPerSecond,
    Fraction,
    GpuByteCount,
    Name,
)
from planner_service.wire.cluster import Calibrated, NodeEngine
from planner_service.wire.enums import Capability, EngineFeature, EngineState, Management, ReportedEngineState
from planner_service.wire.operations import EngineInstanceRef


class RegisterOut(WireModel):
    node: str
    registered_at: str | None = Field(description="ISO 8601, UTC.")
    capabilities: list[Capability]
    engines: list[NodeEngine] | None = Field(
        description="The models the node serves through its engines, {model, gpus} (gpus: fixed ones, or empty); "
        "null: any model, on any group."
    )
    gpus: list[str]
    lease_seconds: float
    scale: float = Field(
        1.0, description="The scale the agent registered; below 1 its measurements do not calibrate bandwidths."
    )
    warnings: list[str]


class HeartbeatOut(WireModel):
    node: str
    received_at: str | None = Field(description="ISO 8601, UTC.")
    calibration: dict[str, Calibrated] = Field(description="The node's recalibrated bandwidths.")


class GpuInventoryIn(WireIn):
    id: Name
    type: str | None = None
    hbm_bytes: GpuByteCount | None = None


class EngineIn(WireIn):
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


class RegisterIn(WireIn):
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


class GpuProcessIn(WireIn):
    """One process holding memory on the GPU, as NVML lists its compute processes."""

    pid: int = Field(ge=1, le=2**31 - 1)
    used_bytes: GpuByteCount = Field(description="NVML's usedGpuMemory for it.")
    engine: Name | None = Field(
        None, description="The agent's managed engine whose process group it is; null: no engine the agent started."
    )


class GpuTelemetryIn(WireIn):
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
    processes: list[GpuProcessIn] = Field(
        default_factory=list,
        max_length=1024,
        description="The processes holding its memory (NVML's compute processes), each with the engine it belongs to "
        "where the agent started it: what `used_bytes` is made of.",
    )

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


class EngineInstanceStateIn(WireIn):
    instance: EngineInstanceIn
    state: EngineState = Field(
        description="As the engine reports it. `stopped`, `asleep_discarded` and `asleep_host` mean the model's "
        "weights, experts and KV are not on the group's GPUs, and `running` that they are on no other GPU of the "
        "node: two heartbeats in a row correct the confirmed state to that (objects an operation in flight is "
        "moving excepted), and the planner replans."
    )


class HeartbeatIn(WireIn):
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
