"""Warm-ups: the planner's directives to prefill a session's known history on the model it is predicted to hand
off to, carried out while the session sits in a tool call, and only while the instance has nothing else to do.

The history is the session's last request, the one whose answer called a tool: its messages (or prompt) are a
prefix of the session's next request, so with prefix caching on (vLLM's automatic prefix caching, on by default
in V1) the hand-off's prefill finds that prefix's KV already computed. The warm-up is that request sent to the
predicted model with `max_tokens: 1`, not streamed.

A warm-up must never delay real work (issue 26: on a loaded trace warm-ups queued ahead of real prefills made
the hand-off P95 fifty times worse). So one starts only on an instance with no request of the gateway's in
flight and whose engine reports no request running or waiting (its scheduler gauges at `/metrics`: requests
that did not pass through this gateway count too), and a real request for the instance aborts every warm-up
there before it is sent (closing the connection: an OpenAI server aborts a request whose client went away). A
directive is carried out once per tool call: one cancelled is not retried until the session's next tool call.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass

from clients.gateway.metrics import GatewayMetrics
from clients.gateway.parsing import Endpoint
from clients.gateway.table import RouteTable
from clients.gateway.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from planner_service.wire.routes import WarmupDirective

log = logging.getLogger("statebudget.gateway.warmups")

PATHS: dict[Endpoint, bytes] = {"chat": b"/v1/chat/completions", "completions": b"/v1/completions"}
# what a warm-up's request carries of the client's headers: its credentials for the engine, nothing that names
# the client's own request (an `X-Request-Id` reused would clash with the real request's in the engine)
_KEEP_HEADERS = frozenset({b"authorization", b"api-key"})
# the scheduler's gauges of requests running and waiting: vLLM's (vllm/v1/metrics/loggers.py) and SGLang's
# (sglang/srt/metrics/collector.py); an engine that exposes neither is judged by the gateway's own count alone
_QUEUE_GAUGES = (
    b"vllm:num_requests_running",
    b"vllm:num_requests_waiting",
    b"sglang:num_running_reqs",
    b"sglang:num_queue_reqs",
)
ENGINE_BUSY_RETRY_SECONDS = 1.0  # an engine busy with others' requests is asked again after this long
WARMED_KEEP = 100_000  # completed warm-ups remembered until their session's next request, at most
# fields of the client's request that would make the warm-up more than one prefill and one token
_DROP_FIELDS = ("stream", "stream_options", "n", "best_of", "logprobs", "top_logprobs", "max_completion_tokens")


@dataclass(slots=True)
class _History:
    endpoint: Endpoint
    body: bytes
    headers: list[tuple[bytes, bytes]]


@dataclass(slots=True)
class _Running:
    directive: WarmupDirective
    task: asyncio.Task[None] | None = None
    upstream: UpstreamResponse | None = None
    cancelled: bool = False


def warmup_body(endpoint: Endpoint, body: bytes, model: str) -> bytes:
    """The client's request as a 1-token, non-streamed request to `model`: the same messages (or prompt) and
    tools, so the engine's chat template renders the same prefix."""
    data = json.loads(body)
    for name in _DROP_FIELDS:
        data.pop(name, None)
    data["model"] = model
    data["max_tokens"] = 1
    if endpoint == "chat":
        data.pop("tool_choice", None)  # a forced tool call would only lengthen the one token's decode
    return json.dumps(data, separators=(",", ":")).encode()


