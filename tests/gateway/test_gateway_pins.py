"""The gateway carries out the planner's pin directives in LMCache, against contract fakes of vLLM's OpenAI
server, of SGLang's `/tokenize` and of LMCache's controller: the session's last request goes to the engine's
`/tokenize` in that engine's fields, once per version of the conversation, the token ids it answers to the
controller's `/pin` with the engine's LMCache instance id; nothing without a controller; failures counted and
without effect on requests; and requests never wait for pins.

The planner is a stand-in serving the route table each test scripts (the planner's own pin rule:
tests/planner/test_gateway_directives.py).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import openai
import pytest
from fakes.lmcache import CHUNK_TOKENS, FakeLMCacheController, create_fake_lmcache
from fakes.serve import free_port
from fakes.sglang import FakeSglangEngine, create_fake_sglang
from fakes.vllm_serving import ServingState, serving_app
from gateway_helpers import ScriptedPlanner, Served, route_instance, stop_all, wait_until
from prometheus_client import CollectorRegistry

from clients.gateway.app import create_gateway_app
from clients.gateway.settings import GatewaySettings

pytestmark = pytest.mark.timeout(60)

LOCATION = "LocalCPUBackend"
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]
# 300 words: 300 tokens to the fake's tokenizer, one full LMCache chunk of 256 and the start of another
HISTORY = [
    {"role": "system", "content": " ".join(f"rule{i}" for i in range(100))},
    {"role": "user", "content": " ".join(f"word{i}" for i in range(200))},
]


class Held:
    """ASGI middleware that holds the requests for `path` until `release` is set (from the test's thread)."""

    def __init__(self, app: Any, path: str) -> None:
        self.app, self.path = app, path
        self.release = threading.Event()
        self.waiting = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == self.path:
            self.waiting += 1
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        await self.app(scope, receive, send)


class SglangTokenize:
    """ASGI: SGLang's `/tokenize` (its contract fake) in front of an OpenAI surface for the rest: beta's engine
    as an SGLang server, for the paths the gateway uses (SGLang's chat answers have vLLM's OpenAI shape)."""

    def __init__(self, engine: FakeSglangEngine, rest: Any) -> None:
        self.sglang, self.rest = create_fake_sglang(engine), rest

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        tokenize = scope["type"] == "http" and scope["path"] in ("/tokenize", "/v1/tokenize")
        await (self.sglang if tokenize else self.rest)(scope, receive, send)


class Setup:
    def __init__(self, controller: str | None, *, sglang_beta: bool = False, **settings: Any) -> None:
        self.planner = ScriptedPlanner()
        self.alpha = ServingState(models=["alpha"])
        self.beta = ServingState(models=["beta"])
        self.beta_sglang = FakeSglangEngine("beta", (0,), 1 << 30, 1 << 30)
        self.tokenize_held = Held(serving_app(self.alpha), "/tokenize")
        beta = SglangTokenize(self.beta_sglang, serving_app(self.beta)) if sglang_beta else serving_app(self.beta)
        self.served = [Served(self.tokenize_held), Served(beta)]
        b = route_instance("B", self.served[1].url, node="n2", engine="sglang" if sglang_beta else "vllm")
        self.models = [
            {"model": "alpha", "instances": [route_instance("A", self.served[0].url, node="n1")]},
            {"model": "beta", "instances": [b]},
        ]
        self.publish([])
        self.served.append(Served(self.planner.app()))
        self.registry = CollectorRegistry()
        options = {
            "planner_url": self.served[-1].url,
            "routes_wait_seconds": 2.0,
            "planner_retry_seconds": 0.1,
            "event_flush_seconds": 0.01,
            "warmups": False,
            "lmcache_controller_url": controller,
            **settings,
        }
        self.gateway = Served(create_gateway_app(GatewaySettings(**options), registry=self.registry))
        self.client = openai.OpenAI(base_url=self.gateway.url + "/v1", api_key="k", max_retries=0)
        self.tokenize_held.release.set()  # a test that holds /tokenize clears it

    def publish(self, pins: list[dict[str, Any]]) -> None:
        directives = {"decided": True, "pins": pins, "warmups": []}
        self.planner.publish({"models": self.models, "sessions": [], "directives": directives})
        want = self.planner.table["revision"]
        if hasattr(self, "gateway"):
            wait_until(lambda: self.gateway.app.state.follower.table.revision == want, what=f"table {want}")

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def chat(self, model: str, session: str, messages: list[dict[str, Any]], **extra: Any) -> Any:
        answer = self.client.chat.completions.create(
            model=model, messages=messages, max_tokens=2, extra_headers={"X-Session-Id": session}, **extra
        )
        return list(answer) if extra.get("stream") else answer

    def readyz(self) -> dict[str, Any]:
        return httpx.get(self.gateway.url + "/readyz").json()

    def stop(self) -> None:
        stop_all([self.gateway, *self.served])


@pytest.fixture
def setup():
    made: list[Setup] = []

    def make(controller: str | None, **settings: Any) -> Setup:
        made.append(Setup(controller, **settings))
        return made[-1]

    yield make
    for s in made:
        s.stop()


@pytest.fixture
def lmcache():
    """A fake LMCache controller that knows the instances `lmc-a` (alpha's, configured) and `n2-beta` (beta's,
    the node agent's default id), served over HTTP."""
    ctl = FakeLMCacheController(instances={"lmc-a", "n2-beta"})
    served = Served(create_fake_lmcache(ctl))
    yield ctl, served.url
    served.stop()


def _tokenize(url: str, body: dict[str, Any]) -> list[int]:
    answer = httpx.post(url + "/tokenize", json=body)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["tokens"])


