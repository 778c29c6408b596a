"""Bandwidth calibration as the operator sees it: per node, what its links learned from measured copies."""

from __future__ import annotations

from pydantic import Field

from planner_service.wire.base import WireModel
from planner_service.wire.cluster import Calibrated


class GpuCalibration(WireModel):
    id: str
    calibrated: dict[str, Calibrated] = Field(description="h2d_bytes_per_s / d2h_bytes_per_s -> its calibration.")


class NodeCalibration(WireModel):
    id: str
    scale: float = Field(
        description="Bytes the node's agent materializes per planned byte, as it registered (1: real copies)."
    )
    calibrates: bool = Field(
        description="Whether the node's reports and heartbeats calibrate its links: not at a scale below 1 "
        "(a scaled test run measures its own overheads, not the links)."
    )
    calibrated: dict[str, Calibrated] = Field(
        description="nvme_read_bytes_per_s / nvme_write_bytes_per_s -> its calibration."
    )
    gpus: list[GpuCalibration]


class CalibrationOut(WireModel):
    """Every node with its GPUs; a link without an entry plans with its catalog (or explicit) bandwidth."""

    nodes: list[NodeCalibration]


class CalibrationResetOut(CalibrationOut):
    """What is left after a reset, and how many learned bandwidths it forgot."""

    forgotten: int = Field(description="Entries forgotten: those links plan with their catalog bandwidths again.")
