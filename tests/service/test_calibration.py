"""Bandwidth calibration: hand-checked updates, and the samples it refuses so that no report poisons it."""

from __future__ import annotations

import math

import pytest

from planner_service.domain.state import Location, Tier
from planner_service.domain.units import GIB
from planner_service.service import calibration
from planner_service.service.calibration import Copy, Estimate, Link, fold, link_of

NVME = 7e9  # B/s, the catalog's NVMe read


@pytest.mark.parametrize(
    ("source", "dest", "link"),
    [
        (Location(Tier.NVME, "n1"), Location(Tier.GPU, "g0"), Link("nodes", "n1", "nvme_read_bytes_per_s")),
        (Location(Tier.NVME, "n1"), Location(Tier.HOST, "n1"), Link("nodes", "n1", "nvme_read_bytes_per_s")),
        (Location(Tier.HOST, "n1"), Location(Tier.NVME, "n1"), Link("nodes", "n1", "nvme_write_bytes_per_s")),
        (Location(Tier.HOST, "n1"), Location(Tier.GPU, "g0"), Link("gpus", "g0", "h2d_bytes_per_s")),
        (Location(Tier.GPU, "g0"), Location(Tier.HOST, "n1"), Link("gpus", "g0", "d2h_bytes_per_s")),
        (Location(Tier.GPU, "g0"), Location(Tier.GPU, "g1"), None),
    ],
)
def test_each_copy_samples_the_link_that_bounds_it(source: Location, dest: Location, link: Link | None) -> None:
    assert link_of(source, dest) == link


def test_a_full_sized_sample_moves_the_estimate_by_alpha_and_a_small_one_by_its_share() -> None:
    full, why = fold(None, NVME, NVME, 2e9, Copy(4 * GIB, 4 * GIB))
    assert why is None and full == Estimate(value=0.7 * NVME + 0.3 * 2e9, samples=1, last_measured=2e9, outliers=0)
    quarter, _ = fold(full, NVME, full.value, 2e9, Copy(GIB // 4, GIB // 4))  # weight 0.3 / 4
    assert quarter is not None and quarter.value == pytest.approx(0.925 * full.value + 0.075 * 2e9)
    assert quarter.samples == 2


@pytest.mark.parametrize(
    ("rate", "copied", "refused_because"),
    [
        (math.inf, None, "no usable rate"),  # a heartbeat's Infinity
        (math.nan, None, "no usable rate"),
        (1e308, None, "plausible range"),
        (NVME, Copy(planned_bytes=GIB, measured_bytes=1000 * GIB), "bytes measured for a copy of"),  # 1,000x
        (NVME, Copy(planned_bytes=GIB, measured_bytes=1), "bytes measured for a copy of"),  # one byte
        (0.109e9, Copy(GIB, GIB), "plausible range"),  # a test run at 1e-6 scale: 64x below the catalog
        (4.1 * NVME, Copy(GIB, GIB), "plausible range"),
    ],
)
def test_samples_no_link_could_produce_are_refused(rate: float, copied: Copy | None, refused_because: str) -> None:
    entry = Estimate(value=NVME, samples=3, last_measured=NVME, outliers=0)
    after, why = fold(entry, NVME, NVME, rate, copied)
    assert why is not None and refused_because in why
    assert after is entry  # unchanged


def test_one_outlier_is_refused_but_a_link_that_really_changed_gets_there() -> None:
    entry: Estimate | None = Estimate(value=0.5e9, samples=5, last_measured=0.5e9, outliers=0)
    estimate = 0.5e9  # learned: this disk reads far below its catalog figure; then it is replaced
    for n in range(1, calibration.OUTLIER_PERSISTENCE):
        entry, why = fold(entry, NVME, estimate, NVME, Copy(GIB, GIB))
        assert why is not None and f"{n} of {calibration.OUTLIER_PERSISTENCE} in a row" in why
        assert entry is not None and entry.value == 0.5e9
    for _ in range(30):
        entry, why = fold(entry, NVME, estimate, NVME, Copy(GIB, GIB))
        assert why is None and entry is not None
        estimate = entry.value
    assert estimate == pytest.approx(NVME, rel=1e-3)


def test_an_outlier_streak_is_broken_by_an_ordinary_sample() -> None:
    entry: Estimate | None = Estimate(value=1e9, samples=5, last_measured=1e9, outliers=0)
    for _ in range(calibration.OUTLIER_PERSISTENCE - 1):
        entry, _ = fold(entry, NVME, 1e9, 20e9, Copy(GIB, GIB))
    entry, why = fold(entry, NVME, 1e9, 1.1e9, Copy(GIB, GIB))
    assert why is None and entry is not None and entry.outliers == 0
    entry, why = fold(entry, NVME, entry.value, 20e9, Copy(GIB, GIB))
    assert why is not None and f"1 of {calibration.OUTLIER_PERSISTENCE}" in why
