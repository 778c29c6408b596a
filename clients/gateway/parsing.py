"""What routing and events need from a request and its answer, read without re-serializing either.

A request body is parsed once for `model`, `user`, `stream` and the first messages; the bytes sent upstream
are the client's own. An answer is scanned for the engine's `usage`, the last `finish_reason` and the names
of tool calls: in a stream only the chunks that can carry them are decoded (vLLM writes `usage: null` and
`finish_reason: null` on every other chunk, vllm/entrypoints/openai/protocol.py `ChatCompletionStreamResponse`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from clients.gateway.errors import bad_request

Endpoint = Literal["chat", "completions"]

# OpenAI's rule of thumb, about 4 characters of English text per token (platform.openai.com/tokenizer): the
# request event's estimate only; the turn's real counts come from the engine's usage
CHARS_PER_TOKEN = 4
# the session hash reads this many leading messages: the system prompt and the task, stable across turns
SESSION_HASH_MESSAGES = 2
MAX_HEADER_SESSION_CHARS = 200


@dataclass(frozen=True, slots=True)
class RequestFacts:
    model: str
    stream: bool
    user: str | None
    session: str
    session_source: Literal["header", "user", "hash"]
    input_tokens: int


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        return sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return 0


def parse_request(body: bytes, endpoint: Endpoint, session_header: str | None) -> RequestFacts:
    """The routing facts of an OpenAI request body; a 400 naming the field where one is missing or wrong."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise bad_request(f"the body is not JSON: {error}") from error
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model: a model id (string) is required", "model")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("stream: must be true or false", "stream")
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("user: must be a string", "user")
    if endpoint == "chat":
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("messages: a non-empty list is required", "messages")
        chars = sum(_text_chars(m.get("content")) for m in messages if isinstance(m, dict))
        head: Any = messages[:SESSION_HASH_MESSAGES]
    else:
        prompt = data.get("prompt")
        if not isinstance(prompt, str | list):
            raise bad_request("prompt: a string or a list is required", "prompt")
        chars = len(prompt) if isinstance(prompt, str) else sum(len(p) for p in prompt if isinstance(p, str))
        head = prompt[:1000] if isinstance(prompt, str) else prompt[:1]
    if session_header:
        session, source = session_header[:MAX_HEADER_SESSION_CHARS], "header"
    elif user:
        session, source = user[:MAX_HEADER_SESSION_CHARS], "user"
    else:
        digest = hashlib.sha256(json.dumps([model, head], sort_keys=True).encode()).hexdigest()[:24]
        session, source = f"h-{digest}", "hash"
    return RequestFacts(
        model=model,
        stream=stream,
        user=user,
        session=session,
        session_source=source,  # type: ignore[arg-type]  # one of the three literals above
        input_tokens=max(1, chars // CHARS_PER_TOKEN) if chars else 0,
    )


@dataclass(slots=True)
class AnswerFacts:
    """What an engine's answer said about the turn: usage, why it stopped, the tools it called."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    tools: list[str] = field(default_factory=list)
    chunks: int = 0  # streamed chunks with choices: the output-token count where the engine sent no usage

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    def read(self, data: Any) -> None:
        if not isinstance(data, dict):
            return
        usage = data.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
        for choice in data.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            message = choice.get("message") or choice.get("delta") or {}
            for call in message.get("tool_calls") or [] if isinstance(message, dict) else []:
                name = (call.get("function") or {}).get("name") if isinstance(call, dict) else None
                if name:
                    self.tools.append(name)


def read_answer(body: bytes) -> AnswerFacts:
    facts = AnswerFacts()
    try:
        facts.read(json.loads(body))
    except (ValueError, UnicodeDecodeError):
        pass  # an engine's non-JSON answer is passed through as it is; it reports nothing
    return facts


_MAYBE_FACTS = (b'"usage":{', b'"usage": {', b'"name"', b'"finish_reason":"', b'"finish_reason": "')


_CHOICE_MARKERS = (b'"choices":[{', b'"choices": [{')


class StreamScanner:
    """Feeds on an SSE stream's bytes as they pass and keeps its `AnswerFacts`; never holds the stream back.

    Most pieces carry only content deltas: those are counted by a byte search, and only the lines of a piece
    that holds a marker of usage, a finish reason or a tool name are decoded."""

    def __init__(self) -> None:
        self.facts = AnswerFacts()
        self._rest = b""

    def feed(self, chunk: bytes) -> None:
        data = self._rest + chunk if self._rest else chunk
        cut = data.rfind(b"\n") + 1  # complete lines only; a line cut between two reads waits for its end
        complete, self._rest = data[:cut], data[cut:]
        if not complete:
            return
        self.facts.chunks += sum(complete.count(marker) for marker in _CHOICE_MARKERS)
        if not any(marker in complete for marker in _MAYBE_FACTS):
            return
        for line in complete.split(b"\n"):
            if not line.startswith(b"data:") or not any(marker in line for marker in _MAYBE_FACTS):
                continue
            try:
                self.facts.read(json.loads(line[5:]))
            except ValueError:
                continue
