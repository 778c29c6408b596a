"""Planner and replay price a hand-off with one cost model: the same state gives the same switch latency,
the engine transition that brings its model up included (engines.bring_up_fixed_seconds)."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest

from planner_service.domain.problem import Problem, Session
from planner_service.domain.scenario import Scenario, Slo, parse_scenario
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.planner import costs
from planner_service.planner.objective import cold_load, expert_share, kv_ready
from planner_service.planner.residency import ResidencyIndex
from planner_service.sim.engine import Simulator
from planner_service.sim.policies.lru import LruPolicy
from planner_service.sim.policies.oracle import OraclePolicy
from planner_service.sim.state import SimRequest
from planner_service.sim.trace import TraceRequest
from planner_service.sim.view import SimView
from tests.sim.test_engine import GB, tiny_scenario, tiny_trace


class Snapshot(OraclePolicy):
    """The oracle, noting what the planner would see as each request starts: the residency, the KV each copy
    covers and the session's history."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, tuple[dict[tuple[StateObject, Location], int], int, int]] = {}

    def on_start(self, sim: SimView, req: SimRequest) -> None:
        kvpt = sim.problem.models[req.model].kv_bytes_per_token
        residency = {}
        for (obj, loc), nbytes in sim.cluster.placed.items():
            if obj.kind is Kind.KV:  # a KV copy's bytes are the tokens it covers (the planner's view)
                tokens = sim.gpu_tokens.get(obj, 0) if loc.tier is Tier.GPU else sim.host_tokens.get(obj, 0)
                nbytes = min(nbytes, tokens * kvpt)
            if nbytes > 0:
                residency[(obj, loc)] = nbytes
        kv = StateObject.kv(req.model, req.session)
        self.seen[req.index] = (residency, req.history_tokens, sim.gpu_tokens.get(kv, 0) * kvpt)


def test_the_planners_switch_latency_for_a_hand_off_equals_the_replays() -> None:
    # room for one model: the hand-off back to a at 200 s finds a's weights prefetched and the 768 tokens of a's
    # first prompt that LMCache stored in host DRAM (whole 256-token chunks, sim/kv_save.py): restore 768 tokens
    # (0.768 ms), prefill the other 1232 (1.232 s)
    policy = Snapshot()
    sim = Simulator(tiny_scenario(6 * GB), tiny_trace(), policy)
    result = sim.run()
    handoff = result.requests[2]
    assert handoff.handoff and handoff.prefill_queue_seconds == 0.0
    residency, history, gpu_kv = policy.seen[2]
    session = Session("s1", "s1", Slo.INTERACTIVE, "a", True, history)
    problem = dataclasses.replace(
        sim.problem, sessions=MappingProxyType({"s1": session}), residency=MappingProxyType(residency)
    )
    index = ResidencyIndex.build(problem, residency)
    gpus = sim.models["a"].gpus
    predicted = kv_ready(problem, index, problem.models["a"], "s1", "n1", gpus, gpu_kv)
    assert predicted == pytest.approx(handoff.switch_seconds, abs=1e-9)
    assert predicted == pytest.approx(1.232768, abs=1e-6)  # a real restore, not a plain re-prefill


