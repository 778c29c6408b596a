"""The gateway's pure parts: request facts, answer scanning, the choice of an instance, session events."""

from __future__ import annotations

import json

import pytest

from clients.gateway.errors import GatewayError
from clients.gateway.events import SessionEvents
from clients.gateway.parsing import StreamScanner, parse_request, read_answer
from clients.gateway.pins import tokenize_request
from clients.gateway.table import RouteTable
from clients.gateway.warmups import warmup_body
from planner_service.wire.enums import EngineKind
from planner_service.wire.routes import Directives, RoutesOut


def _body(**fields) -> bytes:
    return json.dumps({"model": "alpha", "messages": [{"role": "user", "content": "abcd" * 10}], **fields}).encode()


def test_session_from_header_then_user_then_a_hash_of_the_first_messages():
    assert parse_request(_body(user="u1"), "chat", "s-head").session == "s-head"
    assert parse_request(_body(user="u1"), "chat", None).session == "u1"
    hashed = parse_request(_body(), "chat", None)
    assert hashed.session_source == "hash" and hashed.session.startswith("h-")
    # a later turn adds messages after the first two: the same session
    longer = {
        "model": "alpha",
        "messages": [{"role": "user", "content": "abcd" * 10}, {"role": "assistant", "content": "x"}],
    }
    again = {**longer, "messages": [*longer["messages"], {"role": "user", "content": "more"}]}
    assert (
        parse_request(json.dumps(longer).encode(), "chat", None).session
        == parse_request(json.dumps(again).encode(), "chat", None).session
    )
    assert hashed.input_tokens == 10  # 40 characters at ~4 a token


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"[1]", None),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), "model"),
        (json.dumps({"model": "a", "messages": []}).encode(), "messages"),
        (json.dumps({"model": "a", "messages": [{}], "stream": "yes"}).encode(), "stream"),
        (json.dumps({"model": "a", "messages": [{}], "user": 3}).encode(), "user"),
    ],
)
def test_bad_requests_name_their_field(body, param):
    with pytest.raises(GatewayError) as caught:
        parse_request(body, "chat", None)
    assert caught.value.status == 400 and caught.value.param == param
    assert json.loads(caught.value.body())["error"]["type"] == "invalid_request_error"


def test_completions_need_a_prompt():
    with pytest.raises(GatewayError, match="prompt"):
        parse_request(json.dumps({"model": "a"}).encode(), "completions", None)
    assert (
        parse_request(json.dumps({"model": "a", "prompt": "12345678"}).encode(), "completions", None).input_tokens == 2
    )


def test_the_stream_scanner_finds_usage_finish_reason_and_tools_across_split_chunks():
    events = [
        {
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            "usage": None,
        },
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "grep"}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}], "usage": None},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}},
    ]
    wire = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    scanner = StreamScanner()
    for i in range(0, len(wire), 17):  # arbitrary TCP segment boundaries
        scanner.feed(wire[i : i + 17])
    facts = scanner.facts
    assert (facts.finish_reason, facts.tools, facts.completion_tokens, facts.output_tokens) == (
        "tool_calls",
        ["grep"],
        3,
        3,
    )


def test_without_usage_the_chunks_count_as_output_tokens():
    wire = b"".join(
        b'data: {"choices":[{"index":0,"delta":{"content":"w"},"finish_reason":null}]}\n\n' for _ in range(5)
    )
    scanner = StreamScanner()
    scanner.feed(wire)
    assert scanner.facts.output_tokens == 5 and scanner.facts.completion_tokens is None
    assert read_answer(b"not json").output_tokens == 0


def _table(sessions=()) -> RouteTable:
    instances = [
        {"id": f"i{k}", "node": f"n{k}", "gpus": [f"g{k}"], "state": state, "url": f"http://e{k}"}
        for k, state in enumerate(["running", "running", "asleep"])
    ]
    return RouteTable(
        RoutesOut(
            epoch=3,
            revision="r",
            models=[{"model": "alpha", "instances": instances}],
            sessions=[{"session": s, "model": "alpha", "instance": i} for s, i in sessions],
            directives=Directives(),
        )
    )


