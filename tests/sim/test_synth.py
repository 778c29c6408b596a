"""Synthetic agent traces: deterministic, valid, about `sessions` alive, drifting, heavy-tailed, growing."""

import itertools
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from planner_service.domain.demo import demo_scenario, demo_scenario_json
from planner_service.domain.scenario import Slo, parse_scenario
from planner_service.sim.synth import SynthParams, handoff_prior, handoff_share, hourly_transitions, synth_trace
from planner_service.sim.trace import TraceEnd, TraceRequest, read_trace, trace_json_schema, write_trace_stream

PARAMS = SynthParams()  # 10 sessions, 8 hours, 10 engineers


@pytest.fixture(scope="module")
def trace():
    return synth_trace(demo_scenario(), PARAMS, np.random.default_rng(7))


def requests(records) -> list[TraceRequest]:
    return [r for r in records if isinstance(r, TraceRequest)]


def test_same_seed_same_trace_other_seed_other_trace(trace) -> None:
    assert synth_trace(demo_scenario(), PARAMS, np.random.default_rng(7)) == trace
    assert synth_trace(demo_scenario(), PARAMS, np.random.default_rng(8)) != trace


def test_sorted_valid_and_reads_back(trace, tmp_path: Path) -> None:
    times = [r.t for r in trace]
    assert times == sorted(times) and 0 <= times[0] and times[-1] <= PARAMS.duration_seconds
    schema = trace_json_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    for record in trace[::10]:  # jsonschema is slow; the round trip below checks every record
        validator.validate(record.model_dump(mode="json", exclude_none=True))
    path = tmp_path / "synth.jsonl"
    write_trace_stream(path, trace)
    assert read_trace(path) == trace


def test_every_session_ends_once_after_its_requests(trace) -> None:
    ends = Counter(r.session for r in trace if isinstance(r, TraceEnd))
    assert set(ends) == {r.session for r in trace} and set(ends.values()) == {1}
    ended: set[str] = set()
    for record in trace:
        assert record.session not in ended, f"{record.session} has a request after its end"
        if isinstance(record, TraceEnd):
            ended.add(record.session)


def test_about_sessions_alive_at_a_time(trace) -> None:
    first: dict[str, float] = {}
    end: dict[str, float] = {}
    for record in trace:
        first.setdefault(record.session, record.t)
        if isinstance(record, TraceEnd):
            end[record.session] = record.t
    # past the arrivals and before the departures, sample the number of live sessions
    probes = np.linspace(PARAMS.arrival_spread_seconds, PARAMS.duration_seconds - PARAMS.departure_spread_seconds, 400)
    alive = [sum(1 for s in first if first[s] <= t < end[s]) for t in probes]
    assert 0.85 * PARAMS.sessions <= np.mean(alive) <= PARAMS.sessions
    assert max(alive) <= PARAMS.sessions
    assert len(first) > 5 * PARAMS.sessions  # sessions end and are replaced over the day


def test_model_mix_drifts_from_coder_to_reasoner(trace) -> None:
    models = [m.id for m in demo_scenario().models]

    def mix(hour: int) -> np.ndarray:
        counts = Counter(r.model for r in requests(trace) if hour * 3600 <= r.t < (hour + 1) * 3600)
        return np.array([counts[m] for m in models]) / sum(counts.values())

    morning, evening = mix(0), mix(7)
    coder, reasoner = models.index("coder"), models.index("reasoner")
    assert morning[coder] > 2 * evening[coder]
    assert evening[reasoner] > 2 * morning[reasoner]
    assert 0.5 * np.abs(morning - evening).sum() > 0.3  # total variation distance


def test_handoffs_happen_and_follow_the_chain(trace) -> None:
    by_session: dict[str, list[str]] = defaultdict(list)
    for r in requests(trace):
        by_session[r.session].append(r.model)
    pairs = Counter((a, b) for chain in by_session.values() for a, b in itertools.pairwise(chain))
    handoffs = sum(n for (a, b), n in pairs.items() if a != b)
    assert 0.2 < handoffs / sum(pairs.values()) < 0.8
    # the prior never sends the summarizer to the coder; the drift adds a little of every model
    assert pairs[("coder", "planner")] > pairs[("summarizer", "coder")]


