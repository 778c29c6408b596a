"""Lateness: the weight of predicted requests that miss their SLO target, by bisection, against a direct count."""

from __future__ import annotations

import numpy as np
import pytest

from planner_service.domain.generate import random_scenario
from planner_service.domain.predictions import problem_from_scenario
from planner_service.planner.costs import causal_pairs
from planner_service.planner.lateness import Lateness
from planner_service.planner.objective import Demand


def _demand(context: list[float], target: list[float]) -> Demand:
    n = len(context)
    return Demand([], {}, {"m": 0}, np.ones((1, n)), np.ones(n), np.array(target), np.array(context))


def test_hand_checked_sessions() -> None:
    # targets 2 s and 5 s; contexts 1,000 / 3,000 tokens at 2 s, 1,000 / 8,000 at 5 s; weights 1, 2, 4, 8
    demand = _demand([1000, 3000, 1000, 8000], [2.0, 2.0, 5.0, 5.0])
    lateness = Lateness(demand, np.array([[1.0, 2.0, 4.0, 8.0]]))
    # 1 ms per token: 1 s, 3 s (late), 1 s, 8 s (late)
    assert lateness.weight_late(0, 0.001) == 2.0 + 8.0
    # and a 1.5 s wait first: 2.5 s (late), 4.5 s (late), 2.5 s, 9.5 s (late)
    assert lateness.weight_late(0, 0.001, 1.5) == 1.0 + 2.0 + 8.0
    # no re-prefill: late only where the wait alone passes the target
    assert lateness.weight_late(0, 0.0, 3.0) == 1.0 + 2.0
    assert lateness.weight_late(0, 0.0, 2.0) == 0.0  # exactly on target is not late


def test_attention_makes_long_contexts_late() -> None:
    # 0.1 ms per token and 0.1 us per attention pair (c (c + 1) / 2 of them): 1,000 tokens take 0.1 + 0.05 s,
    # 3,000 take 0.3 + 0.45 s, 8,000 take 0.8 + 3.2 s; linear alone, none would pass a 2 s target
    demand = _demand([1000, 3000, 1000, 8000], [2.0, 2.0, 2.0, 2.0])
    lateness = Lateness(demand, np.array([[1.0, 2.0, 4.0, 8.0]]))
    assert lateness.weight_late(0, 1e-4) == 0.0
    assert lateness.weight_late(0, 1e-4, 0.0, 1e-7) == 8.0
    assert lateness.weight_late(0, 1e-4, 1.5, 1e-7) == 2.0 + 8.0  # 0.75 s after a 1.5 s wait: late too


@pytest.mark.parametrize("seed", range(5))
def test_agrees_with_counting_every_session(seed: int) -> None:
    problem = problem_from_scenario(random_scenario(np.random.default_rng(seed), 16, 7, 100))
    demand = Demand.of(problem)
    weighted = demand.q * demand.slo_weight
    lateness = Lateness(demand, weighted)
    rng = np.random.default_rng(seed)
    for _ in range(200):
        row = int(rng.integers(len(demand.row)))
        per_token = float(rng.choice([0.0, 1e-5, 1e-4, 1e-3]) * rng.random())
        delay = float(rng.choice([0.0, 1.0, 5.0, 40.0]) * rng.random())
        per_pair = float(rng.choice([0.0, 1e-9, 1e-8]) * rng.random())
        late = delay + per_token * demand.context + per_pair * causal_pairs(demand.context, 0) > demand.slo_target
        assert lateness.weight_late(row, per_token, delay, per_pair) == pytest.approx(
            float(weighted[row][late].sum()), abs=1e-9
        )
