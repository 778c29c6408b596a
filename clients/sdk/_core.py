"""What the sync and async clients share: building a call, retrying it, reading the answer.

A `Call` is a plain description of one HTTP request and of the type its answer
has; `Endpoints` turns every method of the API into a `Call` and hands it to
`_send`, which the sync client implements with `httpx.Client` and the async
client with `httpx.AsyncClient`. Neither client knows an endpoint; neither
endpoint knows the transport. Answers come back as the API's own types
(`planner_service.wire`), validated on arrival.

Retries (stamina, exponential backoff with jitter) apply only to calls that are
safe to repeat (`idempotent`), and only on transport errors and 5xx answers.
A lease is never retried: a lost answer would leave operations leased to nobody
until the lease expires.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal

import httpx
from pydantic import TypeAdapter

from clients.sdk.errors import ConnectionError, ServerError, error_from_response
from planner_service.wire.calibration import CalibrationOut, CalibrationResetOut
from planner_service.wire.cluster import ClusterOut, ModelOut
from planner_service.wire.engines import EngineOut
from planner_service.wire.enums import CalibrationScope, Capability, OperationState, ReportStatus, SolverName
from planner_service.wire.health import Health
from planner_service.wire.nodes import HeartbeatOut, RegisterOut
from planner_service.wire.operations import LeaseOut, OperationRecord, RenewOut, ReportOut
from planner_service.wire.plan import CurrentPlanOut, ExplainOut, ParetoOut, ReplanOut, WhatIfOut
from planner_service.wire.routes import RoutesOut
from planner_service.wire.sessions import EventsOut, SessionOut
from planner_service.wire.state import SrvOut

Method = Literal["GET", "POST", "PUT", "DELETE"]
DEFAULT_TIMEOUT_SECONDS = 30.0
LONG_POLL_MARGIN_SECONDS = 10.0  # a lease long-poll may hold the request this much past its wait


@dataclass(frozen=True, slots=True)
class Call:
    method: Method
    path: str
    params: dict[str, Any] | None = None
    json: Any = None
    idempotent: bool = True
    timeout_seconds: float | None = None  # overrides the client's timeout (long polls)
    expect: Literal["json", "text", "none"] = "json"
    answer: Any = None  # the type a JSON answer is validated into (a wire model, or a list of them)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently an idempotent call is retried (stamina's parameters)."""

    attempts: int = 4
    timeout_seconds: float = 60.0
    wait_initial_seconds: float = 0.2
    wait_max_seconds: float = 5.0
    wait_jitter_seconds: float = 0.5

    def stamina_kwargs(self) -> dict[str, Any]:
        return {
            "attempts": self.attempts,
            "timeout": self.timeout_seconds,
            "wait_initial": self.wait_initial_seconds,
            "wait_max": self.wait_max_seconds,
            "wait_jitter": self.wait_jitter_seconds,
        }


NO_RETRY = RetryPolicy(attempts=1)


def is_retryable(error: Exception) -> bool:
    """Transport failures and 5xx (including 503 while the service starts) may succeed on a later try."""
    return isinstance(error, ConnectionError | ServerError)


def _compact(data: dict[str, Any]) -> dict[str, Any]:
    """Leave out unset fields: the service's defaults apply (and its models forbid unknown keys)."""
    return {k: v for k, v in data.items() if v is not None}


@dataclass(slots=True)
class ClientConfig:
    base_url: str
    token: str | None = None
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json, application/problem+json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def request_kwargs(self, call: Call) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"headers": self.headers()}
        if call.params:
            kwargs["params"] = _compact(call.params)
        if call.json is not None:
            kwargs["json"] = call.json
        if call.timeout_seconds is not None:  # long polls; other calls use the client's own timeout
            kwargs["timeout"] = call.timeout_seconds
        return kwargs


def transport_error(error: httpx.TransportError, call: Call) -> ConnectionError:
    return ConnectionError(
        f"{call.method} {call.path}: {type(error).__name__}: {error}", method=call.method, url=call.path
    )


@cache
def _adapter(answer: Any) -> TypeAdapter[Any]:
    return TypeAdapter(answer)


def parse(call: Call, response: httpx.Response) -> Any:
    """The body of a successful answer (as `call.answer`, where given), or the typed error of a failed one."""
    if response.status_code >= 400:
        raise error_from_response(response)
    if call.expect == "none" or response.status_code == 204 or not response.content:
        return None
    if call.expect == "text":
        return response.text
    if call.answer is None:
        return response.json()
    return _adapter(call.answer).validate_json(response.content)


