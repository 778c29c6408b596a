"""Error mapping (problem+json -> typed exceptions) and retries (idempotent calls only)."""

from __future__ import annotations

import httpx
import pytest
from clients_helpers import FAST_RETRY, NODE_TOKENS, OPERATOR_TOKEN, request_event
from pydantic import ValidationError

from clients.sdk import (
    AsyncStateBudgetClient,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    ConnectionError,
    NotFoundError,
    PermissionDeniedError,
    ServerError,
    StateBudgetClient,
    UnexpectedStatusError,
)
from planner_service.wire.enums import ReportStatus
from planner_service.wire.nodes import GpuInventoryIn, GpuTelemetryIn

# the SDK passes a per-call timeout on long polls; starlette's TestClient warns that it ignores it
pytestmark = pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument")


@pytest.mark.parametrize(
    ("send", "field"),
    [
        (lambda sb: sb.lease("n1", max_operations=0), "max_operations"),
        (lambda sb: sb.lease("n1", wait_seconds=float("inf")), "wait_seconds"),
        (lambda sb: sb.register_node("n1", gpus=[{"id": "n1-g0", "hbm_bytes": -1}]), "gpus.0.hbm_bytes"),
        (lambda sb: sb.register_node("n1", engines=[{"name": "e", "kind": "tgi"}]), "engines.0.kind"),
        (lambda sb: sb.register_node("n1", scale=2.0), "scale"),
        (lambda sb: sb.heartbeat("n1", gpus=[{"id": "n1-g0", "used_bytes": -1}]), "gpus.0.used_bytes"),
        (lambda sb: sb.heartbeat("n1", gpus=[{"id": "n1-g0", "colour": "red"}]), "gpus.0.colour"),
        (lambda sb: sb.heartbeat("n1", expert_hit_rates={"coder": 1.5}), "expert_hit_rates.coder"),
        (lambda sb: sb.report("1.op-1", lease_id="", status=ReportStatus.DONE), "lease_id"),
        (lambda sb: sb.report("1.op-1", lease_id="l", status="ok"), "status"),
        (lambda sb: sb.report("1.op-1", lease_id="l", status=ReportStatus.DONE, measured_bytes=-1), "measured_bytes"),
    ],
)
def test_a_bad_node_body_is_refused_locally_naming_the_field(sync_client, send, field):
    """Register, heartbeat, lease and report bodies are the wire's request models: a bad one never leaves."""
    sb, http, _ = sync_client()
    sent: list[str] = []
    http.event_hooks["request"].append(lambda request: sent.append(request.url.path))
    with pytest.raises(ValidationError) as info:
        send(sb)
    assert [".".join(str(p) for p in e["loc"]) for e in info.value.errors()] == [field]
    assert field in str(info.value) and sent == []


def test_typed_request_parts_are_sent_as_the_service_reads_them(sync_client):
    sb, _, _ = sync_client()
    assert sb.register_node("n1", gpus=[GpuInventoryIn(id="n1-g0")]).warnings[0].startswith("gpu 'n1-g1'")
    assert sb.heartbeat("n1", gpus=[GpuTelemetryIn(id="n1-g0", used_bytes=0)]).node == "n1"
    n1 = next(n for n in sb.get_cluster().nodes if n.id == "n1")
    assert n1.telemetry is not None and n1.telemetry.gpus[0].used_bytes == 0


def test_service_invalid_input_is_a_bad_request_with_its_field(sync_client):
    """What only the service can judge (a GPU of another node) is its 422 problem, mapped to `BadRequestError`."""
    sb, _, _ = sync_client()
    with pytest.raises(BadRequestError) as info:
        sb.heartbeat("n1", gpus=[{"id": "n2-g0"}])
    error = info.value
    assert error.status == 422 and error.title == "Invalid input"
    assert error.field == "gpus.0.id" and "n2-g0" in error.detail
    assert error.errors[0].field == "gpus.0.id" and error.problem is not None
    assert error.problem.status == 422 and error.problem.errors == error.errors