def test_a_pin_directive_tokenizes_the_last_request_then_pins_those_token_ids(setup, lmcache):
    ctl, url = lmcache
    s = setup(url, lmcache_instance_ids={"A": "lmc-a"}, lmcache_pin_retry_seconds=0.2)
    s.chat("alpha", "s1", HISTORY, tools=TOOLS, stream=True)
    s.chat("beta", "s2", HISTORY[::-1])
    tokens_a = _tokenize(s.served[0].url, {"model": "alpha", "messages": HISTORY, "tools": TOOLS})
    tokens_b = _tokenize(s.served[1].url, {"model": "beta", "messages": HISTORY[::-1]})
    s.alpha.tokenized.clear()
    s.beta.tokenized.clear()

    s.publish([{"session": "s1", "instance": "A", "tokens": 300}, {"session": "s2", "instance": "B", "tokens": 300}])
    # LMCache holds none of those chunks yet: the controller pins nothing, and the pin is tried again
    wait_until(lambda: s.metric("statebudget_gateway_pins_total", model="alpha", outcome="empty") >= 1)
    assert s.metric("statebudget_gateway_pinned_sessions") < 2
    # the KV of both prompts in LMCache: what the engines' connectors stored
    ctl.store("lmc-a", LOCATION, tokens_a)
    ctl.store("n2-beta", LOCATION, tokens_b)
    wait_until(lambda: s.metric("statebudget_gateway_pinned_sessions") == 2, what="both pinned")
    # the engine rendered the prompt the request had: its messages and tools, nothing of the sampling
    assert set(map(str, s.alpha.tokenized)) == {str({"model": "alpha", "messages": HISTORY, "tools": TOOLS})}
    assert set(map(str, s.beta.tokenized)) == {str({"model": "beta", "messages": HISTORY[::-1]})}
    # the token ids the engine answered, to the instance's LMCache: configured for A, `<node>-<model>` for B
    by_instance = {p["instance_id"]: p for p in ctl.pin_requests}
    assert by_instance == {
        "lmc-a": {"instance_id": "lmc-a", "location": LOCATION, "tokens": tokens_a},
        "n2-beta": {"instance_id": "n2-beta", "location": LOCATION, "tokens": tokens_b},
    }
    assert ctl.pinned_tokens("lmc-a", LOCATION, tokens_a) == CHUNK_TOKENS  # the full chunk of the 300 tokens
    assert s.metric("statebudget_gateway_pins_total", model="alpha", outcome="pinned") == 1
    pins = s.readyz()["pins"]
    assert (pins["state"], pins["kept"], pins["last_error"]) == ("on", 2, None)
    pinned_before = len(ctl.pin_requests)

    # the session's next request lengthens its conversation: the pin follows it
    longer = [*HISTORY, {"role": "assistant", "content": "found it"}, {"role": "user", "content": "now fix it"}]
    s.chat("alpha", "s1", longer, tools=TOOLS)
    wait_until(lambda: len(ctl.pin_requests) == pinned_before + 1, what="the pin of the longer conversation")
    assert ctl.pin_requests[-1]["tokens"] == _tokenize(s.served[0].url, s.alpha.tokenized[-1])
    assert len(ctl.pin_requests[-1]["tokens"]) == len(tokens_a) + 5

    # the directive withdrawn: nothing to undo (LMCache lets the pin lapse), the session is no longer kept
    s.publish([{"session": "s2", "instance": "B", "tokens": 300}])
    wait_until(lambda: s.metric("statebudget_gateway_pinned_sessions") == 1, what="s1 no longer kept")
    assert "unpin" not in ctl.calls


