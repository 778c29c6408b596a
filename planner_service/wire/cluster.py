"""The cluster and the model catalog as the service shows them."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from planner_service.wire.base import WireModel
from planner_service.wire.enums import Capability, EngineState, ReportedEngineState
from planner_service.wire.operations import EngineInstanceRef
from planner_service.wire.state import Location, StateObject


class Calibrated(WireModel):
    """A bandwidth recalibrated from measurements: the moving average, its sample count, the newest sample."""

    value: float
    samples: int = Field(description="Samples accepted into the average.")
    last_measured: float = Field(description="The newest sample that passed the link's plausible range (B/s).")
    outliers: int = Field(
        0, description="Outliers in a row against the average: above (+) or below (-); three count as a change."
    )
    catalog: float | None = Field(None, description="The catalog bandwidth the plausible range is drawn around.")


class NodeEngine(WireModel):
    """A model the node serves through one of its engines, and the GPUs that engine runs on."""

    model: str
    gpus: list[str] = Field(description="The engine's fixed GPUs; empty: any group.")
    url: str | None = Field(None, description="The engine's OpenAI server base URL, as registered; null: not given.")


class GpuProcessOut(WireModel):
    pid: int
    used_bytes: int
    engine: str | None = Field(None, description="The agent's managed engine it belongs to; null: none.")


class GpuTelemetryOut(WireModel):
    id: str
    used_bytes: int | None = None
    free_bytes: int | None = None
    total_bytes: int | None = None
    h2d_bytes_per_s: float | None = None
    d2h_bytes_per_s: float | None = None
    processes: list[GpuProcessOut] = Field(default_factory=list, description="NVML's compute processes and bytes.")


class EngineInstanceStateOut(WireModel):
    instance: EngineInstanceRef
    state: EngineState


class TelemetryOut(WireModel):
    """A node's latest heartbeat, as sent."""

    gpus: list[GpuTelemetryOut] = Field(default_factory=list)
    nvme_read_bytes_per_s: float | None = None
    nvme_write_bytes_per_s: float | None = None
    engines: dict[str, ReportedEngineState] = Field(
        default_factory=dict, description="Engine name -> its state or status, as reported."
    )
    instances: list[EngineInstanceStateOut] = Field(default_factory=list)
    expert_hit_rates: dict[str, float] = Field(default_factory=dict)


class ShortfallOut(WireModel):
    """A GPU holding less than the confirmed state says: the node lost state there."""

    gpu: str
    confirmed_bytes: int = Field(description="HBM the confirmed placement holds on the GPU.")
    used_bytes: int = Field(description="HBM the node measured in use.")
    missing_bytes: int


class CorrectionOut(WireModel):
    """A placement entry taken out of the confirmed state because the node's engine reported it gone."""

    object: StateObject
    location: Location
    bytes: int
    why: str
    at: str = Field(description="ISO 8601, UTC.")


class ReconcileOut(WireModel):
    """What the node's latest heartbeats said against the confirmed placement. A finding counts when two
    heartbeats in a row show it."""

    checked_at: str = Field(description="ISO 8601, UTC: the latest heartbeat.")
    lost: list[ShortfallOut] = Field(
        description="GPUs whose measured use is below the confirmed bytes by more than 5% of their capacity "
        "plus what operations in flight take off them."
    )
    corrected: list[CorrectionOut] = Field(description="The latest corrections, oldest first (at most 20).")


class GpuOut(WireModel):
    """A GPU with its effective (calibrated) bandwidths and its confirmed and planned HBM use."""

    id: str
    type: str | None
    capacity_bytes: int
    reserved_bytes: int
    hbm_bytes_per_s: float
    bf16_flops: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    used_bytes: int = Field(description="HBM the confirmed placement holds.")
    planned_bytes: int = Field(description="HBM the plan holds.")
    calibrated: dict[str, Calibrated] = Field(description="Bandwidth field -> its calibration.")


class NodeOut(WireModel):
    id: str
    host_dram_bytes: int
    nvme_bytes: int
    nvme_read_bytes_per_s: float
    nvme_write_bytes_per_s: float
    capabilities: list[Capability]
    engines: list[NodeEngine] | None = Field(description="null: any model, on any group.")
    calibrated: dict[str, Calibrated]
    registered_at: str | None = Field(description="ISO 8601, UTC; null: no agent registered yet.")
    last_heartbeat: str | None = Field(description="ISO 8601, UTC.")
    telemetry: TelemetryOut | None
    reconcile: ReconcileOut | None = Field(None, description="null: no heartbeat judged yet.")
    gpus: list[GpuOut]


class QuarantinedEntry(WireModel):
    """A placement entry a start took out of the stored state because it broke a physical invariant."""

    object: StateObject
    location: Location
    bytes: int
    why: str


class ClusterOut(WireModel):
    nodes: list[NodeOut]
    quarantine: list[QuarantinedEntry] = Field(
        description="What starts took out of a stored placement that broke an invariant (the nodes' reports "
        "rebuild it); empty on a healthy state."
    )


class ResolvedModel(WireModel):
    """The sizes a model resolves to (from its preset, its config.json, or explicit values)."""

    precisions: list[str]
    weights_bytes: dict[str, int] = Field(description="Precision -> bytes (a MoE's non-expert part).")
    kv_bytes_per_token: int
    kv_heads: int = Field(
        0,
        description="KV heads per layer as the engines cache them (1 under MLA; 0: unknown, the KV splits evenly "
        "over a tensor-parallel group). A GPU of a group of tp holds kv_bytes_per_token / min(tp, kv_heads) a token.",
    )
    experts_bytes: int
    expert_bytes: int
    is_moe: bool
    active_params: int


class ModelOut(WireModel):
    """A model of the catalog as declared (fields left unset are absent), what it resolves to, and whether
    the confirmed placement serves it."""

    id: str
    preset: str | None = None
    config: dict[str, Any] | None = None
    precisions: list[str] | None = None
    weights_bytes: dict[str, int] | None = None
    kv_bytes_per_token: int | None = None
    kv_heads: int | None = None
    experts_bytes: int | None = None
    expert_bytes: int | None = None
    active_params: int | None = None
    active_expert_bytes_per_token: int | None = None
    min_gpus: dict[str, int] = Field(default_factory=dict)
    resolved: ResolvedModel
    serving: bool
