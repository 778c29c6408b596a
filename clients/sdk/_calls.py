"""Every endpoint of the StateBudget API as a function that builds its `Call[T]`, once for both clients.

Each function's return annotation names the wire type its answer is validated into: it is what the sync
client's method of the same name returns (the async client's, an awaitable of it), and
tests/clients/test_sdk_schema.py checks it against the route's answer in `schemas/openapi.json`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from clients.sdk._core import DEFAULT_TIMEOUT_SECONDS, LONG_POLL_MARGIN_SECONDS, Call, compact
from planner_service.wire.base import WireIn
from planner_service.wire.calibration import CalibrationOut, CalibrationResetOut
from planner_service.wire.cluster import ClusterOut, ModelOut
from planner_service.wire.engines import EngineOut
from planner_service.wire.enums import (
    CalibrationScope,
    Capability,
    OperationState,
    ReportedEngineState,
    ReportStatus,
    SolverName,
)
from planner_service.wire.health import Health
from planner_service.wire.nodes import (
    EngineIn,
    EngineInstanceStateIn,
    GpuInventoryIn,
    GpuTelemetryIn,
    HeartbeatIn,
    HeartbeatOut,
    RegisterIn,
    RegisterOut,
)
from planner_service.wire.operations import LeaseIn, LeaseOut, OperationRecord, RenewOut, ReportIn, ReportOut
from planner_service.wire.plan import CurrentPlanOut, ExplainOut, ParetoOut, ReplanOut, WhatIfOut
from planner_service.wire.routes import RoutesOut
from planner_service.wire.sessions import EventsOut, SessionOut
from planner_service.wire.state import SrvOut


def request_body(model: type[WireIn], fields: Mapping[str, Any]) -> dict[str, Any]:
    """`fields` checked against the request's wire model before anything is sent, as the JSON the service
    reads: a bad body raises pydantic's `ValidationError` naming the field (`gpus.0.id`), here rather than as
    a 422 after a round trip. Fields left unset or None, at any depth, are left out: the service's defaults
    apply (every field that may be null defaults to null)."""
    return model.model_validate(compact(dict(fields))).model_dump(mode="json", exclude_unset=True, exclude_none=True)


# -- health ------------------------------------------------------------------


def livez() -> Call[Health]:
    """The process answers and its state matches the database."""
    return Call("GET", "/livez", Health)


def readyz() -> Call[Health]:
    """`Health` with the plan's `epoch` and `srv_version`; a service still starting answers 503 (`ServerError`)."""
    return Call("GET", "/readyz", Health)


def metrics() -> Call[str]:
    """The Prometheus exposition text."""
    return Call("GET", "/metrics", str)


# -- cluster and catalog -----------------------------------------------------


def get_cluster() -> Call[ClusterOut]:
    """Nodes and GPUs with calibrated bandwidths, HBM use and telemetry."""
    return Call("GET", "/v1/cluster", ClusterOut)


def put_cluster(cluster: dict[str, Any]) -> Call[ClusterOut]:
    """Replace the topology (`{"nodes": [...]}` as in a scenario file's `cluster`)."""
    return Call("PUT", "/v1/cluster", ClusterOut, json=cluster)


def list_models() -> Call[list[ModelOut]]:
    """The catalog, with the sizes each model resolves to."""
    return Call("GET", "/v1/models", list[ModelOut])


def put_model(model_id: str, model: dict[str, Any], *, nvme_nodes: list[str] | None = None) -> Call[ModelOut]:
    """Add or replace a model (as in a scenario's `models[]`, without `id`)."""
    body = compact({"model": model, "nvme_nodes": nvme_nodes})
    return Call("PUT", f"/v1/models/{model_id}", ModelOut, json=body)


def delete_model(model_id: str) -> Call[None]:
    """Remove a model, its sessions and its state; a `ConflictError` while something uses it."""
    return Call("DELETE", f"/v1/models/{model_id}", type(None))


# -- events and sessions -----------------------------------------------------


def post_events(*events: dict[str, Any]) -> Call[EventsOut]:
    """Session events (build them with `clients.sdk.events`); event ids make a resend harmless."""
    return Call("POST", "/v1/events", EventsOut, json={"events": list(events)})


