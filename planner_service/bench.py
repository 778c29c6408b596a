"""The planning-time benchmark behind `statebudget bench plan`.

Each timed plan is followed by a fixed pure-Python reference workload,
timed the same way. On a shared or virtual machine the slowest plans come in
bursts, when the machine itself slows down; the reference, measured in the
same moments, shows those bursts, so a reader can tell the planner's tail
from the machine's.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from planner_service.domain.problem import Problem

REFERENCE_ITEMS = 10_000  # about as long as a demo-sized plan on this project's 2-core machine


def reference_work() -> None:
    """A fixed mix of what planning does most: tuple keys, dict lookups and updates, float arithmetic, a sort."""
    table: dict[tuple[int, int], float] = {}
    for i in range(REFERENCE_ITEMS):
        key = (i % 97, i % 89)
        table[key] = table.get(key, 0.0) + i * 0.5
    sorted(table.items())


def machine() -> dict[str, object]:
    """What the figures were measured on: a benchmark's numbers mean little without it."""
    from planner_service.planner import greedy

    return {
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "compiled": Path(greedy.__file__).suffix in (".so", ".pyd"),  # the mypyc build the Docker image ships
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def time_plans(solve: Callable[[Problem], object], problem: Problem, repeat: int, warmup: int) -> dict[str, float]:
    """p50 and p99 milliseconds of `repeat` plans from scratch, and of the reference workload between them."""
    for _ in range(warmup):
        solve(problem)
    plans, references = [], []
    for _ in range(repeat):
        started = time.perf_counter()
        solve(problem)
        plans.append(time.perf_counter() - started)
        started = time.perf_counter()
        reference_work()
        references.append(time.perf_counter() - started)
    return {
        "p50_ms": _ms(plans, 50),
        "p99_ms": _ms(plans, 99),
        "reference_p50_ms": _ms(references, 50),
        "reference_p99_ms": _ms(references, 99),
    }


def _ms(seconds: list[float], percentile: float) -> float:
    return round(float(np.percentile(seconds, percentile)) * 1000, 3)
