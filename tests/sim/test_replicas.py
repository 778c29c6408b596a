"""Several engine instances of one model in the replay, and the gateway's choice among them (sim/replicas.py)."""

from __future__ import annotations

import json

import pytest
from test_engine import random_trace, tiny_scenario

from planner_service.domain.demo import demo_scenario
from planner_service.domain.problem import native_precision_scenario
from planner_service.sim.engine import SimResult, simulate
from planner_service.sim.evidence import render_section
from planner_service.sim.gateway_study import gateway_study, synthetic
from planner_service.sim.policies import create_policy
from planner_service.sim.replicas import replicate
from planner_service.sim.synth import SynthParams
from planner_service.sim.trace import TraceRecord, TraceRequest


def turns(sessions: int, rounds: int, gap: float = 100.0) -> list[TraceRecord]:
    """`sessions` sessions on model a, one turn each per round, a round every `gap` seconds, one at a time."""
    return [
        TraceRequest(t=r * gap + s, session=f"s{s}", model="a", input_tokens=500, output_tokens=10)
        for r in range(rounds)
        for s in range(sessions)
    ]


def run(records: list[TraceRecord], gateway: str, replicas: dict[str, int] | None, seed: int = 0) -> SimResult:
    """`lru` on the tiny scenario's one 10 GB GPU: a's two 4 GB instances fit with room for every session's KV."""
    return simulate(tiny_scenario(), records, create_policy("lru"), gateway=gateway, replicas=replicas, seed=seed)


def test_a_replica_is_the_model_under_its_own_id_on_every_node_that_declares_it() -> None:
    scenario = demo_scenario()
    copied = replicate(scenario, {"coder": 3})
    ids = [m.id for m in copied.models]
    assert ids == [m.id for m in scenario.models] + ["coder:2", "coder:3"]
    coder = next(m for m in scenario.models if m.id == "coder")
    for copy in copied.models[-2:]:
        assert copy.model_dump(exclude={"id"}) == coder.model_dump(exclude={"id"})
    for before, after in zip(scenario.cluster.nodes, copied.cluster.nodes, strict=True):
        declared = {e.model: e for e in before.engines or []}
        if "coder" in declared:
            for x in ("coder:2", "coder:3"):
                twin = next(e for e in after.engines or [] if e.model == x)
                assert twin.model_dump(exclude={"model"}) == declared["coder"].model_dump(exclude={"model"})
    on_nvme = [r for r in scenario.residency if r.object.model == "coder" and r.location.tier == "nvme"]
    assert on_nvme
    for r in on_nvme:  # its checkpoint where the model's lies; nothing of it on GPU or in host RAM
        assert any(
            c.object.model == "coder:2" and c.location == r.location and c.bytes == r.bytes for c in copied.residency
        )
    assert all(c.location.tier == "nvme" for c in copied.residency if c.object.model == "coder:2")
    assert copied.predictor.handoff["coder:2"] == scenario.predictor.handoff["coder"]
    assert replicate(scenario, {"coder": 1}) is scenario


