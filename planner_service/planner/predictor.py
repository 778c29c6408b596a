"""Switch predictor: which model a session will ask for next, and when.

A first-order Markov model of hand-offs over a sliding time window, so it
follows hour-scale drift (coder-heavy mornings, reasoner-heavy afternoons).
Counts in the window are smoothed with pseudo-counts from the priors:

    P(next = b | current = a) = (n_ab + w * prior_ab + alpha) / (n_a + w + alpha * |M|)

where n_ab counts hand-offs a -> b observed in the window (staying on the
same model counts as a -> a), prior_ab is the prior row (normalized), w the
prior's weight in pseudo-observations and alpha a Laplace term, so the model
answers sensibly from zero observations and never rules a model out.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from planner_service.domain.problem import Problem, compile_problem
from planner_service.domain.scenario import PredictorIn, Scenario


class SwitchPredictor:
    def __init__(
        self,
        models: Sequence[str],
        priors: PredictorIn | None = None,
        *,
        window_seconds: float = 3600.0,
        prior_weight: float = 10.0,
        alpha: float = 0.1,
    ) -> None:
        self._models = list(dict.fromkeys(models))
        self._priors = priors or PredictorIn()
        self._window_seconds = window_seconds
        self._prior_weight = prior_weight
        self._alpha = alpha
        self._handoffs: deque[tuple[float, str, str]] = deque()
        self._counts: Counter[tuple[str, str]] = Counter()
        self._from_counts: Counter[str] = Counter()
        self._gaps: deque[tuple[float, float]] = deque()

    @classmethod
    def from_priors(cls, priors: PredictorIn, models: Sequence[str]) -> SwitchPredictor:
        return cls(models, priors)

    @property
    def models(self) -> list[str]:
        return list(self._models)

    def add_model(self, model: str) -> None:
        if model not in self._models:
            self._models.append(model)

    def remove_model(self, model: str) -> None:
        if model in self._models:
            self._models.remove(model)

    # -- observations ------------------------------------------------------

    def observe_handoff(self, t: float, from_model: str, to_model: str) -> None:
        """A session's request on `to_model` after its previous one on `from_model`."""
        self._handoffs.append((t, from_model, to_model))
        self._counts[(from_model, to_model)] += 1
        self._from_counts[from_model] += 1
        self._expire(t)

    def observe_turn_gap(self, t: float, gap_seconds: float) -> None:
        self._gaps.append((t, gap_seconds))
        self._expire(t)

    def _expire(self, now: float) -> None:
        horizon = now - self._window_seconds
        while self._handoffs and self._handoffs[0][0] < horizon:
            _, a, b = self._handoffs.popleft()
            self._counts[(a, b)] -= 1
            self._from_counts[a] -= 1
        while self._gaps and self._gaps[0][0] < horizon:
            self._gaps.popleft()

    # -- predictions -------------------------------------------------------

    def _prior_row(self, current: str) -> dict[str, float]:
        row = {m: w for m, w in self._priors.handoff.get(current, {}).items() if m in self._models}
        total = sum(row.values())
        if total > 0:
            return {m: w / total for m, w in row.items()}
        others = [m for m in self._models if m != current]
        stay = self._priors.stay_probability if others else 1.0
        prior = {m: (1.0 - stay) / len(others) for m in others}
        if current in self._models:
            prior[current] = stay
        return prior

    def next_model_probs(self, current: str, now: float | None = None) -> dict[str, float]:
        if now is not None:
            self._expire(now)
        prior = self._prior_row(current)
        n_from = self._from_counts[current]
        w, alpha = self._prior_weight, self._alpha
        denominator = n_from + w + alpha * len(self._models)
        return {m: (self._counts[(current, m)] + w * prior.get(m, 0.0) + alpha) / denominator for m in self._models}

    def predict_sessions(self, current: Mapping[str, str], now: float | None = None) -> dict[str, dict[str, float]]:
        """Next-model probabilities for each session, given the model it is on now."""
        rows: dict[str, dict[str, float]] = {}
        return {s: rows.setdefault(m, self.next_model_probs(m, now)) for s, m in current.items()}

    def turn_gap_seconds(self, quantile: float = 0.5) -> float:
        """A quantile of the observed turn gaps in the window (the prior mean when none)."""
        if not self._gaps:
            return self._priors.turn_gap_seconds
        return float(np.quantile([g for _, g in self._gaps], quantile))

    def observations(self) -> int:
        return len(self._handoffs)


def problem_from_scenario(scenario: Scenario, predictor: SwitchPredictor | None = None) -> Problem:
    """Compile a scenario with next-model predictions from `predictor` (default: the scenario's priors)."""
    predictor = predictor or SwitchPredictor.from_priors(scenario.predictor, [m.id for m in scenario.models])
    return compile_problem(scenario, predictor.predict_sessions({s.id: s.model for s in scenario.sessions}))


def handoffs_from_history(history: Iterable[tuple[float, str]]) -> list[tuple[float, str, str]]:
    """Turn one session's (time, model) request history into hand-off observations."""
    out: list[tuple[float, str, str]] = []
    previous: str | None = None
    for t, model in history:
        if previous is not None:
            out.append((t, previous, model))
        previous = model
    return out
