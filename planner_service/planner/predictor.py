"""Switch predictor: which model a session will ask for next, and when.

A first-order Markov model of hand-offs over a sliding time window, so it
follows hour-scale drift (coder-heavy mornings, reasoner-heavy afternoons).
Counts in the window are smoothed with pseudo-counts from the priors
(`domain/predictions.py` writes the formula out and holds the priors' part):

    P(next = b | current = a) = (n_ab + w * prior_ab + alpha) / (n_a + w + alpha * |M|)

That row is conditional on a next request coming at all, whenever it comes. When it comes is `next_turn`:
a session on a ends after its request instead of sending another with

    P(more | a) = (n_a + alpha) / (n_a + e_a + alpha)       (e_a: sessions ended on a; 1 with nothing seen)

and the next request's gap follows the observed turn gaps (an exponential of the priors' mean gap while none
is observed: the distribution that assumes nothing beyond that mean).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from planner_service.domain.predictions import ALPHA, PRIOR_WEIGHT, prior_row, smoothed_row
from planner_service.domain.scenario import PredictorIn


class NextTurn(NamedTuple):
    """When a session's next request comes, seen from now and over `horizon` seconds."""

    within: float  # P(its next request comes within the horizon): P(more | a) * P(gap <= horizon)
    hold_seconds: float  # E[min(time to that request, horizon)], a session that ends counting the whole horizon


class SwitchPredictor:
    def __init__(
        self,
        models: Sequence[str],
        priors: PredictorIn | None = None,
        *,
        window_seconds: float = 3600.0,
        prior_weight: float = PRIOR_WEIGHT,
        alpha: float = ALPHA,
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
        self._ends: deque[tuple[float, str]] = deque()
        self._end_counts: Counter[str] = Counter()

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

    def observe_session_end(self, t: float, last_model: str) -> None:
        """A session ended after its last request, on `last_model`: no next request came."""
        self._ends.append((t, last_model))
        self._end_counts[last_model] += 1
        self._expire(t)

    def _expire(self, now: float) -> None:
        horizon = now - self._window_seconds
        while self._handoffs and self._handoffs[0][0] < horizon:
            _, a, b = self._handoffs.popleft()
            self._counts[(a, b)] -= 1
            self._from_counts[a] -= 1
        while self._gaps and self._gaps[0][0] < horizon:
            self._gaps.popleft()
        while self._ends and self._ends[0][0] < horizon:
            self._end_counts[self._ends.popleft()[1]] -= 1

    # -- predictions -------------------------------------------------------

    def next_model_probs(self, current: str, now: float | None = None) -> dict[str, float]:
        if now is not None:
            self._expire(now)
        return smoothed_row(
            prior_row(self._priors, self._models, current),
            self._models,
            lambda m: self._counts[(current, m)],
            self._from_counts[current],
            self._prior_weight,
            self._alpha,
        )

    def predict_sessions(self, current: Mapping[str, str], now: float | None = None) -> dict[str, dict[str, float]]:
        """Next-model probabilities for each session, given the model it is on now."""
        rows: dict[str, dict[str, float]] = {}
        return {s: rows.setdefault(m, self.next_model_probs(m, now)) for s, m in current.items()}

    def turn_gap_seconds(self, quantile: float = 0.5) -> float:
        """A quantile of the observed turn gaps in the window (the prior mean when none)."""
        if not self._gaps:
            return self._priors.turn_gap_seconds
        return float(np.quantile([g for _, g in self._gaps], quantile))

    def next_turn(self, current: str, horizon_seconds: float, now: float | None = None) -> NextTurn:
        """`NextTurn` of a session whose last request was on `current` (module doc):

            within = P(more | a) * P(gap <= H)
            hold   = P(more | a) * E[min(gap, H)] + (1 - P(more | a)) * H
        over the window's gaps, or an exponential of the priors' mean gap mu while none is observed:
        P(gap <= H) = 1 - exp(-H / mu), E[min(gap, H)] = mu * (1 - exp(-H / mu))."""
        if now is not None:
            self._expire(now)
        more = self._from_counts[current] + self._alpha
        more /= more + self._end_counts[current]
        horizon = horizon_seconds
        if self._gaps:
            gaps = np.fromiter((g for _, g in self._gaps), float, len(self._gaps))
            arrives, held = float(np.mean(gaps <= horizon)), float(np.mean(np.minimum(gaps, horizon)))
        else:
            mean = self._priors.turn_gap_seconds
            arrives = -math.expm1(-horizon / mean)
            held = mean * arrives
        return NextTurn(more * arrives, more * held + (1.0 - more) * horizon)

    def observations(self) -> int:
        return len(self._handoffs)


def handoffs_from_history(history: Iterable[tuple[float, str]]) -> list[tuple[float, str, str]]:
    """Turn one session's (time, model) request history into hand-off observations."""
    out: list[tuple[float, str, str]] = []
    previous: str | None = None
    for t, model in history:
        if previous is not None:
            out.append((t, previous, model))
        previous = model
    return out
