"""The route table the planner publishes to the gateway (GET /v1/routes)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from planner_service.wire.base import WireModel


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


class ModelRoutes(WireModel):
    model: str
    instances: list[RouteInstance] = Field(description="Running instances first, then asleep, then stopped.")


class SessionRoute(WireModel):
    session: str
    model: str = Field(description="The model of the session's last request.")
    instance: str | None = Field(description="The instance whose GPUs hold the session's KV; null: none does.")


class PinDirective(WireModel):
    session: str
    instance: str
    tokens: int = Field(ge=0)


class WarmupDirective(WireModel):
    session: str
    model: str
    instance: str


class Directives(WireModel):
    """The gateway's own actions (never queue operations of node agents)."""

    decided: bool = Field(
        False, description="False: the planner does not decide pins and warm-ups yet; the lists stay empty."
    )
    pins: list[PinDirective] = Field(default_factory=list)
    warmups: list[WarmupDirective] = Field(default_factory=list)


class RoutesOut(WireModel):
    epoch: int = Field(description="The plan epoch the table was drawn at.")
    revision: str = Field(description="Changes whenever the table does (an instance woke, a session moved).")
    models: list[ModelRoutes]
    sessions: list[SessionRoute]
    directives: Directives