def test_a_kept_session_is_pinned_again_before_lmcache_lets_the_pin_lapse(setup, lmcache):
    ctl, url = lmcache
    s = setup(url, lmcache_instance_ids={"A": "lmc-a"}, lmcache_pin_refresh_seconds=0.2)
    s.chat("alpha", "s1", HISTORY)
    ctl.store("lmc-a", LOCATION, _tokenize(s.served[0].url, {"model": "alpha", "messages": HISTORY}))
    s.alpha.tokenized.clear()
    s.publish([{"session": "s1", "instance": "A", "tokens": 300}])
    wait_until(lambda: s.metric("statebudget_gateway_pins_total", model="alpha", outcome="pinned") >= 3)
    assert len({tuple(p["tokens"]) for p in ctl.pin_requests}) == 1  # the same pin, renewed
    # the conversation did not change: the token ids the engine answered once serve every renewal
    assert s.alpha.tokenized == [{"model": "alpha", "messages": HISTORY}]
    # a longer conversation is tokenized again, once
    longer = [*HISTORY, {"role": "user", "content": "go on"}]
    s.chat("alpha", "s1", longer)
    wait_until(lambda: len(s.alpha.tokenized) == 2, what="the longer conversation tokenized")
    renewed = s.metric("statebudget_gateway_pins_total", model="alpha", outcome="pinned")
    wait_until(lambda: s.metric("statebudget_gateway_pins_total", model="alpha", outcome="pinned") >= renewed + 2)
    assert s.alpha.tokenized == [{"model": "alpha", "messages": HISTORY}, {"model": "alpha", "messages": longer}]


def test_an_sglang_engine_is_asked_in_sglang_s_tokenize_fields(setup, lmcache):
    """Beta's engine is SGLang (the route table's `engine`): its `/tokenize` gets `messages` with SGLang's chat
    fields (`tool_choice` among them, which vLLM's tokenize request has no field for), and the ids it answers go
    to beta's LMCache; the renewals reuse them."""
    ctl, url = lmcache
    s = setup(url, sglang_beta=True, lmcache_pin_refresh_seconds=0.2)
    s.chat("beta", "s2", HISTORY, tools=TOOLS, tool_choice="auto")
    tokens = _tokenize(s.served[1].url, {"model": "beta", "messages": HISTORY})
    ctl.store("n2-beta", LOCATION, tokens)
    s.beta_sglang.tokenized.clear()
    s.publish([{"session": "s2", "instance": "B", "tokens": 300}])
    wait_until(lambda: s.metric("statebudget_gateway_pins_total", model="beta", outcome="pinned") >= 3)
    assert s.beta_sglang.tokenized == [{"model": "beta", "messages": HISTORY, "tools": TOOLS, "tool_choice": "auto"}]
    assert {tuple(p["tokens"]) for p in ctl.pin_requests} == {tuple(tokens)}
    assert ctl.pinned_tokens("n2-beta", LOCATION, tokens) == CHUNK_TOKENS


