"""`with_state` gives the problem `compile_problem` gives for the same scenario, without compiling it again:
the live service compiles its catalog once and builds every replan's problem this way."""

import numpy as np
import pytest

from planner_service.domain.demo import demo_scenario
from planner_service.domain.generate import random_scenario
from planner_service.domain.problem import Session, compile_problem, with_state
from planner_service.domain.scenario import ResidencyIn, Scenario, ScenarioError
from planner_service.domain.state import Location, StateObject, placement_to_json


def parts(scenario: Scenario):
    catalog = compile_problem(scenario.model_copy(update={"sessions": [], "residency": []}), {})
    full = compile_problem(scenario, {})
    return catalog, full


def sessions_of(scenario: Scenario) -> list[Session]:
    return [Session(s.id, s.user, s.slo, s.model, s.active, s.context_tokens) for s in scenario.sessions]


@pytest.mark.parametrize("seed", range(5))
def test_with_state_equals_a_full_compile(seed) -> None:
    scenario = random_scenario(np.random.default_rng(seed), 8, 4, 30)
    catalog, full = parts(scenario)
    next_model = {s.id: {s.model: 1.0} for s in scenario.sessions}
    built = with_state(catalog, sessions_of(scenario), full.residency, next_model)
    assert built == compile_problem(scenario, next_model)
    # in the order of a scenario whose residency is `placement_to_json`'s, as the service's always was: the
    # greedy breaks ties by it
    ordered = scenario.model_copy(
        update={"residency": [ResidencyIn.model_validate(e) for e in placement_to_json(full.residency)]}
    )
    assert list(built.residency) == list(compile_problem(ordered, next_model).residency)
    assert list(built.sessions) == [s.id for s in scenario.sessions]


def test_with_state_refuses_what_a_compile_refuses() -> None:
    scenario = demo_scenario()
    catalog, full = parts(scenario)
    sessions = sessions_of(scenario)
    gpu = next(iter(catalog.gpus.values()))
    obj, _ = next(iter(full.residency))
    over = {**full.residency, (obj, Location.gpu(gpu.id)): gpu.capacity_bytes + 1}
    with pytest.raises(ScenarioError, match="more than"):
        with_state(catalog, sessions, over, {})
    with pytest.raises(ScenarioError, match="unknown gpu location"):
        with_state(catalog, sessions, {(obj, Location.gpu("nowhere")): 1}, {})
    with pytest.raises(ScenarioError, match="unknown session"):
        with_state(catalog, sessions, {(StateObject.kv(obj.model, "ghost"), Location.host(gpu.node)): 1}, {})
    with pytest.raises(ScenarioError, match="not served at"):
        with_state(catalog, sessions, {(StateObject.weights(obj.model, "fp4x"), Location.host(gpu.node)): 1}, {})
