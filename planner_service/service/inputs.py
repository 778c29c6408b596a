"""What operators send (a model of the catalog, what-if changes), and the check of event times against the
service's clock (validated by pydantic).

The request bodies clients share (events, node registrations and heartbeats, leases and reports) are the wire
package's (`planner_service/wire`); they are re-exported here for the service. Every number is finite and
within the physical bounds of `wire/bounds.py`.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Annotated, Any, Literal

from pydantic import Field

from planner_service.domain.scenario import GpuSpecIn, ModelIn, NodeIn, Slo
from planner_service.service.errors import InvalidInput
from planner_service.wire.base import WireIn
from planner_service.wire.bounds import EventId, Name, Tokens
from planner_service.wire.events import (
    SERVER_TIME,
    Event,
    EventsIn,
    RequestEvent,
    ServerTime,
    SessionEndEvent,
    SessionEvent,
    ToolCallEndEvent,
    ToolCallStartEvent,
    TurnEndEvent,
)
from planner_service.wire.nodes import (
    EngineIn,
    EngineInstanceIn,
    EngineInstanceStateIn,
    GpuInventoryIn,
    GpuTelemetryIn,
    HeartbeatIn,
    RegisterIn,
)
from planner_service.wire.operations import LeaseIn, ReportIn

__all__ = [
    "SERVER_TIME",
    "AddGpu",
    "AddModel",
    "AddNode",
    "AddSessions",
    "Change",
    "EngineIn",
    "EngineInstanceIn",
    "EngineInstanceStateIn",
    "Event",
    "EventId",
    "EventsIn",
    "GpuInventoryIn",
    "GpuTelemetryIn",
    "HeartbeatIn",
    "LeaseIn",
    "ModelPutIn",
    "Name",
    "RegisterIn",
    "RemoveGpu",
    "RemoveModel",
    "RemoveNode",
    "ReportIn",
    "RequestEvent",
    "ServerTime",
    "SessionEndEvent",
    "SetSlo",
    "ToolCallEndEvent",
    "ToolCallStartEvent",
    "TurnEndEvent",
    "WhatIfIn",
    "check_event_times",
]


def check_event_times(
    events: Sequence[SessionEvent], server_time: ServerTime, *, known_ids: Container[str] = ()
) -> None:
    """Refuse (422, naming `events.{i}.at`) a batch in which an event's `at` is beyond the clock skew.

    Events whose id is in `known_ids` are resends of acknowledged ones, ignored anyway: an old resend must not
    make a client's whole batch fail for good.
    """
    for i, event in enumerate(events):
        if event.id in known_ids:
            continue
        error = None if event.at is None else server_time.skew_error(event.at)
        if error is not None:
            raise InvalidInput(f"events[{i}].at: {error}", field=f"events.{i}.at")


class ModelPutIn(WireIn):
    """A model of the catalog (the id comes from the path)."""

    model: dict[str, Any] = Field(description="The model as in a scenario file's `models[]`, without `id`.")
    nvme_nodes: list[Name] | None = Field(
        None, description="Nodes whose NVMe holds a full copy of the weights (default: every node)."
    )


# -- what-if changes -----------------------------------------------------------


class AddGpu(WireIn):
    type: Literal["add_gpu"]
    node: Name
    gpu: GpuSpecIn


class RemoveGpu(WireIn):
    type: Literal["remove_gpu"]
    gpu: Name


class AddNode(WireIn):
    type: Literal["add_node"]
    node: NodeIn
    copy_models: bool = Field(True, description="Put a full copy of every model's weights on its NVMe.")


class RemoveNode(WireIn):
    type: Literal["remove_node"]
    node: Name


class AddModel(WireIn):
    type: Literal["add_model"]
    model: ModelIn
    nvme_nodes: list[Name] | None = None


class RemoveModel(WireIn):
    type: Literal["remove_model"]
    model: Name


class AddSessions(WireIn):
    type: Literal["add_sessions"]
    model: Name
    count: Annotated[int, Field(ge=1, le=10_000)]
    slo: Slo = Slo.INTERACTIVE
    context_tokens: Tokens = 8000
    active: bool = True
    user: Name = "whatif"


class SetSlo(WireIn):
    type: Literal["set_slo"]
    session: Name
    slo: Slo


Change = Annotated[
    AddGpu | RemoveGpu | AddNode | RemoveNode | AddModel | RemoveModel | AddSessions | SetSlo,
    Field(discriminator="type"),
]


class WhatIfIn(WireIn):
    changes: list[Change] = Field(default_factory=list, max_length=100)
    solver: Literal["greedy", "search", "milp"] = "greedy"
    time_limit_seconds: Annotated[float, Field(gt=0, le=120)] = 10.0
