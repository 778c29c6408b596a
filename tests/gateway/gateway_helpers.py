"""The gateway tests' stack: a real planner, fake vLLM OpenAI servers and the gateway, each a real HTTP server."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fakes.vllm_serving import ServingState
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

ROUTER_TOKEN = "router-token"
OPERATOR = {"Authorization": "Bearer op-token"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """An ASGI app served by uvicorn in a thread, lifespan included, until `stop()`."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.app = app
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        # a test's end needs no graceful shutdown: uvicorn would wait for the gateway's route long-poll to run out
        self.server.should_exit = self.server.force_exit = True
        self.thread.join(15)


def stop_all(served: list[Served]) -> None:
    """Stop servers together: each takes up to uvicorn's 0.1 s tick to notice, so asked one by one they add up."""
    for s in served:
        s.server.should_exit = s.server.force_exit = True
    for s in served:
        s.thread.join(15)


def wait_until(condition: Callable[[], Any], timeout_seconds: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def instance(model: str, node: str, gpu: str) -> dict[str, Any]:
    return {
        "id": f"{model}@bf16@{gpu}",
        "node": node,
        "kind": "vllm",
        "model": model,
        "precision": "bf16",
        "gpus": [gpu],
        "kv_pool_bytes_per_gpu": 1 << 30,
    }


class RecordEvents:
    """ASGI middleware keeping the bodies of the POST /v1/events the planner answered 200."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/events":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        status: list[int] = []

        async def recording_receive() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        async def recording_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        await self.app(scope, recording_receive, recording_send)
        if status == [200]:
            self.bodies.append(b"".join(chunks))


@dataclass
class Stack:
    planner: Served
    gateway: Served
    planner_events: RecordEvents
    engines: dict[str, tuple[Served, ServingState]] = field(default_factory=dict)
    planner_http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.planner_http = httpx.Client(base_url=self.planner.url, headers=OPERATOR, timeout=30)

    @property
    def gateway_v1(self) -> str:
        return self.gateway.url + "/v1"

    def register(self, node: str, engines: list[dict[str, Any]]) -> None:
        r = self.planner_http.post(f"/v1/nodes/{node}/register", json={"engines": engines})
        assert r.status_code == 200, r.text

    def heartbeat(self, node: str, states: list[tuple[str, str, str]]) -> None:
        """(model, gpu, state) per instance of `node`."""
        body = {"instances": [{"instance": instance(m, node, g), "state": s} for m, g, s in states]}
        r = self.planner_http.post(f"/v1/nodes/{node}/heartbeat", json=body)
        assert r.status_code == 200, r.text

    @property
    def follower(self) -> Any:
        return self.gateway.app.state.follower

    def wait_for_table(self, predicate: Callable[[Any], bool], what: str = "route table") -> None:
        wait_until(lambda: predicate(self.follower.table), what=what)

    def events(self) -> list[dict[str, Any]]:
        """Every event the planner received, in order (resends included)."""
        return [e for body in self.planner_events.bodies for e in json.loads(body)["events"]]


class ScriptedPlanner:
    """The planner's two gateway endpoints: GET /v1/routes (long-poll on the revision) and POST /v1/events."""

    def __init__(self) -> None:
        self.table: dict[str, Any] = {}
        self.revision = 0
        self.changed = threading.Condition()

    def publish(self, table: dict[str, Any]) -> None:
        with self.changed:
            self.revision += 1
            self.table = {"epoch": 1, "revision": f"r{self.revision}", **table}
            self.changed.notify_all()

    def app(self) -> Starlette:
        async def routes(request: Request) -> JSONResponse:
            after = request.query_params.get("after_revision")
            deadline = time.monotonic() + float(request.query_params.get("wait", 0))
            while after is not None and self.table["revision"] == after and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return JSONResponse(self.table)

        async def events(request: Request) -> JSONResponse:
            n = len((await request.json())["events"])
            return JSONResponse({"applied": n, "duplicates": 0, "results": []})

        return Starlette(routes=[Route("/v1/routes", routes), Route("/v1/events", events, methods=["POST"])])


def route_instance(iid: str, url: str, node: str = "n1", engine: str | None = None) -> dict[str, Any]:
    return {"id": iid, "node": node, "gpus": [iid], "state": "running", "url": url, "engine": engine}
