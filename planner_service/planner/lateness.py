"""Which predicted requests of a model miss their SLO target, priced in O(log sessions) per question.

A predicted request of session s on model m waits `delay` seconds for the
weights, then re-prefills the session's history of `c_s` tokens, as the
evaluator prices it (`costs.prefill_seconds`: `per_token` seconds per token
and `per_pair` per attention pair, c_s (c_s + 1) / 2 pairs from scratch); it
misses its target when

    delay + per_token * c_s + per_pair * c_s (c_s + 1) / 2 > target_s.

The left side grows with c_s, so the sessions late are those whose context
exceeds the root c* of equality (for per_pair > 0, of the quadratic
a c^2 + b c = target - delay with a = per_pair / 2, b = per_token + per_pair / 2).
The greedy asks this for many (model, group) pairs. Per SLO class (one
target each) the sessions are sorted by context once, and per model the SLO-
and probability-weighted requests are summed from the longest context down,
so a question is one bisection per class.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from planner_service.planner.objective import Demand


def longest_in_time(budget: float, per_token: float, per_pair: float) -> float:
    """The context c* at which a re-prefill takes exactly `budget` seconds (`per_token` seconds per token,
    `per_pair` per attention pair, c (c + 1) / 2 pairs): longer contexts take longer. Infinite where a
    re-prefill costs nothing; negative where the budget is."""
    if per_pair > 0:
        a, b = per_pair / 2, per_token + per_pair / 2
        # the positive root of a c^2 + b c - budget, written without cancellation (b > 0)
        disc = b * b + 4 * a * budget
        if disc < 0:
            return -1.0
        return 2 * budget / (b + math.sqrt(disc))
    if per_token > 0:
        return budget / per_token
    return math.inf if budget >= 0 else -1.0


class Lateness:
    """`weight_late(row, per_token, delay, per_pair)`: sum of q(s, m) * w_s over the sessions late (see the
    module)."""

    def __init__(self, demand: Demand, weighted: np.ndarray) -> None:
        self._weighted = weighted  # [models x sessions] SLO weight * probability of the next request
        self._classes: list[tuple[float, np.ndarray, list[float]]] = []  # (target, sessions by context, contexts)
        for target in sorted(set(demand.slo_target.tolist())):
            members = np.flatnonzero(demand.slo_target == target)
            order = members[np.argsort(demand.context[members], kind="stable")]
            self._classes.append((target, order, demand.context[order].tolist()))
        self._tails: list[np.ndarray] = []  # per class, [models x sessions + 1]: weight of the sessions from i on

    def weight_late(self, row: int, per_token: float, delay: float = 0.0, per_pair: float = 0.0) -> float:
        if not self._tails:  # on first use: all models at once (a numpy call costs more than its arithmetic here)
            for _, order, _ in self._classes:
                tail = np.zeros((self._weighted.shape[0], len(order) + 1))
                tail[:, :-1] = self._weighted[:, order[::-1]].cumsum(axis=1)[:, ::-1]
                self._tails.append(tail)
        late = 0.0
        for (target, _, contexts), tail in zip(self._classes, self._tails, strict=True):
            if per_token > 0 or per_pair > 0:
                longest = longest_in_time(target - delay, per_token, per_pair)
                late += float(tail[row, bisect.bisect_right(contexts, longest)])
            elif delay > target:
                late += float(tail[row, 0])
        return late