def list_sessions() -> Call[list[SessionOut]]:
    return Call("GET", "/v1/sessions", list[SessionOut])


def get_session(session_id: str) -> Call[SessionOut]:
    return Call("GET", f"/v1/sessions/{session_id}", SessionOut)


# -- state and plan ----------------------------------------------------------


def get_srv() -> Call[SrvOut]:
    """The State Residency Vector and the confirmed placement, with its `version`."""
    return Call("GET", "/v1/srv", SrvOut)


def get_engines() -> Call[list[EngineOut]]:
    """The engine instances of vLLM and SGLang nodes, now and once the current plan is done."""
    return Call("GET", "/v1/engines", list[EngineOut])


def get_plan() -> Call[CurrentPlanOut]:
    return Call("GET", "/v1/plan", CurrentPlanOut)


def get_routes(
    *, after_epoch: int | None = None, after_revision: str | None = None, wait_seconds: float = 0.0
) -> Call[RoutesOut]:
    """The gateway's route table. With `after_epoch` / `after_revision`, a long-poll that answers once either
    changed or `wait_seconds` ran out."""
    params = {"after_epoch": after_epoch, "after_revision": after_revision, "wait": wait_seconds or None}
    timeout = max(wait_seconds + LONG_POLL_MARGIN_SECONDS, DEFAULT_TIMEOUT_SECONDS)
    return Call("GET", "/v1/routes", RoutesOut, params=params, timeout_seconds=timeout)


def replan() -> Call[ReplanOut]:
    """Plan now (a new epoch supersedes the operations not yet leased). Not retried: each call is an epoch."""
    return Call("POST", "/v1/plan", ReplanOut, idempotent=False)


def whatif(
    changes: list[dict[str, Any]], *, solver: SolverName = SolverName.GREEDY, time_limit_seconds: float = 10.0
) -> Call[WhatIfOut]:
    """Plan hypothetical changes on a copy of the live state."""
    body = {"changes": changes, "solver": solver, "time_limit_seconds": time_limit_seconds}
    return Call("POST", "/v1/whatif", WhatIfOut, json=body, timeout_seconds=time_limit_seconds + 30.0)


def pareto() -> Call[ParetoOut]:
    """Predicted P95 switch latency against warm GPU bytes for the current workload."""
    return Call("GET", "/v1/pareto", ParetoOut)


def explain(*, model: str | None = None, session: str | None = None) -> Call[ExplainOut]:
    """Why each state object of a model (or a session) sits where it does, now and in the plan."""
    return Call("GET", "/v1/explain", ExplainOut, params={"model": model, "session": session})


# -- calibration -------------------------------------------------------------


def get_calibration(*, node: str | None = None) -> Call[CalibrationOut]:
    """What each node's and GPU's links learned from measured copies (operator)."""
    return Call("GET", "/v1/calibration", CalibrationOut, params={"node": node})


def reset_calibration(
    scope: CalibrationScope | str | None = None, key: str | None = None, field: str | None = None
) -> Call[CalibrationResetOut]:
    """Forget learned bandwidths: all of them (no `scope`), a node's (its NVMe and its GPUs') or a GPU's
    (`scope`, `key`), or one `field` of them."""
    path = "/v1/calibration"
    if scope is not None:
        if key is None:
            raise ValueError("reset_calibration: a scope needs the node's or GPU's id (key)")
        path += f"/{scope}/{key}" + (f"/{field}" if field is not None else "")
    elif key is not None or field is not None:
        raise ValueError("reset_calibration: key and field need a scope (nodes or gpus)")
    return Call("DELETE", path, CalibrationResetOut)


# -- nodes and queues --------------------------------------------------------


