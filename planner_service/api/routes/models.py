from __future__ import annotations

from fastapi import APIRouter, Response

from planner_service.api.deps import OperatorDep, ServiceDep
from planner_service.service.inputs import ModelPutIn
from planner_service.wire.cluster import ModelOut

router = APIRouter(prefix="/v1/models", tags=["models"])


@router.get("", response_model=list[ModelOut], response_model_exclude_unset=True)
def list_models(service: ServiceDep, _: OperatorDep) -> list[ModelOut]:
    """The catalog, with the sizes each model resolves to."""
    return [ModelOut.model_validate(model) for model in service.models_view()]


@router.put(
    "/{model_id}",
    response_model=ModelOut,
    response_model_exclude_unset=True,
    responses={201: {"description": "created", "model": ModelOut}},
)
def put_model(model_id: str, body: ModelPutIn, service: ServiceDep, _: OperatorDep, response: Response) -> ModelOut:
    """Add or replace a model; its weights are declared present on the NVMe of `nvme_nodes` (default: all)."""
    view, created = service.put_model(model_id, body.model, body.nvme_nodes)
    response.status_code = 201 if created else 200
    return ModelOut.model_validate(view)


@router.delete("/{model_id}", status_code=204)
def delete_model(model_id: str, service: ServiceDep, _: OperatorDep) -> Response:
    """Remove a model, its sessions and its state everywhere; 409 while an active session or an open operation
    uses it."""
    service.delete_model(model_id)
    return Response(status_code=204)
