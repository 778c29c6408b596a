from __future__ import annotations

from fastapi import APIRouter

from planner_service.api.deps import OperatorDep, ServiceDep
from planner_service.domain.scenario import ClusterIn
from planner_service.wire.cluster import ClusterOut

router = APIRouter(prefix="/v1/cluster", tags=["cluster"])


@router.get("", response_model=ClusterOut, response_model_exclude_unset=True)
def get_cluster(service: ServiceDep, _: OperatorDep) -> ClusterOut:
    """Nodes and GPUs with effective (calibrated) bandwidths, confirmed and planned HBM use, telemetry."""
    return ClusterOut.model_validate(service.cluster_view())


@router.put("", response_model=ClusterOut, response_model_exclude_unset=True)
def put_cluster(cluster: ClusterIn, service: ServiceDep, _: OperatorDep) -> ClusterOut:
    """Replace the topology. State held on hardware that disappears is forgotten; the service replans."""
    return ClusterOut.model_validate(service.put_cluster(cluster))