def register_node(
    node_id: str,
    *,
    capabilities: Sequence[Capability] | None = None,
    gpus: Sequence[GpuInventoryIn | Mapping[str, Any]] | None = None,
    host_dram_bytes: int | None = None,
    nvme_bytes: int | None = None,
    engines: Sequence[EngineIn | Mapping[str, Any]] | None = None,
    agent_version: str | None = None,
    scale: float | None = None,
) -> Call[RegisterOut]:
    """A node's inventory and the moves its engines can carry out. `scale` below 1 declares a scaled test run:
    the node's measurements do not calibrate. The body is a `RegisterIn`: a bad one raises `ValidationError`."""
    body = request_body(
        RegisterIn,
        {
            "capabilities": capabilities,
            "gpus": gpus,
            "host_dram_bytes": host_dram_bytes,
            "nvme_bytes": nvme_bytes,
            "engines": engines,
            "agent_version": agent_version,
            "scale": scale,
        },
    )
    return Call("POST", f"/v1/nodes/{node_id}/register", RegisterOut, json=body)


def heartbeat(
    node_id: str,
    *,
    gpus: Sequence[GpuTelemetryIn | Mapping[str, Any]] | None = None,
    nvme_read_bytes_per_s: float | None = None,
    nvme_write_bytes_per_s: float | None = None,
    engines: Mapping[str, ReportedEngineState] | None = None,
    instances: Sequence[EngineInstanceStateIn | Mapping[str, Any]] | None = None,
    expert_hit_rates: Mapping[str, float] | None = None,
) -> Call[HeartbeatOut]:
    """Telemetry. `gpus[]`: `{id, used_bytes, free_bytes, total_bytes, h2d_bytes_per_s, d2h_bytes_per_s}`;
    `instances[]`: `{instance: EngineInstanceRef, state: EngineState}`. The body is a `HeartbeatIn`: a bad one
    raises `ValidationError`."""
    body = request_body(
        HeartbeatIn,
        {
            "gpus": gpus,
            "nvme_read_bytes_per_s": nvme_read_bytes_per_s,
            "nvme_write_bytes_per_s": nvme_write_bytes_per_s,
            "engines": engines,
            "instances": instances,
            "expert_hit_rates": expert_hit_rates,
        },
    )
    return Call("POST", f"/v1/nodes/{node_id}/heartbeat", HeartbeatOut, json=body)


def lease(node_id: str, *, max_operations: int = 8, wait_seconds: float = 0.0) -> Call[LeaseOut]:
    """Long-poll the node's ready operations. Never retried (see `clients/sdk/_core.py`). The body is a `LeaseIn`:
    a bad one raises `ValidationError`."""
    body = request_body(LeaseIn, {"max_operations": max_operations, "wait_seconds": wait_seconds})
    timeout = max(wait_seconds + LONG_POLL_MARGIN_SECONDS, DEFAULT_TIMEOUT_SECONDS)
    return Call("POST", f"/v1/nodes/{node_id}/lease", LeaseOut, json=body, idempotent=False, timeout_seconds=timeout)


def renew_lease(node_id: str, lease_id: str) -> Call[RenewOut]:
    """Extend a lease whose operations still run to `lease_seconds` from now. A lease that holds nothing any more
    is a `ConflictError` saying why (its operations were handed on). Renewing again only moves the expiry, so it
    is retried."""
    return Call("POST", f"/v1/nodes/{node_id}/leases/{lease_id}/renew", RenewOut)


def report(
    op_id: str,
    *,
    lease_id: str,
    status: ReportStatus,
    measured_seconds: float | None = None,
    measured_bytes: int | None = None,
    error: str | None = None,
) -> Call[ReportOut]:
    """`done` or `failed` for a leased operation. The service answers a repeat the same way, so it is retried.
    The body is a `ReportIn` (an `error` cut to its 2,000 characters): a bad one raises `ValidationError`."""
    body = request_body(
        ReportIn,
        {
            "lease_id": lease_id,
            "status": status,
            "measured_seconds": measured_seconds,
            "measured_bytes": measured_bytes,
            "error": error[:2000] if error else None,
        },
    )
    return Call("POST", f"/v1/operations/{op_id}/report", ReportOut, json=body)


def list_operations(*, node: str | None = None, state: OperationState | None = None) -> Call[list[OperationRecord]]:
    """The open operations, or those in `state`."""
    return Call("GET", "/v1/operations", list[OperationRecord], params={"node": node, "state": state})