def test_the_gap_scale_stretches_every_gap_between_turns() -> None:
    """The same seed draws the same gaps; a scale of 4 makes each one 4 times longer (the floor aside), so a
    session offers a quarter of the turns per hour."""
    scenario = demo_scenario()
    params = SynthParams(sessions=2, hours=8, mean_turns_per_session=6)
    base = synth_trace(scenario, params, np.random.default_rng(4))
    slow = synth_trace(scenario, replace(params, gap_scale=4.0), np.random.default_rng(4))
    first_session = sorted(r.t for r in requests(base) if r.session == "s0001")
    stretched = sorted(r.t for r in requests(slow) if r.session == "s0001")
    gaps, slow_gaps = np.diff(first_session), np.diff(stretched)
    n = min(len(gaps), len(slow_gaps))
    assert n >= 2
    assert slow_gaps[:n] == pytest.approx(4 * gaps[:n], abs=2e-3)  # times are rounded to the millisecond


def test_gaps_are_heavy_tailed(trace) -> None:
    times: dict[str, list[float]] = defaultdict(list)
    for r in requests(trace):
        times[r.session].append(r.t)
    gaps = np.concatenate([np.diff(ts) for ts in times.values() if len(ts) > 1])
    p50, p99 = np.percentile(gaps, [50, 99])
    assert 5 < p50 < 20  # TraceLab's agent rounds: p50 7.8 s
    assert p99 / p50 > 15
    assert 15 < gaps.mean() < 60  # about the demo's predictor.turn_gap_seconds (30 s)


def test_contexts_grow_within_the_limit(trace) -> None:
    history: dict[str, list[int]] = defaultdict(list)
    for r in requests(trace):
        before = history[r.session][-1] if history[r.session] else 0
        history[r.session].append(before + r.input_tokens + r.output_tokens)
    long_sessions = [h for h in history.values() if len(h) >= 10]
    assert long_sessions
    assert np.median([h[9] / h[0] for h in long_sessions]) > 2  # ten turns in, the context has more than doubled
    assert max(h[-1] for h in history.values()) <= PARAMS.max_context_tokens


def test_slo_classes_and_users(trace) -> None:
    reqs = requests(trace)
    assert {r.slo for r in reqs} == set(Slo)
    per_session = defaultdict(set)
    for r in reqs:
        per_session[r.session].add((r.slo, r.user))
    assert all(len(v) == 1 for v in per_session.values())  # a session keeps its class and owner
    assert len({r.user for r in reqs}) == PARAMS.users


def test_transitions_are_stochastic_and_built_from_the_priors() -> None:
    scenario = demo_scenario()
    prior = handoff_prior(scenario)
    assert np.allclose(prior.sum(axis=1), 1)
    models = [m.id for m in scenario.models]
    assert prior[models.index("coder"), models.index("coder")] == pytest.approx(0.6)
    matrices = hourly_transitions(scenario, PARAMS)
    assert matrices.shape == (8, len(models), len(models))
    assert np.allclose(matrices.sum(axis=2), 1)


def test_scenario_without_priors_or_focus_models() -> None:
    data = demo_scenario_json()
    data["predictor"] = {"stay_probability": 0.9}
    keep = {"planner", "summarizer"}
    data["models"] = [m for m in data["models"] if m["id"] in keep]
    data["sessions"] = [s for s in data["sessions"] if s["model"] in keep]
    for node in data["cluster"]["nodes"]:  # the demo's engines serve the models it keeps, as a trimmed catalog would
        node["engines"] = [e for e in node.get("engines") or [] if e["model"] in keep]
    data["residency"] = [
        r
        for r in data["residency"]
        if r["object"]["model"] in keep and r["object"].get("session") in {None, *(s["id"] for s in data["sessions"])}
    ]
    scenario = parse_scenario(data)
    assert handoff_prior(scenario)[0].tolist() == [0.9, pytest.approx(0.1)]
    params = SynthParams(sessions=3, hours=2, users=2)
    records = synth_trace(scenario, params, np.random.default_rng(0))
    reqs = requests(records)
    assert {r.model for r in reqs} == keep  # morning falls back to the first model, afternoon to the last
    early = Counter(r.model for r in reqs if r.t < 3600)
    assert early["planner"] > early["summarizer"]


