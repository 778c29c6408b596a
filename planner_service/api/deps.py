"""Typed dependencies: the service, the settings, and who is calling.

Each is an `async def` although none awaits: FastAPI runs a plain `def` dependency in a worker thread, and
these only read the app's state and compare tokens, so a thread hand-off (a wake-up through a `Condition`,
and the GIL taken back and forth) would cost more than the work. Only the routes that take the state lock
run in a thread."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from planner_service.api.errors import Unauthorized
from planner_service.service.engine import ClusterService
from planner_service.service.errors import Forbidden
from planner_service.settings import Settings


class QueueSignal:
    """Wakes lease long-polls when their node's queue may have changed, or when the service is shutting down.

    One event per node with a long-poll waiting: a report or an expiry on one node wakes that node's
    waiters only, so a busy node does not send every other node's agents to look at queues that did not
    change. Called on the event loop's thread (other threads go through `loop.call_soon_threadsafe`).
    Once `drain()` was called, `draining` stays true: a long-poll answers at once with an empty lease
    instead of waiting, so a shutdown is not held up by agents' waits.
    """

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}
        self._any: asyncio.Event | None = None
        self._draining = False

    def event(self, node: str) -> asyncio.Event:
        """What the next change of `node`'s queue sets (take it before looking at the queue)."""
        return self._events.setdefault(node, asyncio.Event())

    def any_change(self) -> asyncio.Event:
        """What the next change of any queue sets: a plan installed, an operation reported or expired (the route
        table's long-poll takes it before looking at the table)."""
        if self._any is None:
            self._any = asyncio.Event()
        return self._any

    @property
    def draining(self) -> bool:
        return self._draining

    def bump(self, nodes: Iterable[str] | None = None) -> None:
        """Wake the long-polls of `nodes` (None: of every node), and those waiting for any change."""
        for node in list(self._events) if nodes is None else nodes:
            event = self._events.pop(node, None)
            if event is not None:
                event.set()
        if self._any is not None:
            self._any.set()
            self._any = None

    def drain(self) -> None:
        self._draining = True
        self.bump()


async def get_service(request: Request) -> ClusterService:
    service: ClusterService = request.app.state.service
    return service


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_signal(request: Request) -> QueueSignal:
    signal: QueueSignal = request.app.state.signal
    return signal


ServiceDep = Annotated[ClusterService, Depends(get_service)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
SignalDep = Annotated[QueueSignal, Depends(get_signal)]

_bearer = HTTPBearer(
    auto_error=False,
    description="An operator token, a node's token for its own endpoints, or a router (gateway) token.",
)


@dataclass(frozen=True)
class Principal:
    kind: Literal["open", "operator", "node", "router"]
    node: str | None = None


async def get_principal(
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    if not settings.auth_enabled:
        return Principal("open")
    if credentials is None:
        raise Unauthorized("send 'Authorization: Bearer <token>' with an operator, node or router token")
    token = credentials.credentials.encode()
    if any(hmac.compare_digest(token, t.encode()) for t in settings.operator_tokens):
        return Principal("operator")
    if any(hmac.compare_digest(token, t.encode()) for t in settings.router_tokens):
        return Principal("router")
    for node, t in settings.node_tokens.items():
        if hmac.compare_digest(token, t.encode()):
            return Principal("node", node)
    raise Unauthorized("unknown bearer token")


PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def require_operator(principal: PrincipalDep) -> Principal:
    if principal.kind == "node":
        raise Forbidden(
            f"this endpoint needs an operator token; the token of node {principal.node!r} reaches only "
            "that node's register, heartbeat, lease, lease renewal and report"
        )
    if principal.kind == "router":
        raise Forbidden(_ROUTER_REACH)
    return principal


_ROUTER_REACH = "this endpoint needs an operator token; a router token reaches only POST /v1/events, GET /v1/routes and GET /v1/plan"


async def require_router_access(principal: PrincipalDep) -> Principal:
    """An operator or a gateway (router token): events in, routes and the plan out."""
    if principal.kind == "node":
        raise Forbidden(
            f"this endpoint needs an operator token (or a router token); the token of node {principal.node!r} reaches only "
            "that node's register, heartbeat, lease, lease renewal and report"
        )
    return principal


async def require_node_access(node_id: str, principal: PrincipalDep) -> Principal:
    if principal.kind == "router":
        raise Forbidden(_ROUTER_REACH)
    if principal.kind == "node" and principal.node != node_id:
        raise Forbidden(f"the token of node {principal.node!r} does not reach node {node_id!r}")
    return principal


OperatorDep = Annotated[Principal, Depends(require_operator)]
NodeAccessDep = Annotated[Principal, Depends(require_node_access)]
RouterAccessDep = Annotated[Principal, Depends(require_router_access)]
