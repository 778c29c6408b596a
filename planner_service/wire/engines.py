"""The engine instances of engine nodes (vLLM, SGLang) as `GET /v1/engines` lists them."""

from __future__ import annotations

from pydantic import Field

from planner_service.wire.base import WireModel
from planner_service.wire.enums import EngineFeature, EngineKind, EngineState, Management, Transition


class EngineOut(WireModel):
    """One model's engine on one node: its state now (derived from the confirmed placement and what the node
    reported), its state once the current plan is done, its launch settings, GPUs and the bytes it holds."""

    id: str = Field(
        description="`<model>@<precision>@<gpu>+<gpu>...`; the model's first precision where none is chosen."
    )
    node: str
    model: str
    kind: EngineKind
    state: EngineState
    planned_state: EngineState | None = Field(description="Its state once the current plan is done; null: no plan.")
    planned_step: Transition | None = Field(
        description="The transition from its state now to its planned state, if any, as one step."
    )
    planned_steps: list[Transition] = Field(
        default_factory=list,
        description="The engine calls the current plan's operations make of it, in order: a restart that no order "
        "makes safe where two engines trade GPUs is a stop, then a start.",
    )
    precision: str | None = Field(description="Null: stopped with no precision chosen.")
    gpus: list[str] = Field(description="Its tensor-parallel group; empty where none is known (stopped).")
    features: list[EngineFeature]
    management: Management
    kv_pool_bytes_per_gpu: int = Field(ge=0, description="The KV pool the current plan launches it with (running).")
    gpu_bytes_per_gpu: int = Field(
        ge=0, description="What its state holds on each GPU of its group (engines.holdings)."
    )
    host_bytes: int = Field(ge=0, description="What its state holds in host RAM (level-1 backup, LMCache's CPU tier).")
