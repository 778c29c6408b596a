"""Pins: the planner's pin directives carried out in LMCache, so that the host copy of a kept session's KV
outlives LMCache's LRU eviction.

LMCache's controller addresses KV by token ids only: its `POST /pin {instance_id, location, tokens}` requires
all three (lmcache/v1/api_server/__main__.py `PinRequest`), hands the pin to every worker of the instance
(lmcache/v1/cache_controller/executor.py `pin`), and each pins the chunks of those tokens it holds at that
location (lmcache/v1/cache_controller/worker.py: a `lookup(..., pin=True)`). The gateway holds the
conversations, so it is the one that can name a session's tokens: it sends the session's last request, as it
sent it to the engine, to that engine's `POST /tokenize` (the same messages, tools and chat-template options,
so the engine renders the same prompt), then the token ids it answers to the controller's `/pin`. Each engine
takes its own fields (`tokenize_request`, by the route table's `engine` kind):

- vLLM: a chat body as vllm/entrypoints/serve/tokenize/protocol.py `TokenizeChatRequest` takes it, or a
  completion's `{model, prompt, add_special_tokens}`;
- SGLang: `POST /tokenize` (and `/v1/tokenize`, python/sglang/srt/entrypoints/http_server.py) takes one
  `TokenizeRequest` (python/sglang/srt/entrypoints/openai/protocol.py): exactly one of `prompt` (a string or a
  list of them) and `messages`, with the chat fields `tools`, `tool_choice`, `reasoning_effort`,
  `continue_final_message` and `chat_template_kwargs` beside them (the messages are rendered as its chat
  request would be, `to_chat_completion_request`), and `add_special_tokens` (default true) for a prompt. An
  older SGLang takes a `prompt` only (serving_tokenize.py of sgl-project/sglang 0351c1f): a chat pin there
  answers 400 and is counted `tokenize_failed`.

Both answer `{tokens, count, max_model_len}`. The token ids are kept with the session's history: a renewal of an
unchanged history pins them again without a second `/tokenize`.

A pin keeps chunks in LMCache's own tiers (host RAM, disk); it frees nothing on the GPU and keeps nothing on
it. There is no `/unpin` in the controller's HTTP API: a pin lapses by itself once it is older than LMCache's
`pin_timeout_sec` (300 s by default, lmcache/v1/config.py; lmcache/v1/pin_monitor.py forces the pin count to
0), and pinning again restarts that countdown. So the gateway pins a kept session again every
`refresh_seconds` while its directive stands (and whenever the session's conversation grew), and lets the
pin lapse when the directive goes.

None of this is on a request's path: the request path only records the session's last request (a reference
to bytes it already holds); the calls run in `concurrency` background workers on a client of their own (they
never take a connection of the engines' request pool), and a failure is counted and logged, without the
prompt, and tried again after `retry_seconds`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import httpx

from clients.gateway.metrics import GatewayMetrics
from clients.gateway.parsing import Endpoint
from clients.gateway.table import RouteTable
from planner_service.wire.enums import EngineKind
from planner_service.wire.routes import PinDirective

log = logging.getLogger("statebudget.gateway.pins")

# what a tokenize call carries of the client's headers: its credentials for the engine
_KEEP_HEADERS = frozenset({b"authorization", b"api-key"})
# the chat request's fields that shape the rendered prompt, which `TokenizeChatRequest` takes under the same
# names (vllm/entrypoints/openai/chat_completion/protocol.py `ChatCompletionRequest`,
# vllm/entrypoints/serve/tokenize/protocol.py `TokenizeChatRequest`)
_CHAT_FIELDS = (
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "mm_processor_kwargs",
)
# chat fields the chat request hands to the template as keyword arguments (its `build_chat_params`), which the
# tokenize request has no field for: they go into its `chat_template_kwargs`
_TEMPLATE_KWARGS = ("documents", "reasoning_effort")
# the SGLang `TokenizeRequest` fields beside `messages` (python/sglang/srt/entrypoints/openai/protocol.py)
_SGLANG_CHAT_FIELDS = ("tools", "tool_choice", "reasoning_effort", "continue_final_message", "chat_template_kwargs")
# outcomes that a retry may change (LMCache stores a prompt's chunks as the engine computes them, so an empty
# pin may find them later); the others wait for the session's next request or a new directive
_RETRIED = frozenset({"tokenize_failed", "controller_failed", "empty"})


@dataclass(slots=True)
class _History:
    model: str
    endpoint: Endpoint
    body: bytes
    headers: list[tuple[bytes, bytes]]
    version: int
    # the token ids an engine's /tokenize answered for this history, and that engine's kind: the same model's
    # tokenizer gives the same ids for the same request (kept compact, 8 bytes a token, counted in the budget)
    tokens: array[int] | None = None
    tokens_engine: EngineKind | None = None

    @property
    def size(self) -> int:
        return len(self.body) + (8 * len(self.tokens) if self.tokens is not None else 0)


@dataclass(slots=True)
class _Attempt:
    """The last pin attempt for a session: on which instance, of which version of its history, when, and how
    it ended."""

    instance: str
    version: int
    at: float
    outcome: str


def tokenize_request(
    endpoint: Endpoint, body: bytes, model: str, engine: EngineKind | None = None
) -> dict[str, Any] | list[int] | None:
    """What to send the engine's `/tokenize` for the prompt of the client's request: a chat or completion
    tokenize body in the fields of the engine's kind (module doc; vLLM's where the kind is not given), or the
    token ids themselves where the request gave them (a completion's `prompt` of ids); None where the request
    is not one sequence (a batch of prompts)."""
    data = json.loads(body)
    if endpoint == "chat" and engine is EngineKind.SGLANG:
        out: dict[str, Any] = {"model": model, "messages": data["messages"]}
        out.update((name, data[name]) for name in _SGLANG_CHAT_FIELDS if data.get(name) is not None)
        return out
    if endpoint == "chat":
        out = {"model": model, "messages": data["messages"]}
        for name in _CHAT_FIELDS:
            if data.get(name) is not None:
                out[name] = data[name]
        extra = {name: data[name] for name in _TEMPLATE_KWARGS if data.get(name) is not None}
        if extra or data.get("chat_template_kwargs"):
            out["chat_template_kwargs"] = {**(data.get("chat_template_kwargs") or {}), **extra}
        return out
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        out = {"model": model, "prompt": prompt}
        if data.get("add_special_tokens") is not None:
            out["add_special_tokens"] = data["add_special_tokens"]
        return out
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    return None


class Pins:
    def __init__(
        self,
        metrics: GatewayMetrics,
        *,
        controller_url: str | None,
        instance_ids: dict[str, str],
        location: str,
        refresh_seconds: float,
        retry_seconds: float,
        concurrency: int,
        timeout_seconds: float,
        history_bytes: int,
    ) -> None:
        self.metrics = metrics
        self.controller_url = controller_url.rstrip("/") if controller_url else None
        self.instance_ids = instance_ids
        self.location = location
        self.refresh_seconds = refresh_seconds
        self.retry_seconds = retry_seconds
        self.concurrency = concurrency
        self.timeout_seconds = timeout_seconds
        self.history_bytes = history_bytes
        self.table = RouteTable.empty()
        self.last_error: str | None = None
        self._history: OrderedDict[str, _History] = OrderedDict()  # session -> its last request answered
        self._history_size = 0
        self._version = 0
        self._wanted: dict[str, PinDirective] = {}  # session -> its directive in the current table
        self._attempts: dict[str, _Attempt] = {}
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._kept: set[str] = set()  # sessions whose directive stands and whose last pin the controller took
        metrics.pins_enabled.set(1 if self.enabled else 0)

    @property
    def enabled(self) -> bool:
        return self.controller_url is not None

    @property
    def kept(self) -> int:
        """Sessions whose directive stands and whose last pin the controller took."""
        return len(self._kept)

    @property
    def queued(self) -> int:
        return len(self._queued)

    # -- what the request path and the route follower tell it ----------------------------------------------------

    def remember(
        self, session: str, model: str, endpoint: Endpoint, body: bytes, headers: list[tuple[bytes, bytes]]
    ) -> None:
        """The session's request the engine answered: the conversation a pin names (its prompt is what the
        engine computed, and LMCache stored, KV for)."""
        if not self.enabled:
            return
        old = self._history.pop(session, None)
        if old is not None:
            self._history_size -= old.size
        if len(body) > self.history_bytes:
            return
        self._version += 1
        kept = [(k, v) for k, v in headers if k in _KEEP_HEADERS]
        self._history[session] = _History(model, endpoint, body, kept, self._version)
        self._history_size += len(body)
        self._trim()
        if session in self._wanted:
            self._consider(session, asyncio.get_running_loop().time())

    def _trim(self) -> None:
        """Drop the oldest histories until what is kept fits the budget."""
        while self._history_size > self.history_bytes and self._history:
            _, oldest = self._history.popitem(last=False)
            self._history_size -= oldest.size

    def on_table(self, table: RouteTable) -> None:
        self.table = table
        if not self.enabled:
            return
        self._wanted = {d.session: d for d in table.pins}
        for session, attempt in list(self._attempts.items()):
            directive = self._wanted.get(session)
            if directive is None:
                del self._attempts[session]  # its pin lapses in LMCache by itself: there is nothing to undo
            if directive is None or directive.instance != attempt.instance:
                self._kept.discard(session)
        self.metrics.pinned_sessions.set(len(self._kept))
        now = asyncio.get_running_loop().time()
        for session in self._wanted:
            self._consider(session, now)

    # -- carrying directives out ----------------------------------------------------------------------------------

    def _due(self, session: str, now: float) -> bool:
        directive = self._wanted.get(session)
        if directive is None:
            return False
        attempt = self._attempts.get(session)
        if attempt is None or attempt.instance != directive.instance:
            return True
        history = self._history.get(session)
        if history is not None and history.version != attempt.version:
            return True  # the conversation grew (or came back): pin what the engine holds now
        if attempt.outcome == "pinned":
            return now - attempt.at >= self.refresh_seconds
        return attempt.outcome in _RETRIED and now - attempt.at >= self.retry_seconds

    def _consider(self, session: str, now: float) -> None:
        if session not in self._queued and self._due(session, now):
            self._queued.add(session)
            self._queue.put_nowait(session)

    async def run(self) -> None:
        """The workers, and a sweep that queues the pins due again (refresh, retry)."""
        if not self.enabled:
            return
        async with httpx.AsyncClient(timeout=self.timeout_seconds) as http:
            workers = [asyncio.create_task(self._work(http)) for _ in range(self.concurrency)]
            try:
                while True:
                    await asyncio.sleep(min(self.refresh_seconds, self.retry_seconds) / 4)
                    now = asyncio.get_running_loop().time()
                    for session in list(self._wanted):
                        self._consider(session, now)
            finally:
                for worker in workers:
                    worker.cancel()
                await asyncio.gather(*workers, return_exceptions=True)

    async def _work(self, http: httpx.AsyncClient) -> None:
        while True:
            session = await self._queue.get()
            try:
                await self._pin(http, session)
            except Exception:  # a bug must not stop the worker (the attempt was counted): log it, go on
                log.exception("pin of a session failed unexpectedly")
            finally:
                self._queued.discard(session)
            # a request of the session answered meanwhile lengthened the conversation: pin that at once
            self._consider(session, asyncio.get_running_loop().time())

    async def _pin(self, http: httpx.AsyncClient, session: str) -> None:
        directive = self._wanted.get(session)
        if directive is None:
            return
        found = self.table.find(directive.instance)
        instance = self.table.routable(found[0], directive.instance) if found is not None else None
        if found is None or instance is None or instance.url is None:
            return  # not running, or no URL to tokenize on: the planner directs only routable holders
        model = found[0]
        history = self._history.get(session)
        outcome = "no_history"
        version = history.version if history is not None else 0
        try:
            if history is None or history.model != model:
                return
            if history.tokens is not None and history.tokens_engine == instance.engine:
                tokens = history.tokens.tolist()  # tokenized before, unchanged since: no second /tokenize
            else:
                try:
                    request = tokenize_request(history.endpoint, history.body, model, instance.engine)
                except (ValueError, KeyError, TypeError):  # parse_request accepted the body: not expected
                    request = None
                if request is None:
                    outcome = "skipped"
                    return
                if isinstance(request, list):
                    tokens = request
                else:
                    outcome = "tokenize_failed"
                    answered = await self._tokenize(http, instance.url, history.headers, request, directive.instance)
                    if answered is None:
                        return
                    tokens = answered
                    self._keep_tokens(session, history, tokens, instance.engine)
            outcome = "controller_failed"
            lmcache_id = self.instance_ids.get(directive.instance) or f"{instance.node}-{model}"
            pinned = await self._send_pin(http, lmcache_id, tokens, directive.instance)
            if pinned is not None:
                outcome = "pinned" if pinned > 0 else "empty"
        except asyncio.CancelledError:
            outcome = ""  # the gateway stops: not an outcome of the pin
            raise
        finally:
            if outcome:
                self.metrics.pins.labels(model, outcome).inc()
            current = self._wanted.get(session)
            if outcome and current is not None and current.instance == directive.instance:
                at = asyncio.get_running_loop().time()
                self._attempts[session] = _Attempt(directive.instance, version, at, outcome)
                if outcome == "pinned":
                    self._kept.add(session)
                else:
                    self._kept.discard(session)  # what it pinned before lapses unless a later pin takes
                self.metrics.pinned_sessions.set(len(self._kept))

    def _keep_tokens(self, session: str, history: _History, tokens: list[int], engine: EngineKind | None) -> None:
        """Keep the ids /tokenize answered with the history they name, while that is still the session's."""
        if self._history.get(session) is not history:
            return  # replaced or dropped meanwhile: its successor is tokenized on its own
        try:
            ids = array("q", tokens)
        except OverflowError:  # not 64-bit ids: not worth keeping
            return
        self._history_size += 8 * len(ids) - (8 * len(history.tokens) if history.tokens is not None else 0)
        history.tokens, history.tokens_engine = ids, engine
        self._trim()

    async def _tokenize(
        self, http: httpx.AsyncClient, url: str, headers: list[tuple[bytes, bytes]], body: dict[str, Any], iid: str
    ) -> list[int] | None:
        try:
            response = await http.post(
                url.rstrip("/") + "/tokenize",
                json=body,
                headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers],
            )
        except httpx.HTTPError as error:
            log.info("pin on %s: /tokenize failed: %s", iid, type(error).__name__)
            return None
        if response.status_code != 200:
            log.info("pin on %s: /tokenize answered %d", iid, response.status_code)
            return None
        try:
            tokens = response.json()["tokens"]
        except (ValueError, KeyError, TypeError):
            tokens = None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            log.info("pin on %s: /tokenize answered no token ids", iid)
            return None
        return tokens

    async def _send_pin(self, http: httpx.AsyncClient, lmcache_id: str, tokens: list[int], iid: str) -> int | None:
        """The tokens the controller pinned (its answer's `num_tokens`: those of the chunks it found at the
        location, docs/source/kv_cache_management/pin.rst); None where it refused or could not be reached."""
        assert self.controller_url is not None  # enabled
        body = {"instance_id": lmcache_id, "location": self.location, "tokens": tokens}
        pinned: int | None = None
        try:
            response = await http.post(self.controller_url + "/pin", json=body)
            error = None if response.status_code == 200 else f"the controller answered {response.status_code}"
            if error is None:
                data = response.json()
                pinned = data.get("num_tokens") if isinstance(data, dict) else None
                if not isinstance(pinned, int):
                    error, pinned = "the controller answered no num_tokens", None
        except httpx.HTTPError as failure:
            error = f"the controller is unreachable ({type(failure).__name__})"
        except ValueError:  # not JSON
            error = "the controller answered no num_tokens"
        if error is None:
            if self.last_error is not None:
                log.info("LMCache controller pins again")
            self.last_error = None
            return pinned
        # a controller that is down fails every pin: one warning when it starts, the rest at debug
        (log.warning if self.last_error is None else log.debug)(
            "pin of a session on %s (LMCache instance %s) failed: %s", iid, lmcache_id, error
        )
        self.last_error = error
        return None

    def state(self) -> dict[str, Any]:
        """The feature's state for /readyz: off (no controller configured) is a setting, not a fault."""
        if not self.enabled:
            return {"state": "off"}
        return {
            "state": "on",
            "kept": len(self._kept),
            "queued": len(self._queued),
            "last_error": self.last_error,
        }