class ArrivalSnapshot(LruPolicy):
    """lru, noting what the planner would see as each request arrives, before its model is brought up: the
    residency (a KV copy's bytes are the tokens it covers), the session's history and the sleeping engines
    (what a node agent's heartbeat reports)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, tuple[dict[tuple[StateObject, Location], int], int, dict]] = {}

    def on_arrival(self, sim: SimView, req: SimRequest) -> None:
        kvpt = sim.problem.models[req.model].kv_bytes_per_token
        residency = {}
        for (obj, loc), nbytes in sim.cluster.placed.items():
            if obj.kind is Kind.KV:
                tokens = sim.gpu_tokens.get(obj, 0) if loc.tier is Tier.GPU else sim.host_tokens.get(obj, 0)
                nbytes = min(nbytes, tokens * kvpt)
            if nbytes > 0:
                residency[(obj, loc)] = nbytes
        history = sim.sessions[req.session].history_tokens
        self.seen[req.index] = (residency, history, sim.sleeping_engines())
        super().on_arrival(sim, req)


def at_hand_off(scenario: Scenario, index: int, model: str) -> tuple[Problem, SimRequest]:
    """The replay of `tiny_trace` on `scenario`, and the planner's problem as its request `index` (a hand-off
    of session s1 to `model`) arrives: the residency, history and sleeping engines the replay had then."""
    policy = ArrivalSnapshot()
    sim = Simulator(scenario, tiny_trace(), policy)
    handoff = sim.run().requests[index]
    residency, history, asleep = policy.seen[index]
    session = Session("s1", "s1", Slo.INTERACTIVE, model, True, history)
    problem = dataclasses.replace(
        sim.problem,
        sessions=MappingProxyType({"s1": session}),
        residency=MappingProxyType(residency),
        observed_engines=asleep,
    )
    return problem, handoff


@pytest.mark.parametrize(
    ("index", "model", "expected"),
    [
        # b's engine was never started: a cold start, 30 s + 8 s of copy from NVMe, and a re-prefill of the
        # 1000-token history (1 s)
        (1, "b", 39.0),
        # a's engine sleeps at level 1 (its weights in host RAM, the backup): a wake, 0.1 s + 4 s of copy from
        # the host; the 768 tokens of its turn-1 prompt stored to host restore in 0.768 ms, the other 1232 of the
        # history re-prefill in 1.232 s
        (2, "a", 5.332768),
    ],
)
def test_the_planners_latency_for_a_hand_off_onto_a_stopped_or_sleeping_engine_equals_the_replays(
    index: int, model: str, expected: float
) -> None:
    problem, handoff = at_hand_off(tiny_scenario(6 * GB), index, model)
    index_now = ResidencyIndex.build(problem, problem.residency)
    assert model not in index_now.serving  # its engine is stopped or asleep
    cold = cold_load(problem, index_now, problem.models[model], index_now)
    assert cold.node == "n1"
    predicted = cold.seconds + kv_ready(problem, index_now, problem.models[model], "s1", "n1", cold.gpus, 0)
    assert predicted == pytest.approx(handoff.switch_seconds, abs=1e-9)
    assert predicted == pytest.approx(expected, abs=1e-6)


def tensor_parallel_scenario() -> Scenario:
    """`tiny_scenario`'s node with two 3 GB cards, so each 4 GB model runs on both (tensor parallel 2), and
    models whose config gives 10 layers of hidden size 2500 (sizes, KV and parameters as tiny_scenario's).

    Prefill per token: 2 * 2.5e8 / (2 * 1e12 * 0.5) = 5e-4 s of compute, plus the all-reduce:
    2 per layer * 10 layers * 2 (2 - 1) / 2 * 2500 * 2 B = 100,000 B at 1 GB/s (the cards give no peer rate:
    their h2d stands in) = 1e-4 s; 6e-4 s in all. Attention: 10 layers * 2 * 20 heads * (125 + 125) =
    100,000 FLOPs per (query, key) pair, 1e-7 s on the pair of cards.
    """
    data = tiny_scenario(3 * GB).model_dump(mode="json", exclude_none=True)
    node = data["cluster"]["nodes"][0]
    node["gpus"].append({**node["gpus"][0], "id": "g1"})
    config = {
        "model_type": "llama",
        "num_hidden_layers": 10,
        "hidden_size": 2500,
        "num_attention_heads": 20,
        "intermediate_size": 10000,
        "vocab_size": 1000,
    }
    for model in data["models"]:
        model["config"] = config
    return parse_scenario(data)


def test_a_tensor_parallel_groups_all_reduce_and_attention_are_priced_alike_by_planner_and_replay() -> None:
    problem, handoff = at_hand_off(tensor_parallel_scenario(), 1, "b")
    model = problem.models["b"]
    assert (model.num_layers, model.hidden_size) == (10, 2500)
    index_now = ResidencyIndex.build(problem, problem.residency)
    cold = cold_load(problem, index_now, model, index_now)
    assert len(cold.gpus) == 2
    assert costs.prefill_seconds_per_token(model, cold.gpus, problem.constants) == pytest.approx(6e-4, rel=1e-12)
    predicted = cold.seconds + kv_ready(problem, index_now, model, "s1", "n1", cold.gpus, 0)
    assert predicted == pytest.approx(handoff.switch_seconds, abs=1e-9)
    # the 1000-token history re-prefills at 6e-4 s/token, 0.6 s of which the all-reduce is 0.1 s, plus its
    # 1000 * 1001 / 2 = 500,500 causal pairs at 1e-7 s: 0.05005 s
    assert costs.attention_seconds_per_pair(model, cold.gpus, problem.constants) == pytest.approx(1e-7, rel=1e-12)
    assert handoff.parts["reprefill"] == pytest.approx(0.65005, abs=1e-9)


def test_a_moes_re_prefill_with_experts_off_gpu_is_priced_alike_by_planner_and_replay() -> None:
    """moe_scenario: a MoE of 20 GB of routed experts, 1/8 GB each (one read per token: k / E = 1/160), on the
    tiny node's one card (1 GB/s PCIe, 1 ms a prefilled token, 10 GB: vLLM's 2048-token chunks). The hand-off
    to it re-prefills the session's 1100-token history with 3 GB of its experts on the GPU (f = 0.15) and the
    rest on NVMe only (no CPU path): one chunk, touching 1 - (159/160)^1100 = 1 - e^(1100 ln(159/160))
    = 0.998989 of the experts, streams 0.998989 * 0.85 * 20 GB / 1 GB/s = 16.98281 s, after 1100 * 1 ms."""
    from tests.sim.test_engine_model import moe_scenario

    trace = [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=1000, output_tokens=100),
        TraceRequest(t=100.0, session="s1", model="moe", input_tokens=10, output_tokens=10),
    ]
    policy = Snapshot()
    sim = Simulator(moe_scenario(), trace, policy)
    handoff = sim.run().requests[1]
    assert handoff.handoff and handoff.prefill_queue_seconds == 0.0
    residency, history, gpu_kv = policy.seen[1]
    assert history == 1100 and gpu_kv == 0
    session = Session("s1", "s1", Slo.INTERACTIVE, "moe", True, history)
    problem = dataclasses.replace(
        sim.problem, sessions=MappingProxyType({"s1": session}), residency=MappingProxyType(residency)
    )
    index = ResidencyIndex.build(problem, residency)
    model = problem.models["moe"]
    assert expert_share(index, model, "n1") == (0.15, False)
    predicted = kv_ready(problem, index, model, "s1", "n1", sim.models["moe"].gpus, gpu_kv)
    assert predicted == pytest.approx(handoff.parts["reprefill"], abs=1e-9)
    assert predicted == pytest.approx(1.1 + 16.98281, abs=1e-5)