def test_the_kv_holder_wins_and_other_sessions_stay_on_one_instance():
    table = _table(sessions=[("s1", "i1"), ("s2", "i2")])
    assert table.choose("alpha", "s1").instance.id == "i1" and table.choose("alpha", "s1").kv_holder
    # s2's holder is asleep: a running instance instead, and the same one every time
    picks = {table.choose("alpha", "s2").instance.id for _ in range(5)}
    assert len(picks) == 1 and not table.choose("alpha", "s2").kv_holder
    assert table.choose("alpha", "s1", exclude=frozenset({"i1"})).instance.id == "i0"
    assert table.choose("alpha", "s1", exclude=frozenset({"i0", "i1"})) is None
    assert table.choose("beta", "s1") is None and not table.known("beta")


class _Sink:
    def __init__(self) -> None:
        self.events: list[dict] = []

    def emit(self, event: dict) -> None:
        self.events.append(event)


def test_idle_sessions_end_once():
    now = [1000.0]
    sink = _Sink()
    sessions = SessionEvents(sink, idle_seconds=10, clock=lambda: now[0])  # type: ignore[arg-type]  # a test sink, not a Planner client
    sessions.on_request(parse_request(_body(), "chat", "s1"))
    now[0] += 5
    assert sessions.end_idle() == 0
    now[0] += 6
    assert sessions.end_idle() == 1 and sessions.end_idle() == 0
    assert [e["type"] for e in sink.events] == ["request", "session_end"]


class _Dropped:
    def __init__(self) -> None:
        self.count = 0

    def inc(self) -> None:
        self.count += 1


def test_an_event_the_wire_model_refuses_is_dropped_and_counted_not_queued():
    """Queued, the planner would refuse the whole batch at every retry and hold every later event behind it."""
    sink = _Sink()
    sink.metrics = type("M", (), {"events_dropped": _Dropped()})()  # type: ignore[attr-defined]  # only the counter the tracker uses
    sessions = SessionEvents(sink, idle_seconds=10, clock=lambda: 1000.0)  # type: ignore[arg-type]  # a test sink, not a Planner client
    sessions.on_request(parse_request(_body(user="u" * 201), "chat", "s0"))  # a user past the wire's 200 characters
    sessions.on_request(parse_request(_body(user="u1"), "chat", "s1"))
    assert [(e["type"], e["session"], e["user"]) for e in sink.events] == [("request", "s1", "u1")]
    assert sink.metrics.events_dropped.count == 1  # type: ignore[attr-defined]  # the test double counts


def test_a_pooled_connection_closed_under_the_pool_costs_a_fresh_one_not_the_request():
    """An engine killed between two requests: its idle connection may be closed at the transport before the
    pool hears of it (uvloop then refuses the write). Nothing went out, so the request goes on a new connection."""
    import asyncio
    import contextlib

    import uvloop

    from clients.gateway.upstream import UpstreamPool

    requests: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError):
            while True:
                requests.append(await reader.readuntil(b"\r\n\r\n") + await reader.readexactly(2))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()

    class Refusing:  # a uvloop transport whose handle closed before the protocol heard: it refuses writes
        def __init__(self, transport: asyncio.Transport) -> None:
            self.transport = transport

        def is_closing(self) -> bool:
            return False

        def write(self, data: bytes) -> None:
            raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

        def close(self) -> None:
            self.transport.close()

    async def main() -> tuple[list[bytes], int]:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        pool = UpstreamPool(connect_timeout_seconds=2, read_timeout_seconds=2, max_idle=4)
        bodies: list[bytes] = []
        for step in range(3):
            if step == 1:  # closing: the pool must not take it
                (idle,) = pool._idle[pool.origin(url)]
                assert idle.transport is not None
                idle.transport.close()
            if step == 2:  # closed under the pool, unnoticed: the write is refused as uvloop refuses it
                (idle,) = pool._idle[pool.origin(url)]
                assert idle.transport is not None
                idle.transport = Refusing(idle.transport)  # type: ignore[assignment]  # a stand-in transport
            response = await pool.post(url, b"/v1/chat/completions", [], b"{}")
            await response.head()
            bodies.append(await response.read())
            response.release()
        pool.close()
        server.close()
        return bodies, pool.connections_opened

    bodies, opened = uvloop.run(main())
    assert bodies == [b"ok", b"ok", b"ok"] and opened == 3 and len(requests) == 3


