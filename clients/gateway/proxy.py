"""One request through the gateway: route it, hold it while its model wakes, pass it to the engine and the
answer back as the engine wrote it, and tell the session events what happened.

A raw ASGI handler (no routing, request object or response class on this path): the two POST routes are
all the gateway's traffic, and each layer cost CPU per request (docs/benchmarks/gateway.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import Any

from clients.gateway.errors import GatewayError, unavailable
from clients.gateway.events import SessionEvents
from clients.gateway.follower import RouteFollower
from clients.gateway.metrics import GatewayMetrics
from clients.gateway.parsing import AnswerFacts, Endpoint, RequestFacts, StreamScanner, parse_request, read_answer
from clients.gateway.pins import Pins
from clients.gateway.settings import GatewaySettings
from clients.gateway.table import Choice
from clients.gateway.upstream import ConnectFailed, UpstreamBroken, UpstreamPool, UpstreamResponse
from clients.gateway.warmups import Warmups

log = logging.getLogger("statebudget.gateway")

ROUTES: dict[str, Endpoint] = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
PATHS: dict[Endpoint, bytes] = {"chat": b"/v1/chat/completions", "completions": b"/v1/completions"}
# hop-by-hop headers (RFC 9110 §7.6.1) and the ones the upstream request or the server set anew
_DROP_REQUEST = frozenset(
    {b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade"}
    | {b"proxy-connection"}
)
_DROP_RESPONSE = frozenset({b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"date", b"server"})
RETRY_AFTER_SECONDS = 5

Message = dict[str, Any]


class ClientGone(Exception):
    """The client closed its connection before its answer was complete."""


class ClientWatch:
    """Learns from the ASGI receive channel that the client went away while its request is in flight, and
    then closes the engine's connection: the way an OpenAI server learns to abort (vLLM's
    `with_cancellation`, vllm/entrypoints/utils.py, races each handler with a wait for `http.disconnect`)."""

    __slots__ = ("_task", "busy_on", "finished", "gone", "upstream")

    def __init__(self, receive: Any) -> None:
        self.gone = False
        self.finished = False
        self.upstream: UpstreamResponse | None = None
        self.busy_on: str | None = None  # the instance the request counts as in flight on (warm-ups wait)
        self._task: asyncio.Future[Message] = asyncio.ensure_future(receive())
        self._task.add_done_callback(self._heard)

    def _heard(self, task: asyncio.Future[Message]) -> None:
        if self.finished or task.cancelled():
            return
        if task.exception() is not None or task.result()["type"] == "http.disconnect":
            self.gone = True
            if self.upstream is not None:
                self.upstream.abort()

    def stop(self) -> None:
        self.finished = True
        self._task.cancel()


async def _read_body(receive: Any) -> bytes | None:
    """The request body; None when the client went away before sending all of it."""
    message = await receive()
    if message["type"] != "http.request":
        return None
    body: bytes = message.get("body", b"")
    if not message.get("more_body"):
        return body
    pieces = [body]
    while message.get("more_body"):
        message = await receive()
        if message["type"] != "http.request":
            return None
        pieces.append(message.get("body", b""))
    return b"".join(pieces)


async def send_error(send: Any, error: GatewayError) -> None:
    body = error.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers().items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Proxy:
    def __init__(
        self,
        settings: GatewaySettings,
        upstream: UpstreamPool,
        follower: RouteFollower,
        sessions: SessionEvents,
        metrics: GatewayMetrics,
        warmups: Warmups,
        pins: Pins,
    ) -> None:
        self.settings = settings
        self.upstream = upstream
        self.follower = follower
        self.sessions = sessions
        self.metrics = metrics
        self.warmups = warmups
        self.pins = pins
        self._held: dict[str, int] = defaultdict(int)

    async def serve(self, endpoint: Endpoint, scope: Message, receive: Any, send: Any) -> None:
        """The ASGI exchange of one POST: an OpenAI-shaped error for what the gateway refuses, else the engine's
        answer passed through."""
        arrived = time.perf_counter()
        body = await _read_body(receive)
        if body is None:
            return  # the client left before its request was complete: nothing to answer, nothing sent
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        session_header = next((v.decode("latin-1") for k, v in headers if k == b"x-session-id"), None)
        try:
            facts = parse_request(body, endpoint, session_header)
        except GatewayError as error:
            await send_error(send, error)
            return
        self.sessions.on_request(facts)
        self.warmups.on_request(facts.session)
        watch = ClientWatch(receive)
        upstream: UpstreamResponse | None = None
        try:
            choice = await self._route(facts, arrived)
            if watch.gone:
                raise ClientGone  # left while its model woke: the request was never sent
            forwarded = [(k, v) for k, v in headers if k not in _DROP_REQUEST]
            upstream, choice = await self._send(choice, facts, endpoint, body, forwarded, watch)
            self.metrics.routed.labels(facts.model, "kv_holder" if choice.kv_holder else "other").inc()
            self.metrics.ttft.labels(facts.model).observe(time.perf_counter() - arrived)
            response_headers = [
                (k, v) for k, v in ((k.lower(), v) for k, v in upstream.headers) if k not in _DROP_RESPONSE
            ]
            if facts.stream and upstream.status == 200:
                answer = await self._relay(upstream, response_headers, facts, choice, watch, send)
            else:
                answer = await self._answer(upstream, response_headers, facts, choice, watch, send)
            if answer is not None:
                self.pins.remember(facts.session, facts.model, endpoint, body, forwarded)
                if answer.finish_reason == "tool_calls":
                    self.warmups.remember(facts.session, endpoint, body, forwarded)
        except GatewayError as error:
            await send_error(send, error)
        except ClientGone:
            self.metrics.requests.labels(facts.model, "cancelled").inc()
        finally:
            watch.stop()
            if upstream is not None:
                upstream.release()
            if watch.busy_on is not None:
                self.warmups.end(watch.busy_on)

    async def _send(
        self,
        choice: Choice,
        facts: RequestFacts,
        endpoint: Endpoint,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        watch: ClientWatch,
    ) -> tuple[UpstreamResponse, Choice]:
        """The engine's answer once its headers came, and the instance that gave it: an instance that cannot be
        reached is skipped for another (nothing was sent); one that fails after the request went out is a 502."""
        tried: set[str] = set()
        while True:
            url = choice.instance.url
            assert url is not None  # choose() returns instances with a URL only
            if watch.busy_on is not None:
                self.warmups.end(watch.busy_on)
            watch.busy_on = choice.instance.id
            self.warmups.begin(choice.instance.id, facts.session, facts.model)  # warm-ups there give way first
            try:
                upstream = await self.upstream.post(url, PATHS[endpoint], headers, body)
                break
            except ConnectFailed as error:
                tried.add(choice.instance.id)
                log.warning("instance %s unreachable (%s); trying another", choice.instance.id, error)
                self.metrics.retries.labels(facts.model).inc()
                retry = self.follower.table.choose(facts.model, facts.session, exclude=frozenset(tried))
                if retry is None:
                    self.metrics.requests.labels(facts.model, "unavailable").inc()
                    raise unavailable(
                        f"no running instance of {facts.model!r} could be reached; the request was not sent",
                        RETRY_AFTER_SECONDS,
                    ) from error
                choice = retry
            except ValueError as error:  # the table's URL for the instance is not one the pool can reach
                self.metrics.requests.labels(facts.model, "engine_error").inc()
                raise GatewayError(502, str(error), type="upstream_error") from error
        watch.upstream = upstream  # from now on a client that leaves closes the engine's connection
        try:
            await upstream.head()  # a non-streamed answer's headers come with its end: the client may leave first
        except UpstreamBroken as error:
            upstream.release()
            if watch.gone:
                raise ClientGone from error
            self.metrics.requests.labels(facts.model, "engine_error").inc()
            raise GatewayError(
                502,
                f"instance {choice.instance.id} failed before answering ({error}); not resent",
                type="upstream_error",
            ) from error
        return upstream, choice

    async def _relay(
        self,
        upstream: UpstreamResponse,
        headers: list[tuple[bytes, bytes]],
        facts: RequestFacts,
        choice: Choice,
        watch: ClientWatch,
        send: Any,
    ) -> AnswerFacts | None:
        """The engine's SSE bytes as they come, one write per read from the engine; the last piece carries the
        end of the response (one write fewer). The answer's facts; None where the stream broke off."""
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        scanner = StreamScanner()
        try:
            while True:
                piece, ended = await upstream.next_chunk()
                scanner.feed(piece)
                await send({"type": "http.response.body", "body": piece, "more_body": not ended})
                if ended:
                    break
        except UpstreamBroken as error:
            if watch.gone:
                raise ClientGone from error
            log.warning("stream of %s from %s broke off: %s", facts.model, choice.instance.id, error)
            self.metrics.requests.labels(facts.model, "engine_error").inc()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return None
        self.metrics.requests.labels(facts.model, "ok").inc()
        self.sessions.on_answer(facts, scanner.facts)
        return scanner.facts

    async def _answer(
        self,
        upstream: UpstreamResponse,
        headers: list[tuple[bytes, bytes]],
        facts: RequestFacts,
        choice: Choice,
        watch: ClientWatch,
        send: Any,
    ) -> AnswerFacts | None:
        """A whole answer (not streamed, or an engine's error): read to its end, then sent at once. The answer's
        facts where the engine answered 200, else None."""
        try:
            content = await upstream.read()
        except UpstreamBroken as error:
            if watch.gone:
                raise ClientGone from error
            self.metrics.requests.labels(facts.model, "engine_error").inc()
            raise GatewayError(
                502, f"instance {choice.instance.id} broke off its answer ({error}); not resent", type="upstream_error"
            ) from error
        self.metrics.requests.labels(facts.model, "ok" if upstream.status < 400 else "engine_error").inc()
        answer = read_answer(content) if upstream.status == 200 else None
        if answer is not None:
            self.sessions.on_answer(facts, answer)
        headers = [*headers, (b"content-length", str(len(content)).encode())]
        await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
        await send({"type": "http.response.body", "body": content})
        return answer

    async def _route(self, facts: RequestFacts, arrived: float) -> Choice:
        """An instance running the model now, else hold the request until the table shows one."""
        table = self.follower.table
        choice = table.choose(facts.model, facts.session)
        if choice is not None:
            return choice
        if not table.known(facts.model):
            self.metrics.requests.labels("unknown", "bad_request").inc()
            raise GatewayError(
                404,
                f"The model `{facts.model}` does not exist: no registered engine serves it "
                f"(served: {', '.join(table.models) or 'none'})",
                type="NotFoundError",
                param="model",
            )
        if self._held[facts.model] >= self.settings.queue_limit_per_model:
            self.metrics.requests.labels(facts.model, "unavailable").inc()
            raise unavailable(
                f"{self._held[facts.model]} requests already wait for {facts.model!r} to wake", RETRY_AFTER_SECONDS
            )
        self._held[facts.model] += 1
        self.metrics.held.labels(facts.model).inc()
        deadline = arrived + self.settings.wake_timeout_seconds
        try:
            while True:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    self.metrics.requests.labels(facts.model, "unavailable").inc()
                    raise unavailable(
                        f"{facts.model!r} did not start running within {self.settings.wake_timeout_seconds:g} s; "
                        "the planner was asked for it",
                        RETRY_AFTER_SECONDS,
                    )
                await self.follower.wait_for_change(remaining)
                choice = self.follower.table.choose(facts.model, facts.session)
                if choice is not None:
                    return choice
        finally:
            self._held[facts.model] -= 1
            self.metrics.held.labels(facts.model).dec()
            self.metrics.wake_hold.labels(facts.model).observe(time.perf_counter() - arrived)
