"""Property tests: replans of the demo cluster under many sessions keep every capacity in every order.

The situation of a loaded service: the demo's first plan has landed (the
reasoner's engine restarted on two of n2's cards with its GPU share of
routed experts in equal halves on them), then many sessions arrive, most of them with a
request in flight for the reasoner, and the greedy plans again (with the
service's pins: engines that served recently stay where they are). Each
plan must pass the invariant checker, and its operations, run in random
orders that respect `depends_on` (an operation occupies its destination
when it starts, frees its source when it finishes; KV made by prefill comes
from nowhere), must keep every location within its capacity at every step
and end at the target.
"""

from __future__ import annotations

import dataclasses
import random
from types import MappingProxyType

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner_service.domain.demo import demo_scenario
from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.problem import Problem, Session
from planner_service.domain.scenario import Slo
from planner_service.domain.state import Kind, StateObject, Tier
from planner_service.planner.invariants import check_plan
from planner_service.planner.online import engines_in, pins
from planner_service.planner.operations import apply_operations
from planner_service.solver.registry import solve
from tests.property.test_plan_invariants import _run_interleaved

MODELS = ("planner", "coder", "reasoner", "air", "summarizer", "vision", "longctx")

sessions = st.lists(
    st.tuples(
        st.sampled_from(["reasoner"] * 4 + list(MODELS)),  # the reasoner most often, as in the load benchmark
        st.integers(100, 12_000),  # context tokens
        st.booleans(),  # a request in flight
        st.sampled_from(list(Slo)),
        st.integers(0, 19),  # user
    ),
    min_size=1,
    max_size=200,
)


def landed_demo() -> Problem:
    """The demo once its first plan's operations have all landed."""
    problem = problem_from_scenario(demo_scenario())
    first = solve(problem)
    residency = apply_operations(problem.residency, first.operations)
    return dataclasses.replace(problem, residency=MappingProxyType(residency))


def with_sessions(problem: Problem, drawn: list[tuple[str, int, bool, Slo, int]]) -> Problem:
    added = {
        f"load-{i}": Session(f"load-{i}", f"user-{user}", slo, model, active, tokens)
        for i, (model, tokens, active, slo, user) in enumerate(drawn)
    }
    next_model = {sid: {s.model: 1.0} for sid, s in added.items()}
    return dataclasses.replace(
        problem,
        sessions=MappingProxyType({**problem.sessions, **added}),
        next_model=MappingProxyType({**problem.next_model, **next_model}),
    )


def service_pins(problem: Problem) -> dict[str, dict[str, str]]:
    """The greedy's pins as the service sets them: every engine that runs now served a moment ago."""
    now = 1_000.0
    last_used = {model: now for model in problem.models}
    nodes, precisions = pins(engines_in(problem, last_used), set(), now, problem.constants.horizon_seconds)
    return {"nodes": nodes, "precisions": precisions}


LANDED = landed_demo()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sessions, st.randoms(use_true_random=False))
def test_replans_of_the_loaded_demo_keep_capacity_in_every_order(
    drawn: list[tuple[str, int, bool, Slo, int]], rng: random.Random
) -> None:
    problem = with_sessions(LANDED, drawn)
    for options in (service_pins(problem), {}):
        plan = solve(problem, "greedy", **options)
        assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
        _run_interleaved(problem, plan.operations, rng, plan.placement)


def test_a_running_moe_engine_keeps_its_expert_share_and_its_kv_fits_beside_it() -> None:
    """The case the load benchmark hit: 60 requests in flight for the reasoner on n1. The greedy gave the KV
    room that it took from the running engine's experts, which stay (a launch setting), so the plan put
    more on each of n1's L40s than they hold."""
    drawn = [("reasoner", 2_000 + 97 * i, True, list(Slo)[i % 3], i % 20) for i in range(60)]
    problem = with_sessions(LANDED, drawn)
    plan = solve(problem, "greedy", **service_pins(problem))
    assert [e for e in check_plan(problem, plan.placement, plan.operations, plan.unserved) if "capacity" in e] == []


def test_a_running_moe_engine_keeps_its_experts_in_equal_shares_on_its_own_gpus() -> None:
    """vLLM gives every tensor-parallel rank the same GPU expert share: the landed reasoner's experts lie on
    the GPUs of its weights, equal, none beside them (where the coder's weights and pool fill n2-g0 and n2-g1).
    One new coder request: its KV, placed before the reasoner, leaves them as they are while the reasoner runs."""
    experts = StateObject.experts("reasoner")
    on_gpus = {loc: b for (obj, loc), b in LANDED.residency.items() if obj == experts and loc.tier is Tier.GPU}
    weights = {loc for (obj, loc) in LANDED.residency if obj.model == "reasoner" and obj.kind is Kind.WEIGHTS}
    assert set(on_gpus) == {loc for loc in weights if loc.tier is Tier.GPU} and len(set(on_gpus.values())) == 1
    problem = with_sessions(LANDED, [("coder", 1_000, True, Slo.INTERACTIVE, 0)])
    plan = solve(problem, "greedy", **service_pins(problem))
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    assert {loc: plan.placement.get((experts, loc)) for loc in on_gpus} == on_gpus