def test_a_pinned_session_goes_to_its_pinned_instance_where_no_holder_runs():
    base = _table(sessions=[("s1", "i2")])
    pinned = RouteTable(
        base.routes.model_copy(
            update={"directives": Directives(decided=True, pins=[{"session": "s3", "instance": "i1", "tokens": 10}])}
        )
    )
    choice = pinned.choose("alpha", "s3")
    assert choice is not None and choice.instance.id == "i1" and not choice.kv_holder
    # without the pin s3 hashes to an instance of its own; the pin wins over that in every case
    assert {pinned.choose("alpha", "s3").instance.id for _ in range(3)} == {"i1"}
    assert pinned.choose("alpha", "s3", exclude=frozenset({"i1"})).instance.id == "i0"
    assert pinned.routable("alpha", "i1") is not None and pinned.routable("alpha", "i2") is None  # i2 is asleep
    assert pinned.routable("beta", "i1") is None


def test_a_warmup_body_is_the_history_as_one_token_to_the_predicted_model():
    body = json.dumps(
        {
            "model": "alpha",
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_completion_tokens": 500,
            "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "temperature": 0.2,
        }
    ).encode()
    assert json.loads(warmup_body("chat", body, "beta")) == {
        "model": "beta",
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "temperature": 0.2,
        "max_tokens": 1,
    }
    text = json.loads(warmup_body("completions", b'{"model": "a", "prompt": "p", "n": 3}', "b"))
    assert text == {"model": "b", "prompt": "p", "max_tokens": 1}


def test_the_tokenize_request_renders_the_prompt_the_engine_was_sent():
    tools = [{"type": "function", "function": {"name": "grep"}}]
    chat = _body(tools=tools, stream=True, max_tokens=9, tool_choice="auto", documents=[{"text": "d"}])
    # what shapes the chat template's prompt, nothing of the sampling; `documents` reach the template as a keyword
    assert tokenize_request("chat", chat, "alpha") == {
        "model": "alpha",
        "messages": [{"role": "user", "content": "abcd" * 10}],
        "tools": tools,
        "chat_template_kwargs": {"documents": [{"text": "d"}]},
    }
    completion = json.dumps({"model": "a", "prompt": ["one prompt"], "add_special_tokens": False}).encode()
    assert tokenize_request("completions", completion, "alpha") == {
        "model": "alpha",
        "prompt": "one prompt",
        "add_special_tokens": False,
    }
    ids = json.dumps({"model": "a", "prompt": [1, 2, 3]}).encode()
    assert tokenize_request("completions", ids, "alpha") == [1, 2, 3]  # token ids already: no call needed
    one = json.dumps({"model": "a", "prompt": [[7]]}).encode()
    assert tokenize_request("completions", one, "alpha") == [7]
    batch = json.dumps({"model": "a", "prompt": ["one", "two"]}).encode()
    assert tokenize_request("completions", batch, "alpha") is None  # not one sequence: not pinned


def test_the_tokenize_request_takes_sglang_s_fields_on_an_sglang_engine():
    """SGLang's `TokenizeRequest` takes `messages` with `tools`, `tool_choice`, `reasoning_effort`,
    `continue_final_message` and `chat_template_kwargs` beside them (python/sglang/srt/entrypoints/openai/
    protocol.py); vLLM's chat fields it has no field for stay out, and a completion's body is the same."""
    tools = [{"type": "function", "function": {"name": "grep"}}]
    chat = _body(tools=tools, tool_choice="auto", reasoning_effort="low", add_generation_prompt=True, max_tokens=9)
    assert tokenize_request("chat", chat, "alpha", EngineKind.SGLANG) == {
        "model": "alpha",
        "messages": [{"role": "user", "content": "abcd" * 10}],
        "tools": tools,
        "tool_choice": "auto",
        "reasoning_effort": "low",
    }
    completion = json.dumps({"model": "a", "prompt": "p", "add_special_tokens": False}).encode()
    assert tokenize_request("completions", completion, "alpha", EngineKind.SGLANG) == tokenize_request(
        "completions", completion, "alpha", EngineKind.VLLM
    )
