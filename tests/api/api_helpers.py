"""Helpers for the API tests: a fake clock, a thin client wrapper, problem+json checks."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from support import TINY_SCENARIO, FakeClock

TINY = TINY_SCENARIO
OPERATOR = {"Authorization": "Bearer op-token"}
NODE1 = {"Authorization": "Bearer n1-token"}
NODE2 = {"Authorization": "Bearer n2-token"}


class Harness:
    def __init__(self, client: TestClient, clock: FakeClock, registry: CollectorRegistry) -> None:
        self.client = client
        self.clock = clock
        self.registry = registry

    def get(self, path: str, **kw: Any):
        return self.client.get(path, **kw)

    def post(self, path: str, json: Any = None, **kw: Any):
        return self.client.post(path, json=json, **kw)

    def events(self, *events: dict[str, Any], headers: dict[str, str] | None = None):
        return self.client.post("/v1/events", json={"events": list(events)}, headers=headers)

    def lease(self, node: str, n: int = 10, wait: float = 0.0, headers: dict[str, str] | None = None):
        return self.client.post(
            f"/v1/nodes/{node}/lease", json={"max_operations": n, "wait_seconds": wait}, headers=headers
        )

    def report(
        self, op_id: str, lease_id: str, status: str = "done", headers: dict[str, str] | None = None, **extra: Any
    ):
        body = {"lease_id": lease_id, "status": status, **extra}
        return self.client.post(f"/v1/operations/{op_id}/report", json=body, headers=headers)

    def metric(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)


def request(event_id: str, session: str, model: str, **extra: Any) -> dict[str, Any]:
    return {"id": event_id, "type": "request", "session": session, "model": model, **extra}


def assert_problem(response, status: int, *needles: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["status"] == status and body["title"] and body["detail"]
    text = response.text
    for needle in needles:
        assert needle in text, f"{needle!r} not in {text}"
    return body
