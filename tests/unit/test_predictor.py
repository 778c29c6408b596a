"""The switch predictor: priors from zero observations, learning, drift out of the window, turn gaps."""

from __future__ import annotations

import math

import pytest

from planner_service.domain.demo import demo_scenario
from planner_service.domain.predictions import PriorPredictor, problem_from_scenario
from planner_service.domain.scenario import PredictorIn
from planner_service.planner.predictor import SwitchPredictor, handoffs_from_history

MODELS = ["a", "b", "c"]


def test_zero_observations_follow_the_stay_prior_and_sum_to_one() -> None:
    p = SwitchPredictor(MODELS).next_model_probs("a")
    assert sum(p.values()) == pytest.approx(1.0)
    # (w * prior + alpha) / (w + alpha * |M|) with w = 10, alpha = 0.1, stay 0.6, others 0.2 each
    assert p["a"] == pytest.approx((10 * 0.6 + 0.1) / 10.3)
    assert p["b"] == pytest.approx((10 * 0.2 + 0.1) / 10.3)
    assert p["b"] == pytest.approx(p["c"])


def test_handoff_priors_shape_the_row() -> None:
    priors = PredictorIn(handoff={"a": {"b": 3.0, "c": 1.0}})
    p = SwitchPredictor(MODELS, priors).next_model_probs("a")
    assert sum(p.values()) == pytest.approx(1.0)
    assert p["b"] > p["c"] > p["a"] > 0  # never ruled out (Laplace term)


def test_observations_shift_the_probabilities() -> None:
    predictor = SwitchPredictor(MODELS)
    before = predictor.next_model_probs("a", now=0.0)
    for t in range(50):
        predictor.observe_handoff(float(t), "a", "c")
    after = predictor.next_model_probs("a", now=50.0)
    assert sum(after.values()) == pytest.approx(1.0)
    assert after["c"] > before["c"] and after["c"] > after["a"]
    assert after["c"] == pytest.approx((50 + 10 * 0.2 + 0.1) / (50 + 10.3))


def test_old_observations_expire_after_the_window() -> None:
    predictor = SwitchPredictor(MODELS, window_seconds=3600)
    for t in range(20):
        predictor.observe_handoff(float(t), "a", "c")
    assert predictor.observations() == 20
    # an hour later the morning's hand-offs are gone and the afternoon's count
    predictor.observe_handoff(4000.0, "a", "b")
    assert predictor.observations() == 1
    drifted = predictor.next_model_probs("a", now=4000.0)
    assert drifted["b"] > drifted["c"]
    assert predictor.next_model_probs("a", now=9000.0) == pytest.approx(SwitchPredictor(MODELS).next_model_probs("a"))


def test_turn_gap_quantiles() -> None:
    predictor = SwitchPredictor(MODELS, PredictorIn(turn_gap_seconds=12.0), window_seconds=1000)
    assert predictor.turn_gap_seconds(0.5) == 12.0  # the prior without observations
    for i in range(1, 101):
        predictor.observe_turn_gap(float(i), float(i))
    assert predictor.turn_gap_seconds(0.5) == pytest.approx(50.5)
    assert predictor.turn_gap_seconds(0.9) == pytest.approx(90.1)
    predictor.observe_turn_gap(2000.0, 5.0)  # the rest leave the window
    assert predictor.turn_gap_seconds(0.5) == 5.0


def test_sessions_get_their_current_models_row() -> None:
    predictor = SwitchPredictor(MODELS)
    rows = predictor.predict_sessions({"s1": "a", "s2": "b"})
    assert rows["s1"] == predictor.next_model_probs("a")
    assert rows["s2"]["b"] == pytest.approx(rows["s1"]["a"])


def test_handoffs_from_history() -> None:
    assert handoffs_from_history([(0.0, "a"), (1.0, "a"), (2.0, "b")]) == [(1.0, "a", "a"), (2.0, "a", "b")]


def test_problem_from_scenario_predicts_every_session() -> None:
    scenario = demo_scenario()
    problem = problem_from_scenario(scenario)
    assert set(problem.next_model) == {s.id for s in scenario.sessions}
    for row in problem.next_model.values():
        assert sum(row.values()) == pytest.approx(1.0)


def test_scenario_priors_are_the_predictors_answer_before_it_observes() -> None:
    scenario = demo_scenario()
    models = [m.id for m in scenario.models]
    current = {s.id: s.model for s in scenario.sessions}
    switch = SwitchPredictor.from_priors(scenario.predictor, models)
    assert PriorPredictor(scenario.predictor, models).predict_sessions(current) == switch.predict_sessions(current)
    assert problem_from_scenario(scenario).next_model == switch.predict_sessions(current)
    switch.observe_handoff(0.0, models[0], models[-1])
    assert problem_from_scenario(scenario, switch).next_model == switch.predict_sessions(current)
    assert problem_from_scenario(scenario).next_model != switch.predict_sessions(current)


def test_next_turn_by_hand() -> None:
    """On coder: 3 hand-offs and 1 session ended after it, P(more) = (3 + 0.1) / (3 + 0.1 + 1) = 31/41; gaps 10, 20
    and 400 s, over a 300 s horizon: 2/3 come within it, E[min(gap, 300)] = (10 + 20 + 300) / 3 = 110 s.
    within = 31/41 * 2/3 = 62/123; hold = 31/41 * 110 + 10/41 * 300 = 6410/41 s."""
    p = SwitchPredictor(["coder", "reasoner"])
    for t, gap in ((1.0, 10.0), (2.0, 20.0), (3.0, 400.0)):
        p.observe_handoff(t, "coder", "reasoner")
        p.observe_turn_gap(t, gap)
    p.observe_session_end(4.0, "coder")
    within, hold = p.next_turn("coder", 300.0)
    assert within == pytest.approx(62 / 123)
    assert hold == pytest.approx(6410 / 41)
    # nothing ended on reasoner: every session on it sends another request
    assert p.next_turn("reasoner", 300.0).within == pytest.approx(2 / 3)
    # an hour later the window has forgotten the end (and everything else): the priors' mean gap of 30 s as an
    # exponential, P(gap <= 300) = 1 - e^-10, E[min(gap, 300)] = 30 * (1 - e^-10)
    within, hold = p.next_turn("coder", 300.0, now=4000.0)
    assert within == pytest.approx(-math.expm1(-10.0))
    assert hold == pytest.approx(30 * -math.expm1(-10.0))
