"""The real `openai` client through the gateway to fake vLLM servers, with the real planner's route table."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from gateway_helpers import Stack, free_port, wait_until

pytestmark = pytest.mark.timeout(60)

TOOLS = [
    {
        "type": "function",
        "function": {"name": "search", "description": "Search", "parameters": {"type": "object", "properties": {}}},
    }
]


def _one_engine(make_stack, **options) -> Stack:
    stack = make_stack(engines={"e1": ["alpha"]}, **options)
    stack.register("n1", [{"name": "vllm", "kind": "vllm", "models": ["alpha"], "url": stack.engines["e1"][0].url}])
    stack.heartbeat("n1", [("alpha", "n1-g0", "running")])
    stack.wait_for_table(lambda t: bool(t.running("alpha")), "alpha running")
    return stack


def _client(stack: Stack, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.gateway_v1, api_key="client-key", max_retries=0, **kw)


def test_sync_async_streaming_and_tool_calls(make_stack):
    stack = _one_engine(make_stack)
    state = stack.engines["e1"][1]
    client = _client(stack)
    assert [m.id for m in client.models.list().data] == ["alpha"]

    answer = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "hello there"}])
    assert answer.choices[0].message.content == " ".join(f"w{i}" for i in range(8))
    assert answer.usage is not None and answer.usage.prompt_tokens == 2 and answer.usage.completion_tokens == 8

    text = client.completions.create(model="alpha", prompt="once upon", max_tokens=3)
    assert text.choices[0].text == "w0 w1 w2" and text.usage is not None and text.usage.completion_tokens == 3

    stream = client.chat.completions.create(
        model="alpha",
        messages=[{"role": "user", "content": "stream it"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " w0 w1 w2 w3 w4"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5

    called = client.chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "look it up"}], tools=TOOLS
    )
    assert called.choices[0].finish_reason == "tool_calls"
    assert called.choices[0].message.tool_calls[0].function.name == "search"

    async def async_calls() -> list[str]:
        async with openai.AsyncOpenAI(base_url=stack.gateway_v1, api_key="client-key", max_retries=0) as aclient:
            answers = await asyncio.gather(
                *(
                    aclient.chat.completions.create(model="alpha", messages=[{"role": "user", "content": f"q {i}"}])
                    for i in range(5)
                )
            )
            return [a.choices[0].finish_reason for a in answers]

    assert asyncio.run(async_calls()) == ["stop"] * 5
    # the engine got the client's own body (nothing re-serialized) and every request once
    assert len(state.received) == 9
    assert state.received[0] == {"messages": [{"role": "user", "content": "hello there"}], "model": "alpha"}


def test_api_key_passes_through_and_errors_are_openai_shaped(make_stack):
    stack = _one_engine(make_stack)
    stack.engines["e1"][1].api_key = "engine-key"
    with pytest.raises(openai.AuthenticationError):
        _client(stack).chat.completions.create(model="alpha", messages=[{"role": "user", "content": "x"}])
    good = openai.OpenAI(base_url=stack.gateway_v1, api_key="engine-key", max_retries=0)
    assert good.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "x"}]).choices
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        good.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    bad = httpx.post(stack.gateway_v1 + "/chat/completions", json={"model": "alpha", "messages": []})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "messages" and "non-empty" in bad.json()["error"]["message"]
    garbage = httpx.post(stack.gateway_v1 + "/completions", content=b"{not json")
    assert garbage.status_code == 400 and garbage.json()["error"]["type"] == "invalid_request_error"


def test_a_moved_model_is_followed_within_one_fetch(make_stack):
    stack = make_stack(engines={"e1": ["alpha"], "e2": ["alpha"]})
    for node, engine in (("n1", "e1"), ("n2", "e2")):
        stack.register(node, [{"name": "vllm", "models": ["alpha"], "url": stack.engines[engine][0].url}])
    stack.heartbeat("n1", [("alpha", "n1-g0", "running")])
    stack.heartbeat("n2", [("alpha", "n2-g0", "stopped")])
    stack.wait_for_table(lambda t: [i.node for i in t.running("alpha")] == ["n1"])
    client = _client(stack)
    client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "a"}])
    # the first turn's events give the table a session (a new revision): let that fetch pass first
    wait_until(lambda: any(e["type"] == "turn_end" for e in stack.events()), what="the first turn's events")
    revision = stack.planner_http.get("/v1/routes").json()["revision"]
    stack.wait_for_table(lambda t: t.revision == revision, "the table with the first turn's session")
    fetches = stack.follower.fetches
    stack.heartbeat("n1", [("alpha", "n1-g0", "stopped")])
    stack.heartbeat("n2", [("alpha", "n2-g0", "running")])
    stack.wait_for_table(lambda t: [i.node for i in t.running("alpha")] == ["n2"], "alpha moved to n2")
    # the long-poll answered with the move: one or two fetches (one per heartbeat), no polling interval
    assert stack.follower.fetches - fetches <= 2
    client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "b"}])
    assert len(stack.engines["e1"][1].received) == 1 and len(stack.engines["e2"][1].received) == 1


def test_a_sleeping_model_is_woken_and_the_held_request_answered(make_stack):
    stack = make_stack(engines={"e1": ["alpha"]})
    stack.register("n1", [{"name": "vllm", "models": ["alpha"], "url": stack.engines["e1"][0].url}])
    stack.heartbeat("n1", [("alpha", "n1-g0", "asleep_host")])
    stack.wait_for_table(lambda t: t.known("alpha") and not t.running("alpha"), "alpha asleep")
    answers: list[str | None] = []
    thread = threading.Thread(
        target=lambda: answers.append(
            _client(stack)
            .chat.completions.create(model="alpha", messages=[{"role": "user", "content": "wake up"}])
            .choices[0]
            .finish_reason
        )
    )
    thread.start()
    # the planner hears of the request (the event that makes it replan and wake the model)
    wait_until(lambda: any(e["type"] == "request" and e["model"] == "alpha" for e in stack.events()), what="event")
    time.sleep(0.2)
    assert answers == [] and stack.engines["e1"][1].received == []
    stack.heartbeat("n1", [("alpha", "n1-g0", "running")])  # the node agent woke it
    thread.join(10)
    assert answers == ["stop"]
    metrics = httpx.get(stack.gateway.url + "/metrics").text
    assert 'statebudget_gateway_wake_hold_seconds_count{model="alpha"} 1.0' in metrics


def test_a_model_that_does_not_wake_in_time_is_a_503_with_retry_after(make_stack):
    stack = make_stack(engines={"e1": ["alpha"]}, wake_timeout_seconds=0.3)
    stack.register("n1", [{"name": "vllm", "models": ["alpha"], "url": stack.engines["e1"][0].url}])
    stack.heartbeat("n1", [("alpha", "n1-g0", "stopped")])
    stack.wait_for_table(lambda t: t.known("alpha") and not t.running("alpha"), "alpha stopped")
    with pytest.raises(openai.InternalServerError) as caught:
        _client(stack).chat.completions.create(model="alpha", messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 503
    assert caught.value.response.headers["retry-after"] == "5"
    assert "did not start running" in caught.value.message


def test_the_planner_down_does_not_stop_routing(make_stack):
    stack = _one_engine(make_stack)
    stack.planner.stop()
    wait_until(lambda: not stack.follower.planner_reachable, what="planner seen down")
    client = _client(stack)
    for i in range(3):
        assert client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": str(i)}]).choices
    ready = httpx.get(stack.gateway.url + "/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "degraded"
    assert ready.json()["events_pending"] >= 6  # kept for the planner: a request and a turn end each
    assert "statebudget_gateway_planner_reachable 0.0" in httpx.get(stack.gateway.url + "/metrics").text


def test_a_client_disconnect_mid_stream_cancels_upstream(make_stack):
    stack = _one_engine(make_stack, token_latency_seconds=0.02)
    state = stack.engines["e1"][1]
    body = {"model": "alpha", "messages": [{"role": "user", "content": "long"}], "max_tokens": 500, "stream": True}
    with httpx.stream("POST", stack.gateway_v1 + "/chat/completions", json=body) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data:")
            if seen == 3:
                break
    wait_until(lambda: state.cancelled == 1, what="the engine's stream cancelled")
    assert state.finished == 0 and state.in_flight == 0


def test_a_client_disconnect_before_a_whole_answer_cancels_upstream(make_stack):
    stack = _one_engine(make_stack, token_latency_seconds=0.02)
    state = stack.engines["e1"][1]
    body = {"model": "alpha", "messages": [{"role": "user", "content": "long"}], "max_tokens": 500}  # ~10 s
    short = httpx.Timeout(10.0, read=0.5)  # the client gives up mid-generation and closes its connection
    # the fake, as vLLM, aborts a request whose client left (direct, without the gateway)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.engines["e1"][0].url + "/v1/chat/completions", json=body, timeout=short)
    wait_until(lambda: state.cancelled == 1, what="the engine's direct request cancelled")
    # through the gateway: its client leaving closes the engine's connection, for chat and completions
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.gateway_v1 + "/chat/completions", json=body, timeout=short)
    wait_until(lambda: state.cancelled == 2, what="the engine's chat request cancelled")
    with pytest.raises(httpx.ReadTimeout):
        completion = {"model": "alpha", "prompt": "long", "max_tokens": 500}
        httpx.post(stack.gateway_v1 + "/completions", json=completion, timeout=short)
    wait_until(lambda: state.cancelled == 3, what="the engine's completion cancelled")
    assert state.finished == 0 and state.in_flight == 0 and len(state.received) == 3
    metrics = httpx.get(stack.gateway.url + "/metrics").text
    assert 'statebudget_gateway_requests_total{model="alpha",outcome="cancelled"} 2.0' in metrics
    # the gateway still answers whole requests on the same pool afterwards
    answer = _client(stack).chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert answer.choices[0].message.content == "w0 w1"


def test_no_request_lost_or_sent_twice_when_an_engine_is_killed(make_stack, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    stack = make_stack(engines={"e2": ["alpha"]}, token_latency_seconds=0.01)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..")}
    killed = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fakes.vllm_serving",
            "--port",
            str(port),
            "--model",
            "alpha",
            "--token-latency",
            "0.01",
        ],
        env=env,
    )
    try:
        wait_until(lambda: _healthy(f"http://127.0.0.1:{port}"), what="engine subprocess up")
        stack.register("n1", [{"name": "vllm", "models": ["alpha"], "url": f"http://127.0.0.1:{port}"}])
        stack.register("n2", [{"name": "vllm", "models": ["alpha"], "url": stack.engines["e2"][0].url}])
        stack.heartbeat("n1", [("alpha", "n1-g0", "running")])
        stack.heartbeat("n2", [("alpha", "n2-g0", "running")])
        stack.wait_for_table(lambda t: len(t.running("alpha")) == 2)
        outcomes: dict[str, str] = {}

        def call(i: int) -> None:
            rid = f"r{i}"
            body = {"model": "alpha", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 30}
            headers = {"X-Request-Id": rid, "X-Session-Id": f"s{i}"}
            try:
                r = httpx.post(stack.gateway_v1 + "/chat/completions", json=body, headers=headers, timeout=30)
                outcomes[rid] = "ok" if r.status_code == 200 else f"error {r.status_code} {r.json()['error']['type']}"
            except httpx.HTTPError as error:
                outcomes[rid] = f"transport {error}"

        threads = [threading.Thread(target=call, args=(i,)) for i in range(40)]
        for t in threads[:20]:
            t.start()
        time.sleep(0.15)  # mid-answer: 30 tokens at 10 ms
        killed.send_signal(signal.SIGKILL)
        killed.wait(5)
        for t in threads[20:]:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        if killed.poll() is None:
            killed.kill()
    assert len(outcomes) == 40
    survivors = stack.engines["e2"][1].request_ids
    assert len(survivors) == len(set(survivors)), "a request reached the surviving engine twice"
    failed = {rid for rid, o in outcomes.items() if o != "ok"}
    # a request cut off on the killed engine is answered with an error, never resent to the other
    assert all(outcomes[rid].startswith("error 502 upstream_error") for rid in failed), outcomes
    assert not failed & set(survivors)
    # the ones sent after the kill found the dead engine refusing connections and went to the other
    assert all(outcomes[f"r{i}"] == "ok" for i in range(20, 40)), outcomes


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_planner_receives_the_events_a_hand_instrumented_agent_sends(make_stack):
    from clients.sdk import events as ev

    stack = make_stack(engines={"e1": ["alpha"], "e2": ["beta"]}, session_idle_seconds=1.0)
    stack.register("n1", [{"name": "vllm", "models": ["alpha"], "url": stack.engines["e1"][0].url}])
    stack.register("n2", [{"name": "vllm", "models": ["beta"], "url": stack.engines["e2"][0].url}])
    stack.heartbeat("n1", [("alpha", "n1-g0", "running")])
    stack.heartbeat("n2", [("beta", "n2-g0", "running")])
    stack.wait_for_table(lambda t: bool(t.running("alpha")) and bool(t.running("beta")))
    client = _client(stack, default_headers={"X-Session-Id": "agent-1"})
    history = [{"role": "system", "content": "you are a coding agent"}, {"role": "user", "content": "fix the bug"}]

    def chars(messages):  # the hand-instrumented agent's own estimate: ~4 characters a token
        return sum(len(m.get("content") or "") for m in messages) // 4

    expected = []
    # turn 1: the planner model calls a tool
    first = client.chat.completions.create(model="alpha", messages=history, tools=TOOLS)
    expected += [
        ev.request("x", session="agent-1", model="alpha", input_tokens=chars(history)),
        ev.turn_end("x", session="agent-1", output_tokens=first.usage.completion_tokens),
        ev.tool_call_start("x", session="agent-1", tool="search"),
    ]
    call = first.choices[0].message.tool_calls[0]
    history += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "found it in parser.py"},
    ]
    # turn 2: the tool's result goes back (streamed, with usage)
    stream = client.chat.completions.create(
        model="alpha", messages=history, tools=TOOLS, stream=True, stream_options={"include_usage": True}
    )
    usages = [c.usage for c in stream if c.usage]  # read to the end: the turn ends with the stream
    usage = usages[-1]
    expected += [
        ev.tool_call_end("x", session="agent-1", tool="search"),
        ev.request("x", session="agent-1", model="alpha", input_tokens=chars(history)),
        ev.turn_end("x", session="agent-1", output_tokens=usage.completion_tokens),
    ]
    history += [{"role": "assistant", "content": "patched"}, {"role": "user", "content": "now review it"}]
    # turn 3: a hand-off to the reviewer model
    third = client.chat.completions.create(model="beta", messages=history)
    expected += [
        ev.request("x", session="agent-1", model="beta", input_tokens=chars(history)),
        ev.turn_end("x", session="agent-1", output_tokens=third.usage.completion_tokens),
        ev.session_end("x", session="agent-1"),
    ]
    wait_until(lambda: any(e["type"] == "session_end" for e in stack.events()), what="session_end")
    received = stack.events()
    assert len({e["id"] for e in received}) == len(received)
    assert [e["at"] for e in received] == sorted(e["at"] for e in received)
    assert [{k: v for k, v in e.items() if k not in ("id", "at")} for e in received] == [
        {k: v for k, v in e.items() if k != "id"} for e in expected
    ]
    session = httpx.get(stack.planner.url + "/v1/sessions/agent-1", headers={"Authorization": "Bearer op-token"})
    assert session.status_code in (200, 404), session.text  # an ended session may already be purged
    if session.status_code == 200:
        assert session.json()["tool_calls"] == 1
    assert json.loads(stack.planner_events.bodies[0])["events"][0]["type"] == "request"
