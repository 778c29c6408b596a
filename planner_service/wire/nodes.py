"""What the service answers a node agent's registration and heartbeat."""

from __future__ import annotations

from pydantic import Field

from planner_service.wire.base import WireModel
from planner_service.wire.cluster import Calibrated, NodeEngine
from planner_service.wire.enums import Capability


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
