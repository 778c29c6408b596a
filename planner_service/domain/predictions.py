"""Next-model probabilities from a scenario's priors, and the scenario compiled with them.

The switch predictor (`planner/predictor.py`) counts the hand-offs it observes
and smooths them with pseudo-counts from the priors:

    P(next = b | current = a) = (n_ab + w * prior_ab + alpha) / (n_a + w + alpha * |M|)

where n_ab counts hand-offs a -> b observed (staying on the same model counts
as a -> a), prior_ab is the prior row (normalized), w the prior's weight in
pseudo-observations and alpha a Laplace term, so the answer is sensible from
zero observations and never rules a model out. With nothing observed it is the
priors' own answer, which `problem_from_scenario` compiles a scenario with.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from planner_service.domain.problem import Problem, compile_problem
from planner_service.domain.scenario import PredictorIn, Scenario

PRIOR_WEIGHT = 10.0  # w: the prior's weight, in pseudo-observations
ALPHA = 0.1  # the Laplace term


class SessionPredictor(Protocol):
    """Next-model probabilities for each session, given the model it is on now (the switch predictor)."""

    def predict_sessions(self, current: Mapping[str, str], now: float | None = None) -> dict[str, dict[str, float]]: ...


def prior_row(priors: PredictorIn, models: Sequence[str], current: str) -> dict[str, float]:
    """prior_a: the priors' hand-off row from `current`, normalized; `stay_probability` where none is given."""
    row = {m: w for m, w in priors.handoff.get(current, {}).items() if m in models}
    total = sum(row.values())
    if total > 0:
        return {m: w / total for m, w in row.items()}
    others = [m for m in models if m != current]
    stay = priors.stay_probability if others else 1.0
    prior = {m: (1.0 - stay) / len(others) for m in others}
    if current in models:
        prior[current] = stay
    return prior


def smoothed_row(
    prior: Mapping[str, float],
    models: Sequence[str],
    handoffs: Callable[[str], int],
    handoffs_from: int,
    prior_weight: float = PRIOR_WEIGHT,
    alpha: float = ALPHA,
) -> dict[str, float]:
    """P(next = b | current = a) for every model b: `handoffs(b)` is n_ab, `handoffs_from` n_a."""
    denominator = handoffs_from + prior_weight + alpha * len(models)
    return {m: (handoffs(m) + prior_weight * prior.get(m, 0.0) + alpha) / denominator for m in models}


class PriorPredictor:
    """The priors alone: what the switch predictor answers before it has observed anything."""

    def __init__(self, priors: PredictorIn, models: Sequence[str]) -> None:
        self._priors = priors
        self._models = list(dict.fromkeys(models))

    def next_model_probs(self, current: str) -> dict[str, float]:
        return smoothed_row(prior_row(self._priors, self._models, current), self._models, lambda _: 0, 0)

    def predict_sessions(self, current: Mapping[str, str], now: float | None = None) -> dict[str, dict[str, float]]:
        rows: dict[str, dict[str, float]] = {}
        return {s: rows.setdefault(m, self.next_model_probs(m)) for s, m in current.items()}


def problem_from_scenario(scenario: Scenario, predictor: SessionPredictor | None = None) -> Problem:
    """Compile a scenario with next-model predictions from `predictor` (default: the scenario's priors)."""
    predictor = predictor or PriorPredictor(scenario.predictor, [m.id for m in scenario.models])
    return compile_problem(scenario, predictor.predict_sessions({s.id: s.model for s in scenario.sessions}))
