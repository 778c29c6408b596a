"""The gateway carries out the planner's warm-up directives against fake vLLM servers: only on an idle instance,
giving way at once to a real request, and not at all with warm-ups off.

In most tests the planner is a stand-in serving a route table the test scripts (its long-poll answers when the
test publishes a new revision); the last one runs the real planner end to end (its directives for scripted
states: tests/api/test_api_routes.py and tests/planner/test_gateway_directives.py).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import openai
import pytest
from fakes.vllm_serving import ServingState, serving_app
from gateway_helpers import ScriptedPlanner, Served, route_instance, wait_until
from prometheus_client import CollectorRegistry

from clients.gateway.app import create_gateway_app
from clients.gateway.settings import GatewaySettings

pytestmark = pytest.mark.timeout(60)

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}]
HISTORY = [{"role": "system", "content": "you search"}, {"role": "user", "content": "find the bug"}]


class Setup:
    def __init__(self, *, token_latency_seconds: float, warmups: bool = True) -> None:
        self.planner = ScriptedPlanner()
        self.alpha = ServingState(models=["alpha"], token_latency_seconds=0.0)
        self.beta = ServingState(models=["beta"], token_latency_seconds=token_latency_seconds)
        self.served = [Served(serving_app(self.alpha)), Served(serving_app(self.beta))]
        self.models = [
            {"model": "alpha", "instances": [route_instance("A", self.served[0].url)]},
            {"model": "beta", "instances": [route_instance("B", self.served[1].url)]},
        ]
        self.publish([])
        self.served.append(Served(self.planner.app()))
        settings = GatewaySettings(
            planner_url=self.served[-1].url,
            routes_wait_seconds=2.0,
            planner_retry_seconds=0.1,
            event_flush_seconds=0.01,
            warmups=warmups,
        )
        self.registry = CollectorRegistry()
        self.gateway = Served(create_gateway_app(settings, registry=self.registry))
        self.client = openai.OpenAI(base_url=self.gateway.url + "/v1", api_key="k", max_retries=0)

    def publish(self, warmups: list[dict[str, Any]]) -> None:
        self.planner.publish(
            {"models": self.models, "sessions": [], "directives": {"decided": True, "pins": [], "warmups": warmups}}
        )

    def wait_for_revision(self) -> None:
        want = self.planner.table["revision"]
        wait_until(lambda: self.gateway.app.state.follower.table.revision == want, what=f"table {want}")

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def tool_call(self, session: str) -> None:
        answer = self.client.chat.completions.create(
            model="alpha", messages=HISTORY, tools=TOOLS, max_tokens=1, extra_headers={"X-Session-Id": session}
        )
        assert answer.choices[0].finish_reason == "tool_calls"

    def stop(self) -> None:
        for served in [self.gateway, *reversed(self.served)]:
            served.stop()


@pytest.fixture
def setup():
    made: list[Setup] = []

    def make(**kw: Any) -> Setup:
        made.append(Setup(**kw))
        return made[-1]

    yield make
    for s in made:
        s.stop()


WARM_S1 = {"session": "s1", "model": "beta", "instance": "B", "tokens": 6, "probability": 0.9}


def _beta_call(s: Setup, session: str, max_tokens: int) -> threading.Thread:
    def call() -> None:
        s.client.chat.completions.create(
            model="beta",
            messages=[{"role": "user", "content": "busy"}],
            max_tokens=max_tokens,
            extra_headers={"X-Session-Id": session},
        )

    thread = threading.Thread(target=call)
    thread.start()
    return thread


def test_a_warmup_waits_for_an_idle_instance_then_prefills_the_history(setup):
    s = setup(token_latency_seconds=0.1)
    s.tool_call("s1")
    busy = _beta_call(s, "other", max_tokens=10)  # 1 s of decoding on B
    wait_until(lambda: s.beta.in_flight == 1, what="B busy")
    s.publish([WARM_S1])
    s.wait_for_revision()
    time.sleep(0.3)
    assert len(s.beta.received) == 1  # B is busy: the directive waits
    busy.join(10)
    wait_until(lambda: s.metric("statebudget_gateway_warmups_total", model="beta", outcome="completed") == 1)
    warm = s.beta.received[1]
    # the session's history, to the predicted model, one token, not streamed; the client's tools kept
    assert warm == {"messages": HISTORY, "tools": TOOLS, "max_tokens": 1, "model": "beta"}
    # the directive is carried out once: a later table with it does not repeat it
    s.publish([WARM_S1, {**WARM_S1, "tokens": 7}])
    s.wait_for_revision()
    time.sleep(0.2)
    assert len(s.beta.received) == 2
    # the session's next request, handed off to beta, lands where the warm-up prefilled
    s.client.chat.completions.create(
        model="beta", messages=[*HISTORY, {"role": "tool", "content": "found"}], extra_headers={"X-Session-Id": "s1"}
    )
    assert s.metric("statebudget_gateway_warmups_used_total", model="beta") == 1
    assert s.metric("statebudget_gateway_warmups_total", model="beta", outcome="cancelled") == 0


def test_a_real_request_cancels_a_running_warmup_at_once(setup):
    s = setup(token_latency_seconds=2.0)  # a warm-up's one token takes 2 s: it is still running below
    s.tool_call("s1")
    s.publish([WARM_S1])
    wait_until(lambda: s.beta.in_flight == 1, what="the warm-up running on B")
    started = time.monotonic()
    real = _beta_call(s, "s2", max_tokens=1)
    wait_until(lambda: s.beta.cancelled == 1, what="the engine aborting the warm-up")
    assert time.monotonic() - started < 1.0  # it gave way before its token was due
    real.join(10)
    assert s.beta.finished == 1 and len(s.beta.received) == 2
    wait_until(lambda: s.metric("statebudget_gateway_warmups_total", model="beta", outcome="cancelled") == 1)
    # not retried once B is idle again: a cancelled warm-up waits for the session's next tool call
    time.sleep(0.3)
    assert len(s.beta.received) == 2 and s.metric("statebudget_gateway_warmups_used_total", model="beta") == 0


def test_no_warmup_while_the_engine_reports_requests_of_others(setup):
    """A request sent to the engine around the gateway: the gateway has nothing in flight there, but the engine's
    scheduler gauges say it is busy; the warm-up waits until they say it is idle."""
    s = setup(token_latency_seconds=0.1)
    s.tool_call("s1")
    direct = openai.OpenAI(base_url=s.served[1].url + "/v1", api_key="k", max_retries=0)
    around = threading.Thread(
        target=lambda: direct.chat.completions.create(
            model="beta", messages=[{"role": "user", "content": "direct"}], max_tokens=15
        )
    )
    around.start()
    wait_until(lambda: s.beta.in_flight == 1, what="B busy with a request around the gateway")
    s.publish([WARM_S1])
    wait_until(lambda: s.metric("statebudget_gateway_warmups_total", model="beta", outcome="engine_busy") >= 1)
    assert len(s.beta.received) == 1
    around.join(10)
    wait_until(lambda: s.metric("statebudget_gateway_warmups_total", model="beta", outcome="completed") == 1)
    assert s.beta.received[-1]["max_tokens"] == 1 and len(s.beta.received) == 2
    # only the warm-up sent counts as started; the looks at a busy engine count apart
    assert s.metric("statebudget_gateway_warmups_total", model="beta", outcome="started") == 1


def test_the_planner_withdrawing_a_directive_cancels_its_warmup(setup):
    s = setup(token_latency_seconds=2.0)
    s.tool_call("s1")
    s.publish([WARM_S1])
    wait_until(lambda: s.beta.in_flight == 1, what="the warm-up running on B")
    s.publish([])
    wait_until(lambda: s.beta.cancelled == 1, what="the engine aborting the withdrawn warm-up")


def test_warmups_off_sends_nothing(setup):
    s = setup(token_latency_seconds=0.0, warmups=False)
    s.tool_call("s1")
    s.publish([WARM_S1])
    s.wait_for_revision()
    time.sleep(0.3)
    assert s.beta.received == []
    assert s.metric("statebudget_gateway_warmups_total", model="beta", outcome="started") == 0
    body = json.dumps(s.planner.table)
    assert '"warmups": [{"session": "s1"' in body  # the directive was there; the setting kept it from running


def test_the_real_planner_directs_a_warmup_the_gateway_carries_out(make_stack):
    """Agents through the gateway teach the planner's predictor that alpha hands off to beta; a session whose
    answer on alpha calls a tool gets a warm-up on beta's idle instance, which the gateway sends there."""
    stack = make_stack(engines={"e1": ["alpha"], "e2": ["beta"]})
    stack.register("n1", [{"name": "vllm", "models": ["alpha"], "url": stack.engines["e1"][0].url, "gpus": ["n1-g0"]}])
    stack.register("n2", [{"name": "vllm", "models": ["beta"], "url": stack.engines["e2"][0].url, "gpus": ["n2-g0"]}])
    stack.heartbeat("n1", [("alpha", "n1-g0", "running")])
    stack.heartbeat("n2", [("beta", "n2-g0", "running")])
    # the node agents carry out the plan's open operations: a card with one open is not idle
    for node in ("n1", "n2"):
        lease = stack.planner_http.post(f"/v1/nodes/{node}/lease", json={"max_operations": 100}).json()
        for op in lease["operations"]:
            report = {"lease_id": lease["lease_id"], "status": "done"}
            assert stack.planner_http.post(f"/v1/operations/{op['id']}/report", json=report).status_code == 200
    stack.wait_for_table(lambda t: bool(t.running("alpha")) and bool(t.running("beta")), "both running")
    client = openai.OpenAI(base_url=stack.gateway_v1, api_key="k", max_retries=0)
    for i in range(6):  # P(beta | alpha) = (6 + 10 * 0.4 + 0.1) / (6 + 10 + 0.2) = 0.62 (domain/predictions.py)
        for model in ("alpha", "beta"):
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "go"}], extra_headers={"X-Session-Id": f"h{i}"}
            )
    beta = stack.engines["e2"][1]
    before = len(beta.received)
    answer = client.chat.completions.create(
        model="alpha", messages=HISTORY, tools=TOOLS, max_tokens=1, extra_headers={"X-Session-Id": "s1"}
    )
    assert answer.choices[0].finish_reason == "tool_calls"
    wait_until(lambda: len(beta.received) == before + 1, what="the warm-up reaching beta")
    assert beta.received[-1] == {"messages": HISTORY, "tools": TOOLS, "max_tokens": 1, "model": "beta"}
    [warmup] = stack.follower.table.warmups
    assert (warmup.session, warmup.model, warmup.instance) == ("s1", "beta", "beta@bf16@n2-g0")