class Endpoints(ABC):
    """Every endpoint of the StateBudget API, once. `_send` is the transport (sync or async).

    Each method's docstring names what it answers: the sync client returns it, the async client an
    awaitable of it (so the methods are annotated `Any`: one definition serves both).
    """

    @abstractmethod
    def _send(self, call: Call) -> Any:
        """Send one call; the sync client returns the result, the async one an awaitable of it."""

    # -- health ------------------------------------------------------------------

    def livez(self) -> Any:
        """`Health`."""
        return self._send(Call("GET", "/livez", answer=Health))

    def readyz(self) -> Any:
        """`Health` with the plan's `epoch` and `srv_version`; a service still starting answers 503 (`ServerError`)."""
        return self._send(Call("GET", "/readyz", answer=Health))

    def metrics(self) -> Any:
        """The Prometheus exposition text."""
        return self._send(Call("GET", "/metrics", expect="text"))

    # -- cluster and catalog -----------------------------------------------------

    def get_cluster(self) -> Any:
        """`ClusterOut`: nodes and GPUs with calibrated bandwidths, HBM use and telemetry."""
        return self._send(Call("GET", "/v1/cluster", answer=ClusterOut))

    def put_cluster(self, cluster: dict[str, Any]) -> Any:
        """Replace the topology (`{"nodes": [...]}` as in a scenario file's `cluster`): `ClusterOut`."""
        return self._send(Call("PUT", "/v1/cluster", json=cluster, answer=ClusterOut))

    def list_models(self) -> Any:
        """`list[ModelOut]`."""
        return self._send(Call("GET", "/v1/models", answer=list[ModelOut]))

    def put_model(self, model_id: str, model: dict[str, Any], *, nvme_nodes: list[str] | None = None) -> Any:
        """Add or replace a model (as in a scenario's `models[]`, without `id`): `ModelOut`."""
        body = _compact({"model": model, "nvme_nodes": nvme_nodes})
        return self._send(Call("PUT", f"/v1/models/{model_id}", json=body, answer=ModelOut))

    def delete_model(self, model_id: str) -> Any:
        return self._send(Call("DELETE", f"/v1/models/{model_id}", expect="none"))

    # -- events and sessions -----------------------------------------------------

    def post_events(self, *events: dict[str, Any]) -> Any:
        """Session events (build them with `clients.sdk.events`); event ids make a resend harmless: `EventsOut`."""
        return self._send(Call("POST", "/v1/events", json={"events": list(events)}, answer=EventsOut))

    def list_sessions(self) -> Any:
        """`list[SessionOut]`."""
        return self._send(Call("GET", "/v1/sessions", answer=list[SessionOut]))

    def get_session(self, session_id: str) -> Any:
        """`SessionOut`."""
        return self._send(Call("GET", f"/v1/sessions/{session_id}", answer=SessionOut))

    # -- state and plan ----------------------------------------------------------

    def get_srv(self) -> Any:
        """The State Residency Vector and the confirmed placement, with its `version`: `SrvOut`."""
        return self._send(Call("GET", "/v1/srv", answer=SrvOut))

    def get_engines(self) -> Any:
        """The engine instances of vLLM and SGLang nodes, now and once the current plan is done: `list[EngineOut]`."""
        return self._send(Call("GET", "/v1/engines", answer=list[EngineOut]))

    def get_plan(self) -> Any:
        """`CurrentPlanOut`."""
        return self._send(Call("GET", "/v1/plan", answer=CurrentPlanOut))

    def get_routes(
        self, *, after_epoch: int | None = None, after_revision: str | None = None, wait_seconds: float = 0.0
    ) -> Any:
        """The gateway's route table: `RoutesOut`. With `after_epoch` / `after_revision`, a long-poll that
        answers once either changed or `wait_seconds` ran out."""
        params = {"after_epoch": after_epoch, "after_revision": after_revision, "wait": wait_seconds or None}
        timeout = max(wait_seconds + LONG_POLL_MARGIN_SECONDS, DEFAULT_TIMEOUT_SECONDS)
        return self._send(Call("GET", "/v1/routes", params=params, timeout_seconds=timeout, answer=RoutesOut))

    def replan(self) -> Any:
        """Plan now (a new epoch supersedes the operations not yet leased). Not retried: each call is an epoch.
        `ReplanOut`."""
        return self._send(Call("POST", "/v1/plan", idempotent=False, answer=ReplanOut))

    def whatif(
        self, changes: list[dict[str, Any]], *, solver: SolverName = SolverName.GREEDY, time_limit_seconds: float = 10.0
    ) -> Any:
        """Plan hypothetical changes on a copy of the live state: `WhatIfOut`."""
        body = {"changes": changes, "solver": solver, "time_limit_seconds": time_limit_seconds}
        return self._send(
            Call("POST", "/v1/whatif", json=body, timeout_seconds=time_limit_seconds + 30.0, answer=WhatIfOut)
        )

    def pareto(self) -> Any:
        """`ParetoOut`."""
        return self._send(Call("GET", "/v1/pareto", answer=ParetoOut))

    def explain(self, *, model: str | None = None, session: str | None = None) -> Any:
        """`ExplainOut`."""
        return self._send(Call("GET", "/v1/explain", params={"model": model, "session": session}, answer=ExplainOut))

    # -- calibration -------------------------------------------------------------

    def get_calibration(self, *, node: str | None = None) -> Any:
        """What each node's and GPU's links learned from measured copies (operator): `CalibrationOut`."""
        return self._send(Call("GET", "/v1/calibration", params={"node": node}, answer=CalibrationOut))

    def reset_calibration(
        self, scope: CalibrationScope | str | None = None, key: str | None = None, field: str | None = None
    ) -> Any:
        """Forget learned bandwidths: all of them (no `scope`), a node's (its NVMe and its GPUs') or a GPU's
        (`scope`, `key`), or one `field` of them: `CalibrationResetOut`."""
        path = "/v1/calibration"
        if scope is not None:
            if key is None:
                raise ValueError("reset_calibration: a scope needs the node's or GPU's id (key)")
            path += f"/{scope}/{key}" + (f"/{field}" if field is not None else "")
        elif key is not None or field is not None:
            raise ValueError("reset_calibration: key and field need a scope (nodes or gpus)")
        return self._send(Call("DELETE", path, answer=CalibrationResetOut))

    # -- nodes and queues --------------------------------------------------------

    def register_node(
        self,
        node_id: str,
        *,
        capabilities: list[Capability] | None = None,
        gpus: list[dict[str, Any]] | None = None,
        host_dram_bytes: int | None = None,
        nvme_bytes: int | None = None,
        engines: list[dict[str, Any]] | None = None,
        agent_version: str | None = None,
        scale: float | None = None,
    ) -> Any:
        """`RegisterOut`. `scale` below 1 declares a scaled test run: the node's measurements do not calibrate."""
        body = _compact(
            {
                "capabilities": capabilities,
                "gpus": gpus,
                "host_dram_bytes": host_dram_bytes,
                "nvme_bytes": nvme_bytes,
                "engines": engines,
                "agent_version": agent_version,
                "scale": scale,
            }
        )
        return self._send(Call("POST", f"/v1/nodes/{node_id}/register", json=body, answer=RegisterOut))

    def heartbeat(
        self,
        node_id: str,
        *,
        gpus: list[dict[str, Any]] | None = None,
        nvme_read_bytes_per_s: float | None = None,
        nvme_write_bytes_per_s: float | None = None,
        engines: dict[str, str] | None = None,
        instances: list[dict[str, Any]] | None = None,
        expert_hit_rates: dict[str, float] | None = None,
    ) -> Any:
        """`HeartbeatOut`. `gpus[]`: `{id, used_bytes, free_bytes, total_bytes, h2d_bytes_per_s,
        d2h_bytes_per_s}`; `instances[]`: `{instance: EngineInstanceRef, state: EngineState}`."""
        body = _compact(
            {
                "gpus": [_compact(g) for g in gpus] if gpus is not None else None,
                "nvme_read_bytes_per_s": nvme_read_bytes_per_s,
                "nvme_write_bytes_per_s": nvme_write_bytes_per_s,
                "engines": engines,
                "instances": instances,
                "expert_hit_rates": expert_hit_rates,
            }
        )
        return self._send(Call("POST", f"/v1/nodes/{node_id}/heartbeat", json=body, answer=HeartbeatOut))

    def lease(self, node_id: str, *, max_operations: int = 8, wait_seconds: float = 0.0) -> Any:
        """Long-poll the node's ready operations: `LeaseOut`. Never retried (see the module docstring)."""
        body = {"max_operations": max_operations, "wait_seconds": wait_seconds}
        timeout = max(wait_seconds + LONG_POLL_MARGIN_SECONDS, DEFAULT_TIMEOUT_SECONDS)
        return self._send(
            Call(
                "POST",
                f"/v1/nodes/{node_id}/lease",
                json=body,
                idempotent=False,
                timeout_seconds=timeout,
                answer=LeaseOut,
            )
        )

    def renew_lease(self, node_id: str, lease_id: str) -> Any:
        """Extend a lease whose operations still run to `lease_seconds` from now: `RenewOut`. A lease that
        holds nothing any more is a `ConflictError` saying why (its operations were handed on). Renewing again
        only moves the expiry, so it is retried."""
        return self._send(Call("POST", f"/v1/nodes/{node_id}/leases/{lease_id}/renew", answer=RenewOut))

    def report(
        self,
        op_id: str,
        *,
        lease_id: str,
        status: ReportStatus,
        measured_seconds: float | None = None,
        measured_bytes: int | None = None,
        error: str | None = None,
    ) -> Any:
        """`done` or `failed` for a leased operation: `ReportOut`. The service answers a repeat the same way, so
        it is retried."""
        body = _compact(
            {
                "lease_id": lease_id,
                "status": status,
                "measured_seconds": measured_seconds,
                "measured_bytes": measured_bytes,
                "error": error[:2000] if error else None,
            }
        )
        return self._send(Call("POST", f"/v1/operations/{op_id}/report", json=body, answer=ReportOut))

    def list_operations(self, *, node: str | None = None, state: OperationState | None = None) -> Any:
        """`list[OperationRecord]`: the open operations, or those in `state`."""
        return self._send(
            Call("GET", "/v1/operations", params={"node": node, "state": state}, answer=list[OperationRecord])
        )