def test_no_controller_configured_no_call(setup):
    s = setup(None)
    s.chat("alpha", "s1", HISTORY)
    s.publish([{"session": "s1", "instance": "A", "tokens": 300}])
    s.chat("alpha", "s1", HISTORY)  # a request after the directive arrived
    pins = s.gateway.app.state.pins
    assert (pins.queued, pins.kept) == (0, 0)
    assert s.alpha.tokenized == []
    assert s.readyz()["pins"] == {"state": "off"}
    assert s.readyz()["status"] == "ok"  # off is a setting, not a fault
    assert s.metric("statebudget_gateway_pins_enabled") == 0


def test_a_controller_that_fails_is_counted_and_changes_nothing_for_requests(setup, lmcache):
    ctl, url = lmcache
    # alpha's engine is not an LMCache instance the controller knows (a 500 there), and a second gateway's
    # controller is not even listening
    s = setup(url, lmcache_pin_retry_seconds=0.2)
    s.chat("alpha", "s1", HISTORY)
    s.publish([{"session": "s1", "instance": "A", "tokens": 300}])
    wait_until(lambda: s.metric("statebudget_gateway_pins_total", model="alpha", outcome="controller_failed") >= 2)
    assert ctl.pin_requests == []  # the controller refused: "n1-alpha" is not registered
    assert s.readyz()["pins"]["last_error"] == "the controller answered 500"
    assert s.chat("alpha", "s1", HISTORY).choices[0].finish_reason == "length"
    assert s.readyz()["status"] == "ok"

    down = setup(f"http://127.0.0.1:{free_port()}")
    down.chat("alpha", "s9", HISTORY)
    down.publish([{"session": "s9", "instance": "A", "tokens": 300}])
    wait_until(lambda: down.metric("statebudget_gateway_pins_total", model="alpha", outcome="controller_failed") == 1)
    assert down.readyz()["pins"]["last_error"].startswith("the controller is unreachable")
    assert down.chat("alpha", "s9", HISTORY).choices[0].finish_reason == "length"
    assert down.metric("statebudget_gateway_requests_total", model="alpha", outcome="ok") == 2


def test_a_request_never_waits_for_pins(setup, lmcache):
    """The engine's /tokenize and the controller's /pin hang; every pin worker is stuck in one of them. Requests
    to the same engine still go through and answer: a pin is never on a request's path, nor takes its
    connections."""
    ctl, _ = lmcache
    held_pin = Held(create_fake_lmcache(ctl), "/pin")
    controller = Served(held_pin)
    try:
        s = setup(controller.url, lmcache_instance_ids={"A": "lmc-a", "B": "lmc-a"}, lmcache_pin_concurrency=2)
        ctl.store("lmc-a", LOCATION, _tokenize(s.served[1].url, {"model": "beta", "messages": HISTORY}))
        s.tokenize_held.release.clear()
        s.chat("alpha", "s1", HISTORY)
        s.chat("beta", "s2", HISTORY)
        s.publish(
            [{"session": "s1", "instance": "A", "tokens": 300}, {"session": "s2", "instance": "B", "tokens": 300}]
        )
        wait_until(lambda: s.tokenize_held.waiting == 1 and held_pin.waiting == 1, what="both workers held")
        for i in range(3):
            assert s.chat("alpha", "s1", HISTORY).choices[0].finish_reason == "length"
            assert s.chat("beta", f"other{i}", HISTORY[1:]).choices[0].finish_reason == "length"
        assert ctl.pin_requests == [] and s.alpha.tokenized == []  # the pins were still waiting meanwhile
        s.tokenize_held.release.set()
        held_pin.release.set()
        wait_until(lambda: s.metric("statebudget_gateway_pinned_sessions") == 2, what="the pins done")
    finally:
        controller.stop()
