"""Which predicted requests of a model miss their SLO target, priced in O(log sessions) per question.

A predicted request of session s on model m waits `delay` seconds for the
weights, then re-prefills the session's history of `context_s` tokens at
`per_token` seconds each; it misses its target when

    delay + per_token * context_s > target_s.

The greedy asks this for many (model, group) pairs. Per SLO class (one target
each) the sessions are sorted by context once, and per model the SLO- and
probability-weighted requests are summed from the longest context down, so a
question is one bisection per class: the sessions late are those whose
context exceeds (target - delay) / per_token.
"""

from __future__ import annotations

import bisect

import numpy as np

from planner_service.planner.objective import Demand


class Lateness:
    """`weight_late(row, per_token, delay)`: sum of q(s, m) * w_s over the sessions late (see the module)."""

    def __init__(self, demand: Demand, weighted: np.ndarray) -> None:
        self._weighted = weighted  # [models x sessions] SLO weight * probability of the next request
        self._classes: list[tuple[float, np.ndarray, list[float]]] = []  # (target, sessions by context, contexts)
        for target in sorted(set(demand.slo_target.tolist())):
            members = np.flatnonzero(demand.slo_target == target)
            order = members[np.argsort(demand.context[members], kind="stable")]
            self._classes.append((target, order, demand.context[order].tolist()))
        self._tails: list[np.ndarray] = []  # per class, [models x sessions + 1]: weight of the sessions from i on

    def weight_late(self, row: int, per_token: float, delay: float = 0.0) -> float:
        if not self._tails:  # on first use: all models at once (a numpy call costs more than its arithmetic here)
            for _, order, _ in self._classes:
                tail = np.zeros((self._weighted.shape[0], len(order) + 1))
                tail[:, :-1] = self._weighted[:, order[::-1]].cumsum(axis=1)[:, ::-1]
                self._tails.append(tail)
        late = 0.0
        for (target, _, contexts), tail in zip(self._classes, self._tails, strict=True):
            if per_token > 0:
                late += float(tail[row, bisect.bisect_right(contexts, (target - delay) / per_token)])
            elif delay > target:
                late += float(tail[row, 0])
        return late
