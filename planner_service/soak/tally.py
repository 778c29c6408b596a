"""What every request of a trial answered: counts by outcome and latencies by kind of request."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from typing import Any

import httpx
import numpy as np

TRANSPORT = "transport"  # no answer: refused, reset or timed out


class Tally:
    """Thread-safe counts of answers (`event 200`, `report 409`, `lease transport`...) and latencies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.server_errors: list[str] = []  # the first few 5xx answers, for the report

    def call(self, client: httpx.Client, kind: str, method: str, path: str, **kwargs: Any) -> httpx.Response | None:
        """Send one request and count its outcome; None when no answer came back."""
        began = time.perf_counter()
        try:
            response = client.request(method, path, **kwargs)
        except httpx.TransportError:
            self.count(kind, TRANSPORT)
            return None
        seconds = time.perf_counter() - began
        with self._lock:
            self.outcomes[(kind, str(response.status_code))] += 1
            self.latencies[kind].append(seconds)
            if response.status_code >= 500 and len(self.server_errors) < 10:
                self.server_errors.append(f"{method} {path}: {response.status_code} {response.text[:300]}")
        return response

    def count(self, kind: str, outcome: str, n: int = 1) -> None:
        with self._lock:
            self.outcomes[(kind, outcome)] += n

    def of(self, kind: str, outcome: str) -> int:
        with self._lock:
            return self.outcomes[(kind, outcome)]

    def total(self, kind: str) -> int:
        with self._lock:
            return sum(n for (k, _), n in self.outcomes.items() if k == kind)

    def status_5xx(self) -> int:
        with self._lock:
            return sum(n for (_, o), n in self.outcomes.items() if o.isdigit() and int(o) >= 500)

    def unexpected_4xx(self, expected: set[tuple[str, str]]) -> int:
        """4xx answers other than the `(kind, status)` pairs a trial expects (a 409 for a superseded lease)."""
        with self._lock:
            return sum(
                n
                for (k, o), n in self.outcomes.items()
                if o.isdigit() and 400 <= int(o) < 500 and (k, o) not in expected
            )

    def percentiles_ms(self, kind: str) -> tuple[float | None, float | None]:
        """p50 and p99 of a kind's latencies, in milliseconds (None: no answer of that kind)."""
        with self._lock:
            values = list(self.latencies.get(kind, ()))
        if not values:
            return None, None
        p50, p99 = np.percentile(np.asarray(values) * 1000.0, [50, 99])
        return float(p50), float(p99)

    def summary(self) -> dict[str, Any]:
        with self._lock:
            by_kind: dict[str, dict[str, int]] = defaultdict(dict)
            for (kind, outcome), n in sorted(self.outcomes.items()):
                by_kind[kind][outcome] = n
        return {
            kind: {"answers": answers, "p50_ms": self.percentiles_ms(kind)[0], "p99_ms": self.percentiles_ms(kind)[1]}
            for kind, answers in by_kind.items()
        }
