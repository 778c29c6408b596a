"""95 % confidence intervals over seeds: Student's t-interval of the mean (numpy only).

For n runs with mean m and sample standard deviation s (ddof 1), the interval is
m ± t(0.975, n - 1) * s / sqrt(n). The critical values are the two-sided 95 % points of Student's t
distribution (NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.2, table of critical
values of the t distribution); beyond 30 degrees of freedom the table's 40, 60 and 120 rows, then the
normal 1.960.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

T_975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip  # (a table reads as one)
T_975_BEYOND = ((40, 2.021), (60, 2.000), (120, 1.980))


def t_critical(dof: int) -> float:
    """The two-sided 95 % critical value of Student's t with `dof` degrees of freedom (conservative
    between the table's rows: the value of the row below)."""
    if dof < 1:
        raise ValueError("dof: at least one degree of freedom (two runs) is needed")
    if dof <= len(T_975):
        return T_975[dof - 1]
    value = T_975[-1]
    for row, t in T_975_BEYOND:
        if dof >= row:
            value = t
    return value if dof < 1000 else 1.960


@dataclass(frozen=True)
class Interval:
    mean: float
    half_width: float  # NaN with a single run
    n: int

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def to_json(self) -> dict[str, float | int | None]:
        finite = math.isfinite(self.half_width)
        return {
            "mean": self.mean,
            "low": self.low if finite else None,
            "high": self.high if finite else None,
            "half_width": self.half_width if finite else None,
            "n": self.n,
        }

    def label(self, digits: int = 2) -> str:
        if not math.isfinite(self.half_width):
            return f"{self.mean:.{digits}f} (n=1)"
        return f"{self.mean:.{digits}f} ± {self.half_width:.{digits}f}"


def t_interval(values: Sequence[float]) -> Interval:
    """The mean of `values` with its 95 % t-interval (half width NaN for a single value)."""
    if not values:
        raise ValueError("values: no runs to summarise")
    data = np.asarray(values, dtype=float)
    if data.size == 1:
        return Interval(float(data[0]), math.nan, 1)
    half = t_critical(data.size - 1) * float(data.std(ddof=1)) / math.sqrt(data.size)
    return Interval(float(data.mean()), half, int(data.size))