class Warmups:
    def __init__(
        self,
        upstream: UpstreamPool,
        metrics: GatewayMetrics,
        *,
        enabled: bool,
        history_bytes: int,
    ) -> None:
        self.upstream = upstream
        self.metrics = metrics
        self.enabled = enabled
        self.history_bytes = history_bytes
        self.table = RouteTable.empty()
        self._history: OrderedDict[str, _History] = OrderedDict()  # session -> its last request that called a tool
        self._history_size = 0
        self._busy: dict[str, int] = {}  # instance -> the gateway's real requests in flight there
        self._running: dict[tuple[str, str], _Running] = {}  # (session, instance)
        self._tried: dict[str, set[str]] = {}  # session -> instances warmed (or cancelled) in its current tool call
        self._warmed: dict[str, str] = {}  # session -> instance a completed warm-up prefilled
        self._engine_busy_until: dict[str, float] = {}  # instance -> when to ask its engine's gauges again

    # -- what the request path tells it ---------------------------------------------------------------------------

    def remember(self, session: str, endpoint: Endpoint, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        """The session's request whose answer called a tool: the history a warm-up prefills."""
        if not self.enabled:
            return
        self._forget(session)
        if len(body) > self.history_bytes:
            return
        kept = [(k, v) for k, v in headers if k in _KEEP_HEADERS]
        self._history[session] = _History(endpoint, body, kept)
        self._history_size += len(body)
        while self._history_size > self.history_bytes:
            _, oldest = self._history.popitem(last=False)
            self._history_size -= len(oldest.body)
        self.consider()

    def on_request(self, session: str) -> None:
        """A real request of `session` arrived: its tool call is over, its warm-ups are moot."""
        self._forget(session)
        self._tried.pop(session, None)
        if self._running:
            for key, running in list(self._running.items()):
                if key[0] == session:
                    self._cancel(running)

    def begin(self, instance: str, session: str, model: str) -> None:
        """A real request is about to go to `instance`: every warm-up there gives way first."""
        self._busy[instance] = self._busy.get(instance, 0) + 1
        if self._running:
            for key, running in list(self._running.items()):
                if key[1] == instance:
                    self._cancel(running)
        if self._warmed and self._warmed.pop(session, None) == instance:
            self.metrics.warmups_used.labels(model).inc()

    def end(self, instance: str) -> None:
        left = self._busy.get(instance, 0) - 1
        if left > 0:
            self._busy[instance] = left
            return
        self._busy.pop(instance, None)
        self.consider()

    def on_table(self, table: RouteTable) -> None:
        self.table = table
        wanted = {(d.session, d.instance) for d in table.warmups}
        sessions = {d.session for d in table.warmups}
        for session in [s for s in self._tried if s not in sessions]:
            del self._tried[session]  # a directive withdrawn and given again later is a new decision
        for key, running in list(self._running.items()):
            if key not in wanted:
                self._cancel(running)  # the planner no longer wants it (the card got busy, the session moved)
        self.consider()

    # -- carrying directives out ----------------------------------------------------------------------------------

    def consider(self) -> None:
        """Start each directive of the table that can run now: history known, instance running and idle."""
        if not self.enabled:
            return
        for directive in self.table.warmups:
            key = (directive.session, directive.instance)
            if key in self._running or directive.instance in self._tried.get(directive.session, ()):
                continue
            if self._busy.get(directive.instance):
                continue
            if self._engine_busy_until.get(directive.instance, 0.0) > asyncio.get_running_loop().time():
                continue
            history = self._history.get(directive.session)
            instance = self.table.routable(directive.model, directive.instance)
            if history is None or instance is None or instance.url is None:
                continue
            try:
                body = warmup_body(history.endpoint, history.body, directive.model)
            except (ValueError, AttributeError):  # parse_request accepted it, so this is not expected; skip it
                self._tried.setdefault(directive.session, set()).add(directive.instance)
                continue
            running = _Running(directive)
            self._running[key] = running
            self._tried.setdefault(directive.session, set()).add(directive.instance)
            running.task = asyncio.create_task(
                self._run(running, instance.url, PATHS[history.endpoint], history.headers, body)
            )

    async def _run(
        self, running: _Running, url: str, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        d = running.directive
        outcome = "failed"
        try:
            if await self._engine_queue(url):
                outcome = "engine_busy"
                self._tried.get(d.session, set()).discard(d.instance)  # not carried out: asked again later
                self._engine_busy_until[d.instance] = asyncio.get_running_loop().time() + ENGINE_BUSY_RETRY_SECONDS
                asyncio.get_running_loop().call_later(ENGINE_BUSY_RETRY_SECONDS, self.consider)
                return
            self.metrics.warmups.labels(d.model, "started").inc()
            running.upstream = await self.upstream.post(
                url, path, [(b"content-type", b"application/json"), *headers], body
            )
            if running.cancelled:
                running.upstream.abort()
                outcome = "cancelled"
                return
            await running.upstream.head()
            await running.upstream.read()
            if running.upstream.status == 200:
                outcome = "completed"
                self._warmed[d.session] = d.instance
                if len(self._warmed) > WARMED_KEEP:  # sessions that never came back: the oldest go
                    del self._warmed[next(iter(self._warmed))]
            else:
                log.info("warm-up of %s on %s: the engine answered %d", d.model, d.instance, running.upstream.status)
        except UpstreamError as error:
            if running.cancelled:
                outcome = "cancelled"
            else:
                log.info("warm-up of %s on %s failed: %s", d.model, d.instance, error)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            if running.upstream is not None:
                running.upstream.release()
            self._running.pop((d.session, d.instance), None)
            self.metrics.warmups.labels(d.model, outcome).inc()

    async def _engine_queue(self, url: str) -> float:
        """Requests the engine's scheduler reports running or waiting (0 where it reports neither gauge)."""
        response = await self.upstream.post(url, b"/metrics", [], b"", method=b"GET")
        try:
            await response.head()
            text = await response.read()
        finally:
            response.release()
        if response.status != 200:
            return 0.0
        total = 0.0
        for line in text.splitlines():
            if line.startswith(_QUEUE_GAUGES):
                try:
                    total += float(line.rsplit(b" ", 1)[1])
                except (IndexError, ValueError):
                    continue
        return total

    def _cancel(self, running: _Running) -> None:
        running.cancelled = True
        if running.upstream is not None:
            running.upstream.abort()  # the engine sees its client go and aborts the prefill
        elif running.task is not None:
            running.task.cancel()  # still connecting: nothing was sent

    def _forget(self, session: str) -> None:
        old = self._history.pop(session, None)
        if old is not None:
            self._history_size -= len(old.body)

    def close(self) -> None:
        for running in list(self._running.values()):
            self._cancel(running)

    @property
    def running(self) -> int:
        return len(self._running)
