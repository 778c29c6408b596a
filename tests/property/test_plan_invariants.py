"""Property tests: every greedy plan over random scenarios is sound, and planning is deterministic.

Scenarios come from `random_scenario` (sizes and seed drawn by hypothesis);
some nodes lose capabilities, and some serve only the models of their engines, some of those on
fixed GPUs. Besides `check_plan`, the operations are run
in random interleavings that respect `depends_on` (an operation occupies its
destination when it starts and frees its source when it finishes), and
capacities and last copies are checked at every step.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections import defaultdict
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner_service.domain.generate import GPUS_PER_NODE, random_scenario
from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.problem import Problem, is_stand_in
from planner_service.domain.scenario import Capability, Scenario, parse_scenario
from planner_service.domain.state import Kind, Location, StateObject
from planner_service.planner.invariants import check_plan
from planner_service.planner.online import RecentLoad, engines_in, for_real, pins
from planner_service.planner.operations import Action, Operation
from planner_service.solver.registry import solve

MAX_GPUS = 12
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

capability_sets = st.sets(st.sampled_from(list(Capability))).map(lambda caps: sorted(c.value for c in caps))


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    seed = draw(st.integers(0, 2**32 - 1))
    gpus = draw(st.integers(1, MAX_GPUS))
    scenario = random_scenario(np.random.default_rng(seed), gpus, draw(st.integers(1, 6)), draw(st.integers(0, 30)))
    node_caps = draw(st.lists(st.none() | capability_sets, min_size=-(-gpus // GPUS_PER_NODE), max_size=MAX_GPUS))
    data = scenario.model_dump(mode="json")
    models = [m["id"] for m in data["models"]]
    # more capability draws than nodes: the extra ones go unused
    for node, caps in zip(data["cluster"]["nodes"], node_caps, strict=False):
        if caps is not None:  # None keeps every capability
            node["capabilities"] = caps
        # engines: none listed (any model, any group), or the models it serves, each on fixed GPUs or any
        own = [g["id"] for g in node["gpus"]]
        engines = draw(
            st.none() | st.lists(st.tuples(st.sampled_from(models), st.sets(st.sampled_from(own))), max_size=3)
        )
        if engines is not None:
            node["engines"] = [{"model": m, "gpus": sorted(g)} for m, g in dict(engines).items()]
    return parse_scenario(data)


def plan_json(problem: Problem) -> str:
    out = solve(problem).to_json()
    out.pop("solve_seconds")
    return json.dumps(out, sort_keys=True)


@SETTINGS
@given(scenarios())
def test_greedy_plans_pass_the_invariant_checker(scenario: Scenario) -> None:
    problem = problem_from_scenario(scenario)
    plan = solve(problem)
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    assert all(why for why in plan.unserved.values())


@SETTINGS
@given(scenarios(), st.randoms(use_true_random=False))
def test_every_interleaving_of_the_operations_is_safe(scenario: Scenario, rng: random.Random) -> None:
    problem = problem_from_scenario(scenario)
    plan = solve(problem)
    _run_interleaved(problem, plan.operations, rng, plan.placement)


@settings(max_examples=40, deadline=None)
@given(scenarios())
def test_same_input_same_plan(scenario: Scenario) -> None:
    problem = problem_from_scenario(scenario)
    first = plan_json(problem)
    assert plan_json(problem) == first
    again = problem_from_scenario(parse_scenario(json.loads(scenario.model_dump_json())))
    assert plan_json(again) == first


def _run_interleaved(
    problem: Problem, ops: list[Operation], rng: random.Random, target: Mapping[tuple[StateObject, Location], int]
) -> None:
    """Start and finish operations in a random order allowed by `depends_on`, checking every step, and end at
    `target`."""
    placement = dict(problem.residency)
    occupied: dict = defaultdict(int)
    for (_, loc), nbytes in placement.items():
        occupied[loc] += nbytes
    had_copy = _complete_copies(problem, placement)
    by_id = {op.id: op for op in ops}
    done: set[str] = set()
    running: list[Operation] = []
    waiting = list(ops)
    while waiting or running:
        ready = [op for op in waiting if all(d in done for d in op.depends_on)]
        assert ready or running, "operations wait on each other"
        if ready and (not running or rng.random() < 0.5):
            op = rng.choice(ready)
            waiting.remove(op)
            running.append(op)
            if op.dest is not None:
                occupied[op.dest] += op.bytes
                assert occupied[op.dest] <= problem.capacity_of(op.dest), f"{op.id} overfills {op.dest.label()}"
            continue
        op = running.pop(rng.randrange(len(running)))
        if op.dest is not None:
            placement[(op.object, op.dest)] = placement.get((op.object, op.dest), 0) + op.bytes
        if op.source is not None and not op.keep_source:
            placement[(op.object, op.source)] -= op.bytes
            occupied[op.source] -= op.bytes
            readers = [r.id for r in ops if r.keep_source and r.source == op.source and r.object == op.object]
            assert all(r in done or r == op.id for r in readers), f"{op.id} frees a source still being read"
        done.add(op.id)
        if op.action is Action.DROP:
            key = (op.object, problem.node_of(op.source))
            if key in had_copy:
                assert key in _complete_copies(problem, placement), (
                    f"{op.id} drops the last copy of {op.object.label()}"
                )
    assert len(done) == len(by_id)
    assert {k: v for k, v in placement.items() if v} == {k: v for k, v in target.items() if v}


def _complete_copies(problem: Problem, placement: dict) -> set:
    """(object, node) pairs with a complete copy of weights or experts on one tier of the node."""
    per_tier: dict = defaultdict(int)
    for (obj, loc), nbytes in placement.items():
        if obj.kind is not Kind.KV:
            per_tier[(obj, problem.node_of(loc), loc.tier)] += nbytes
    return {(obj, node) for (obj, node, _), nbytes in per_tier.items() if nbytes >= problem.size_of(obj) > 0}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.lists(st.tuples(st.integers(0, 5), st.integers(1, 40_000)), max_size=12), st.integers(0, 10))
def test_online_plans_for_the_real_sessions_pass_the_invariant_checker(
    scenario: Scenario, requests: list[tuple[int, int]], seats: int
) -> None:
    """A plan made with stand-ins for a recent load and the serving engines pinned, taken for the real
    sessions alone (`online.for_real`), is as sound as any plan on the real problem."""
    real = problem_from_scenario(scenario)
    models = sorted(real.models)
    load = RecentLoad(window_seconds=3600.0, seats=seats)
    for t, (index, tokens) in enumerate(requests):
        load.add(float(t), models[index % len(models)], tokens)
    in_flight: dict[str, int] = defaultdict(int)
    for session in real.sessions.values():
        in_flight[session.model] += session.active
    stand_ins = {s.id: s for s in load.stand_ins(100.0, in_flight)}
    sessions = {**real.sessions, **stand_ins}
    online = dataclasses.replace(
        real,
        sessions=MappingProxyType(sessions),
        next_model=MappingProxyType({**real.next_model, **{sid: {s.model: 1.0} for sid, s in stand_ins.items()}}),
    )
    nodes, precisions = pins(engines_in(online, {m: 90.0 for m in models}), set(), now=100.0, window_seconds=300.0)
    plan = for_real(online, solve(online, nodes=nodes, precisions=precisions))
    assert check_plan(real, plan.placement, plan.operations, plan.unserved) == []
    assert not any(is_stand_in(key[0].session) for key in plan.placement)
    assert set(plan.unserved) <= set(real.sessions)