@pytest.mark.parametrize(
    ("copies", "message"),
    [({"poet": 2}, "'poet' is not a model"), ({"coder": 0}, "at least 1 instance")],
)
def test_replicas_of_what_the_scenario_lacks_are_refused_by_name(copies: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replicate(demo_scenario(), copies)


def test_one_instance_each_replays_as_without_the_option() -> None:
    records = random_trace(["a", "b"], sessions=3, requests=30, seed=5)
    plain = simulate(tiny_scenario(), records, create_policy("lru"))
    one = simulate(tiny_scenario(), records, create_policy("lru"), replicas={"a": 1})
    assert [(r.model, r.switch_seconds, r.done_at) for r in one.requests] == [
        (r.model, r.switch_seconds, r.done_at) for r in plain.requests
    ]


def test_with_affinity_every_turn_after_the_first_goes_where_its_session_s_kv_is() -> None:
    """Four sessions, five rounds, one request at a time: every turn after a session's first finds its KV on
    the instance its first went to (nothing evicts it), and prefills none of its history again."""
    result = run(turns(4, 5), "affinity", {"a": 2})
    first: dict[str, str] = {}
    for r in result.requests:
        assert r.state == "done"
        if first.setdefault(r.session, r.model) != r.model:
            pytest.fail(f"{r.session} moved from {first[r.session]} to {r.model}")
        if r.index >= 4:
            assert r.reprefill_tokens == 0 and not r.handoff
    assert set(first.values()) <= {"a", "a:2"}
    gateway = result.extra["gateway"]
    assert (gateway["routed"], gateway["routed_with_kv_holder"], gateway["routed_to_kv_holder"]) == (20, 16, 16)


def test_without_affinity_an_idle_pair_is_a_coin_toss_and_moved_turns_prefill_again() -> None:
    """The same trace sent to the least loaded instance: with both idle at each arrival the choice is drawn, so
    some later turns land away from their last turn's KV and prefill again what the instance's own copy (from
    an earlier visit, or none) does not cover."""
    result = run(turns(4, 5), "none", {"a": 2}, seed=3)
    later = [r for r in result.requests if r.index >= 4]
    moved = [r for r in later if r.model != result.requests[r.index - 4].model]
    assert 0 < len(moved) < len(later)
    for r in moved:
        assert 0 < r.reprefill_tokens <= r.history_tokens
    gateway = result.extra["gateway"]
    assert gateway["routed_with_kv_holder"] == 16 and gateway["routed_to_kv_holder"] == 16 - len(moved)
    assert sum(r.handoff for r in result.requests) == 0  # an instance is not a model: no hand-off


def test_the_least_loaded_instance_takes_a_request_while_the_other_is_busy() -> None:
    """s1 and s2 arrive together: the second goes to the instance the first does not wait on, either arm."""
    records: list[TraceRecord] = [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=500, output_tokens=10),
        TraceRequest(t=0.0, session="s2", model="a", input_tokens=500, output_tokens=10),
    ]
    for gateway in ("none", "affinity"):
        result = run(records, gateway, {"a": 2})
        assert {r.model for r in result.requests} == {"a", "a:2"}


def test_a_hand_off_is_a_change_of_the_model_the_trace_names() -> None:
    records = random_trace(["a", "b"], sessions=3, requests=30, seed=7)
    plain = simulate(tiny_scenario(), records, create_policy("lru"))
    for gateway in ("none", "affinity"):
        routed = run(records, gateway, {"a": 2, "b": 2})
        assert [r.handoff for r in routed.requests] == [r.handoff for r in plain.requests]


def test_the_affinity_study_pairs_the_arms_and_renders() -> None:
    scenario = native_precision_scenario(demo_scenario())
    params = SynthParams(sessions=3, hours=0.05, arrival_spread_seconds=45, departure_spread_seconds=45, gap_scale=8)
    data = gateway_study(
        scenario,
        [synthetic(scenario, params, "tiny")],
        ["sleep-router"],
        [1, 2],
        arms=("none", "affinity"),
        replicas={"coder": 2},
    )
    data.update(scenario="demo", precision="native")
    assert data["replicas"] == {"coder": 2}
    work = data["workloads"][0]
    none, affine = work["runs"]["sleep-router"]["none"], work["runs"]["sleep-router"]["affinity"]
    for r in affine:  # affinity sends every request whose session's KV an instance holds there
        assert r["routed_to_kv_holder"] == r["routed_with_kv_holder"]
    diffs = [a["stay_p95_seconds"] - n["stay_p95_seconds"] for a, n in zip(affine, none, strict=True)]
    assert work["paired"]["sleep-router"]["affinity"]["stay_p95_diff_seconds"]["mean"] == pytest.approx(sum(diffs) / 2)
    page = render_section("gateway-affinity", json.loads(json.dumps(data)))
    assert "with 2 instances of `coder`" in page and "| sleep-router | affinity |" in page


def test_a_turn_sent_away_from_its_kv_restores_what_the_other_instance_on_its_node_wrote_through() -> None:
    """`sleep-router` writes every turn's KV through to host DRAM in whole 256-token chunks (sim/kv_save.py): the
    two instances share the node's host tier (LMCache as one server per node), so a later turn the balancer sends
    to the other instance restores its history's whole chunks from there (1 GB/s, 1,000 bytes a token: under
    2 ms) and prefills only the last partial chunk (at most 255 tokens, 1 ms each)."""
    result = simulate(tiny_scenario(), turns(4, 5), create_policy("sleep-router"), gateway="none", replicas={"a": 2})
    later = [r for r in result.requests if r.index >= 4]
    moved = [r for r in later if r.model != result.requests[r.index - 4].model]
    assert moved
    for r in moved:
        assert r.state == "done" and r.reprefill_tokens < 256 <= r.history_tokens
        assert r.parts is not None and 0 < r.parts["kv_restore"] < 0.002