def test_unknown_event_model_is_a_bad_request(sync_client):
    sb, _, _ = sync_client()
    with pytest.raises(BadRequestError) as info:
        sb.post_events(request_event("e1", "s1", "no-such-model"))
    assert info.value.status == 422 and "no-such-model" in info.value.detail


def test_tokens(sync_client):
    anonymous, http, _clock = sync_client(auth=True)
    with pytest.raises(AuthenticationError) as info:
        anonymous.get_srv()
    assert info.value.status == 401 and "Bearer" in info.value.detail
    wrong = StateBudgetClient(token="wrong", http_client=http, retry=FAST_RETRY)
    with pytest.raises(AuthenticationError, match="unknown bearer token"):
        wrong.get_srv()
    node1 = StateBudgetClient(token=NODE_TOKENS["n1"], http_client=http, retry=FAST_RETRY)
    with pytest.raises(PermissionDeniedError) as denied:
        node1.get_srv()
    assert denied.value.status == 403 and denied.value.title == "Forbidden" and "operator token" in denied.value.detail
    with pytest.raises(PermissionDeniedError, match="n2"):
        node1.lease("n2")
    assert node1.register_node("n1").node == "n1"
    operator = StateBudgetClient(token=OPERATOR_TOKEN, http_client=http, retry=FAST_RETRY)
    assert operator.get_srv().version >= 1
    assert anonymous.livez().status == "ok"  # open endpoints need no token


def test_not_found_and_conflicts(sync_client):
    sb, _, _ = sync_client()
    mine = sb.lease("n1", max_operations=1)
    op, lease_id = mine.operations[0], mine.lease_id
    assert lease_id is not None
    with pytest.raises(NotFoundError, match="99.op-1"):
        sb.report("99.op-1", lease_id=lease_id, status=ReportStatus.DONE)
    with pytest.raises(NotFoundError, match="nx"):
        sb.lease("nx")
    with pytest.raises(ConflictError) as info:
        sb.report(op.id, lease_id="someone-elses-lease", status=ReportStatus.DONE)
    assert info.value.status == 409 and "another lease" in info.value.detail
    other = sb.lease("n2", max_operations=1).lease_id
    assert other is not None
    with pytest.raises(ConflictError):
        sb.report(op.id, lease_id=other, status=ReportStatus.DONE)
    assert sb.report(op.id, lease_id=lease_id, status=ReportStatus.DONE).duplicate is False
    assert sb.report(op.id, lease_id=lease_id, status=ReportStatus.DONE).duplicate is True
    with pytest.raises(ConflictError, match="already done"):
        sb.report(op.id, lease_id=lease_id, status=ReportStatus.FAILED, error="x")


def _scripted(statuses: list[int], seen: list[str]) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        status = statuses.pop(0) if statuses else 200
        if status == 200:
            return httpx.Response(200, json={"version": 1, "srv": [], "placement": []})  # an SRV
        return httpx.Response(
            status,
            json={"type": "about:blank", "title": "Not ready", "status": status, "detail": "starting"},
            headers={"content-type": "application/problem+json"},
        )

    return httpx.MockTransport(handler)


def test_idempotent_calls_retry_5xx_then_succeed():
    seen: list[str] = []
    sb = StateBudgetClient(
        retry=FAST_RETRY, http_client=httpx.Client(transport=_scripted([503, 502], seen), base_url="http://x")
    )
    assert sb.get_srv().version == 1
    assert seen == ["GET /v1/srv"] * 3


def test_retries_give_up_with_the_last_error():
    seen: list[str] = []
    sb = StateBudgetClient(
        retry=FAST_RETRY, http_client=httpx.Client(transport=_scripted([503] * 5, seen), base_url="http://x")
    )
    with pytest.raises(ServerError) as info:
        sb.readyz()
    assert info.value.status == 503 and info.value.detail == "starting" and len(seen) == FAST_RETRY.attempts


def test_a_lease_and_a_replan_are_never_retried():
    seen: list[str] = []
    sb = StateBudgetClient(
        retry=FAST_RETRY, http_client=httpx.Client(transport=_scripted([503, 503], seen), base_url="http://x")
    )
    with pytest.raises(ServerError):
        sb.lease("n1")
    with pytest.raises(ServerError):
        sb.replan()
    assert seen == ["POST /v1/nodes/n1/lease", "POST /v1/plan"]


