"""The route table the planner publishes to the gateway (GET /v1/routes)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from planner_service.wire.base import WireModel
from planner_service.wire.enums import EngineKind


class RouteState(StrEnum):
    """What a gateway can do with an instance: send to it, or ask the planner to wake or start it."""

    RUNNING = "running"
    ASLEEP = "asleep"  # weights in host RAM or discarded: a wake brings it back
    STOPPED = "stopped"


class RouteInstance(WireModel):
    """One engine instance that serves a model, where the gateway can reach its OpenAI server."""

    id: str = Field(description="The engine instance id (`<model>@<precision>@<gpus>`), or `<node>/<engine>`.")
    node: str
    gpus: list[str]
    state: RouteState
    url: str | None = Field(description="The engine's base URL from the node's registration; null: not given.")
    engine: EngineKind | None = Field(
        None, description="The engine's kind from the node's registration (vllm, sglang, ...); null: not given."
    )


class ModelRoutes(WireModel):
    model: str
    instances: list[RouteInstance] = Field(description="Running instances first, then asleep, then stopped.")


class SessionRoute(WireModel):
    session: str
    model: str = Field(description="The model of the session's last request.")
    instance: str | None = Field(description="The instance whose GPUs hold the session's KV; null: none does.")


class PinDirective(WireModel):
    """Keep routing the session to `instance`: its GPUs hold the session's KV and the plan keeps it there."""

    session: str
    instance: str
    tokens: int = Field(ge=0, description="The session's context tokens that KV holds.")


class WarmupDirective(WireModel):
    """Prefill the session's known history on `instance` of `model` (a 1-token request) while the session sits in
    a tool call: `model` is where its next request is predicted to go, and the instance's cards are idle."""

    session: str
    model: str
    instance: str
    tokens: int = Field(0, ge=0, description="The session's context tokens: the KV the warm-up makes.")
    probability: float = Field(0.0, ge=0, le=1, description="The predicted chance of the hand-off to `model`.")
    value_seconds: float | None = Field(
        None,
        description="Under the priced target: the SLO-weighted seconds of readying the history (re-prefill or "
        "restore) the warm-up is expected to spare the hand-off, net of the planner's HBM price of its KV for the "
        "time it is expected to be held (planner/gateway_directives.py); null under a fixed target.",
    )


class Directives(WireModel):
    """The gateway's own actions (never queue operations of node agents)."""

    decided: bool = Field(
        False, description="True: the planner decided the lists below; false: a table without directives."
    )
    pins: list[PinDirective] = Field(default_factory=list)
    warmups: list[WarmupDirective] = Field(default_factory=list)


class RoutesOut(WireModel):
    epoch: int = Field(description="The plan epoch the table was drawn at.")
    revision: str = Field(description="Changes whenever the table does (an instance woke, a session moved).")
    models: list[ModelRoutes]
    sessions: list[SessionRoute]
    directives: Directives
