"""`renew_lease` in the sync and async SDK: the typed answer, and refusals mapped as every other error."""

from __future__ import annotations

import httpx
import pytest
from clients_helpers import FAST_RETRY, NODE_TOKENS, OPERATOR_TOKEN, async_client, make_app, served

from clients.sdk import ConflictError, PermissionDeniedError, ServerError, StateBudgetClient
from planner_service.wire.enums import ReportStatus
from planner_service.wire.operations import RenewOut

LEASE_SECONDS = 30.0  # clients_helpers.make_app's

# the SDK passes a per-call timeout on long polls; starlette's TestClient warns that it ignores it
pytestmark = pytest.mark.filterwarnings("ignore:You should not use the 'timeout' argument")


def test_a_renewed_lease_outlives_its_length_and_a_late_renewal_is_a_conflict(sync_client):
    sb, _, clock = sync_client()  # n2: the demo's first plan has several operations ready there
    lease = sb.lease("n2", max_operations=2)  # and the rest of an engine step's moves, leased together
    assert lease.lease_id is not None and len(lease.operations) >= 2
    ids = [o.id for o in lease.operations]
    clock.advance(20.0)
    renewed = sb.renew_lease("n2", lease.lease_id)
    assert isinstance(renewed, RenewOut)
    assert (renewed.lease_id, renewed.node, renewed.operations) == (lease.lease_id, "n2", ids)
    assert renewed.expires_in_seconds == LEASE_SECONDS
    clock.advance(20.0)  # 40 s after the lease: it would have run out unrenewed
    assert sb.report(ids[0], lease_id=lease.lease_id, status=ReportStatus.DONE).operation.state == "done"
    assert sb.renew_lease("n2", lease.lease_id).operations == ids[1:]
    clock.advance(LEASE_SECONDS)
    with pytest.raises(ConflictError) as info:
        sb.renew_lease("n2", lease.lease_id)
    assert info.value.status == 409 and f"{ids[-1]} re-queued)" in info.value.detail
    assert all(i in info.value.detail for i in ids[1:])


def test_another_nodes_token_is_permission_denied(sync_client):
    operator, http, _ = sync_client(token=OPERATOR_TOKEN, auth=True)
    lease = operator.lease("n1", max_operations=1)
    assert lease.lease_id is not None
    n2 = StateBudgetClient(token=NODE_TOKENS["n2"], http_client=http, retry=FAST_RETRY)
    with pytest.raises(PermissionDeniedError, match="does not reach node 'n1'"):
        n2.renew_lease("n1", lease.lease_id)
    with pytest.raises(PermissionDeniedError, match="belongs to node 'n1'"):
        n2.renew_lease("n2", lease.lease_id)
    n1 = StateBudgetClient(token=NODE_TOKENS["n1"], http_client=http, retry=FAST_RETRY)
    assert n1.renew_lease("n1", lease.lease_id).node == "n1"


def test_a_renewal_is_retried_on_a_5xx():
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        if len(seen) == 1:
            return httpx.Response(
                503,
                json={"type": "about:blank", "title": "Not ready", "status": 503, "detail": "starting"},
                headers={"content-type": "application/problem+json"},
            )
        body = {"lease_id": "l1", "node": "n1", "expires_at": "2027-01-15T08:00:30Z", "expires_in_seconds": 30.0}
        return httpx.Response(200, json={**body, "operations": ["1.op-1"]})

    sb = StateBudgetClient(
        retry=FAST_RETRY, http_client=httpx.Client(transport=httpx.MockTransport(handler), base_url="http://x")
    )
    assert sb.renew_lease("n1", "l1").operations == ["1.op-1"]
    assert seen == ["POST /v1/nodes/n1/leases/l1/renew"] * 2
    always = StateBudgetClient(
        retry=FAST_RETRY,
        http_client=httpx.Client(
            transport=httpx.MockTransport(lambda _: httpx.Response(502, text="bad gateway")), base_url="http://x"
        ),
    )
    with pytest.raises(ServerError):
        always.renew_lease("n1", "l1")


@pytest.mark.anyio
async def test_the_async_client_renews_and_maps_refusals_the_same_way(tmp_path):
    app = make_app(tmp_path, auth=True)
    async with served(app) as http:
        n1, n2 = async_client(http, NODE_TOKENS["n1"]), async_client(http, NODE_TOKENS["n2"])
        lease = await n1.lease("n1", max_operations=1)
        assert lease.lease_id is not None
        renewed = await n1.renew_lease("n1", lease.lease_id)
        assert isinstance(renewed, RenewOut) and renewed.operations == [o.id for o in lease.operations]
        with pytest.raises(PermissionDeniedError):
            await n2.renew_lease("n2", lease.lease_id)
        with pytest.raises(ConflictError, match="the service does not know it"):
            await n1.renew_lease("n1", "not-a-lease")