def test_client_errors_are_not_retried_and_odd_statuses_are_typed():
    seen: list[str] = []
    sb = StateBudgetClient(
        retry=FAST_RETRY, http_client=httpx.Client(transport=_scripted([409, 405], seen), base_url="http://x")
    )
    with pytest.raises(ConflictError):
        sb.get_srv()
    with pytest.raises(UnexpectedStatusError) as info:
        sb.get_srv()
    assert info.value.status == 405 and seen == ["GET /v1/srv"] * 2


def test_transport_errors_become_connection_errors_and_are_retried():
    calls = []

    def refuse(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        raise httpx.ConnectError("connection refused", request=request)

    sb = StateBudgetClient(
        retry=FAST_RETRY, http_client=httpx.Client(transport=httpx.MockTransport(refuse), base_url="http://x")
    )
    with pytest.raises(ConnectionError) as info:
        sb.get_plan()
    assert len(calls) == FAST_RETRY.attempts and "ConnectError" in str(info.value)
    assert isinstance(info.value, OSError)  # also a builtin ConnectionError


@pytest.mark.anyio
async def test_async_client_maps_and_retries_the_same_way():
    seen: list[str] = []
    transport = _scripted([503, 404], seen)
    sb = AsyncStateBudgetClient("http://x", retry=FAST_RETRY, transport=transport)
    with pytest.raises(NotFoundError):
        await sb.get_srv()
    assert seen == ["GET /v1/srv"] * 2
    await sb.aclose()


def test_an_answer_that_is_not_a_problem_still_maps_by_status():
    page = httpx.MockTransport(lambda request: httpx.Response(502, text="<html>bad gateway</html>"))
    sb = StateBudgetClient(retry=FAST_RETRY, http_client=httpx.Client(transport=page, base_url="http://x"))
    with pytest.raises(ServerError) as info:
        sb.get_srv()
    assert info.value.problem is None and info.value.detail == "<html>bad gateway</html>"
    assert info.value.title == "Bad Gateway" and info.value.field is None and info.value.errors == []


def test_a_problem_with_members_this_sdk_does_not_know_is_still_read():
    body = {
        "type": "about:blank",
        "title": "Invalid input",
        "status": 422,
        "detail": "events.0.model: Field required",
        "field": "events.0.model",
        "errors": [{"field": "events.0.model", "message": "Field required"}],
        "instance": "/v1/events",  # an RFC 9457 member the service does not send today
    }
    answer = httpx.MockTransport(lambda request: httpx.Response(422, json=body))
    sb = StateBudgetClient(retry=FAST_RETRY, http_client=httpx.Client(transport=answer, base_url="http://x"))
    with pytest.raises(BadRequestError) as info:
        sb.post_events(request_event("e1", "s1", "coder"))
    assert info.value.problem is not None and info.value.field == "events.0.model"
    assert [(e.field, e.message) for e in info.value.errors] == [("events.0.model", "Field required")]


def test_log_retries_says_which_call_failed_and_when_it_runs_again(caplog: pytest.LogCaptureFixture) -> None:
    """The agent's and the gateway's retry lines: the call, its error and the wait, one line per retry."""
    import logging
    import socket

    from stamina.instrumentation import set_on_retry_hooks

    from clients.sdk import StateBudgetClient, log_retries

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_retries(logging.getLogger("statebudget.test"))
    try:
        with (
            StateBudgetClient(f"http://127.0.0.1:{port}", retry=FAST_RETRY) as sb,
            caplog.at_level(logging.WARNING, logger="statebudget.test"),
            pytest.raises(ConnectionError),
        ):
            sb.get_srv()
    finally:
        set_on_retry_hooks(None)  # stamina's defaults again
    lines = [r.getMessage() for r in caplog.records if r.name == "statebudget.test"]
    assert len(lines) == 2  # 3 attempts: 2 retries
    assert lines[0].startswith("retry 1 in ") and "GET /v1/srv: ConnectError" in lines[0]
