"""Test doubles shared across test folders (pytest puts tests/ on sys.path)."""

from __future__ import annotations

from pathlib import Path

TINY_SCENARIO = Path(__file__).parent / "service" / "tiny_scenario.json"


class FakeClock:
    """A clock tests move by hand instead of sleeping."""

    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds
