"""Bandwidth calibration for operators: see what each node's links learned, and forget it."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from planner_service.api.deps import OperatorDep, ServiceDep
from planner_service.wire.calibration import CalibrationOut, CalibrationResetOut
from planner_service.wire.enums import CalibrationScope

router = APIRouter(prefix="/v1/calibration", tags=["calibration"])

ScopePath = Annotated[CalibrationScope, Path(description="nodes (NVMe read and write) or gpus (H2D and D2H).")]
KeyPath = Annotated[str, Path(description="The node's or the GPU's id.")]


@router.get("", response_model=CalibrationOut)
def get_calibration(
    service: ServiceDep, _: OperatorDep, node: Annotated[str | None, Query(description="Only this node.")] = None
) -> CalibrationOut:
    """Per node and GPU, the bandwidths learned from measured copies, and whether the node calibrates at all (a
    node whose agent registered a scale below 1 does not)."""
    return CalibrationOut.model_validate(service.calibration_view(node))


def _reset(
    service: ServiceDep, scope: CalibrationScope | None, key: str | None, field: str | None
) -> CalibrationResetOut:
    forgotten = service.reset_calibration(scope.value if scope else None, key, field)
    view = service.calibration_view(key if scope is CalibrationScope.NODES else None)
    return CalibrationResetOut.model_validate({**view, "forgotten": forgotten})


@router.delete("", response_model=CalibrationResetOut)
def reset_all_calibration(service: ServiceDep, _: OperatorDep) -> CalibrationResetOut:
    """Forget every learned bandwidth: every link plans with its catalog (or explicit) figure again."""
    return _reset(service, None, None, None)


@router.delete("/{scope}/{key}", response_model=CalibrationResetOut)
def reset_calibration(scope: ScopePath, key: KeyPath, service: ServiceDep, _: OperatorDep) -> CalibrationResetOut:
    """Forget what a node's links learned (its NVMe and every one of its GPUs), or one GPU's."""
    return _reset(service, scope, key, None)


@router.delete("/{scope}/{key}/{field}", response_model=CalibrationResetOut)
def reset_calibration_field(
    scope: ScopePath,
    key: KeyPath,
    field: Annotated[
        str,
        Path(
            description="nvme_read_bytes_per_s, nvme_write_bytes_per_s (nodes); "
            "h2d_bytes_per_s, d2h_bytes_per_s (gpus)."
        ),
    ],
    service: ServiceDep,
    _: OperatorDep,
) -> CalibrationResetOut:
    """Forget one learned bandwidth of a node or GPU."""
    return _reset(service, scope, key, field)