@pytest.mark.parametrize(
    "bad",
    [
        {"sessions": 0},
        {"hours": 0},
        {"drift_weight": 1.5},
        {"slo_weights": (1.0,)},
        {"mean_turns_per_session": 0.5},
        {"gap_scale": 0.0},
    ],
)
def test_bad_params_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        SynthParams(**bad)


@pytest.mark.parametrize("rate", [0.05, 0.19, 0.5])
def test_the_handoff_rate_sets_the_share_of_turns_that_hand_off(rate: float) -> None:
    params = SynthParams(sessions=10, hours=8.0, handoff_rate=rate)
    records = synth_trace(demo_scenario(), params, np.random.default_rng(3))
    turns = len(requests(records)) - len({r.session for r in records})
    assert turns > 5_000  # a large trace: the binomial's sd is under 0.7 points at 50 %
    assert handoff_share(records) == pytest.approx(rate, abs=0.02)


def test_the_chain_alone_hands_off_on_about_half_the_turns(trace) -> None:
    # the figure the module docstring quotes for the demo's chain without a rate
    assert handoff_share(trace) == pytest.approx(0.541, abs=0.005)


@pytest.fixture(scope="module")
def fresh():
    params = SynthParams(sessions=6, hours=4.0, handoff_rate=0.3, context="fresh")
    return synth_trace(demo_scenario(), params, np.random.default_rng(5))


def test_fresh_handoffs_open_sub_agents_with_only_their_own_context(fresh) -> None:
    reqs = requests(fresh)
    roots = {r.session for r in reqs if "." not in r.session}
    subs = [r for r in reqs if "." in r.session]
    assert subs and roots
    first: dict[str, TraceRequest] = {}
    for r in reqs:
        first.setdefault(r.session, r)
    root_model = {s: first[s].model for s in roots}
    for session, opening in first.items():
        if session in roots:
            assert opening.parent is None
            continue
        # a sub-agent names who handed off to it, runs on another model than its root, and starts afresh
        assert opening.parent is not None and opening.parent.split(".")[0] == session.split(".")[0]
        assert opening.model != root_model[session.split(".")[0]]
    for r in reqs:
        if r.session in first and r is not first[r.session]:
            assert r.parent is None  # only a sub-agent's first request names its parent
        # a sub-agent serves one model; every turn of the root is on the root's model
        assert r.model == first[r.session].model
    # a sub-agent's history is its own turns only: far less than the whole session's by its first turn
    history: dict[str, int] = defaultdict(int)
    whole: dict[str, int] = defaultdict(int)
    for r in reqs:
        root = r.session.split(".")[0]
        if r is first[r.session] and r.session not in roots:
            assert history[r.session] == 0 and whole[root] > 0
        history[r.session] += r.input_tokens + r.output_tokens
        whole[root] += r.input_tokens + r.output_tokens


def test_fresh_and_shared_hand_off_as_often_and_every_sub_agent_ends(fresh) -> None:
    assert handoff_share(fresh) == pytest.approx(0.3, abs=0.03)
    ends = Counter(r.session for r in fresh if isinstance(r, TraceEnd))
    assert set(ends) == {r.session for r in fresh} and set(ends.values()) == {1}
    last_request = {r.session: r.t for r in requests(fresh)}
    end_at = {r.session: r.t for r in fresh if isinstance(r, TraceEnd)}
    assert all(end_at[s] >= t for s, t in last_request.items())


def test_the_replay_counts_a_fresh_trace_s_hand_offs_and_runs_a_workflow_a_turn_at_a_time(fresh) -> None:
    from planner_service.sim.engine import simulate
    from planner_service.sim.policies import create_policy

    head = [r for r in fresh if r.t < 900]
    result = simulate(demo_scenario(), head, create_policy("sleep-router"))
    reqs = requests(head)
    counted = sum(r.handoff for r in result.requests)
    assert counted == round(handoff_share(head) * (len(reqs) - len({r.session.split(".")[0] for r in reqs})))
    # a sub-agent and the session that handed off to it are one agent: one turn at a time, in trace order
    previous: dict[str, float] = {}
    for r in sorted(result.requests, key=lambda r: r.index):
        root = r.session.split(".")[0]
        if root in previous:
            assert r.admitted_at >= previous[root] - 1e-9
        previous[root] = r.done_at if r.state == "done" else r.failed_at
