"""Link bandwidths learned from measured copies, guarded so that no report can poison them.

A node reports how long a copy took and how many bytes it moved; bytes / seconds is a sample of the link
it crossed (NVMe read or write, host -> GPU, GPU -> host). The estimate is an exponentially weighted mean
of accepted samples, each weighted by its bytes: a small copy's time is mostly fixed overhead (opening
files, allocating, an engine call), not bandwidth, so it moves the estimate little. A sample is refused:

- when its bytes are not the planned copy's (more than `BYTES_TOLERANCE` times off): the report does not
  describe this copy, whatever it measured;
- outside the link's physical range, `SPEC_FLOOR` to `SPEC_CEILING` times the catalog figure: a link runs
  at most somewhat above its specification, and a reading far below it is a stalled or throttled copy
  (or a test run at a scale), not the link;
- as an outlier, more than `OUTLIER_FACTOR` times off the running estimate, unless it is the
  `OUTLIER_PERSISTENCE`-th such sample in a row on the same side: a link that really changed (a disk
  replaced, a card moved to another slot) gets there, one report alone does not.

An operator's explicit bandwidth (`PUT /v1/cluster`) resets the estimate for that link: it wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from planner_service.domain.state import Location, Tier
from planner_service.domain.units import GIB
from planner_service.wire.bounds import MAX_BANDWIDTH_BYTES_PER_S, MIN_BANDWIDTH_BYTES_PER_S

ALPHA = 0.3  # weight of a full-sized sample in the running estimate
FULL_WEIGHT_BYTES = GIB  # a copy this large or larger weighs the full ALPHA; a smaller one its share of it
BYTES_TOLERANCE = 2.0  # measured bytes within this factor of the planned copy's
SPEC_FLOOR = 1 / 20  # slowest plausible reading of a link, as a share of its catalog bandwidth
SPEC_CEILING = 4.0  # fastest plausible reading (page-cache hits make an NVMe read look a few times faster)
OUTLIER_PERSISTENCE = 3  # outliers in a row on one side that count as a real change of the link
OUTLIER_FACTOR = 10.0  # a sample this many times off the running estimate is refused (real disks run well below spec)

NODE_FIELDS = ("nvme_read_bytes_per_s", "nvme_write_bytes_per_s")
GPU_FIELDS = ("h2d_bytes_per_s", "d2h_bytes_per_s")


@dataclass(frozen=True, slots=True)
class Copy:
    """What a node reported of one planned copy."""

    planned_bytes: int
    measured_bytes: int


@dataclass(frozen=True, slots=True)
class Link:
    """The calibrated field a copy's bandwidth sample belongs to."""

    scope: str  # "nodes" or "gpus"
    key: str  # node or GPU id
    field: str


def link_of(source: Location, dest: Location) -> Link | None:
    """The link whose bandwidth bounds a copy from `source` to `dest` (the NVMe end when there is one)."""
    if source.tier is Tier.NVME:
        return Link("nodes", source.id, "nvme_read_bytes_per_s")
    if dest.tier is Tier.NVME:
        return Link("nodes", dest.id, "nvme_write_bytes_per_s")
    if source.tier is Tier.HOST and dest.tier is Tier.GPU:
        return Link("gpus", dest.id, "h2d_bytes_per_s")
    if source.tier is Tier.GPU and dest.tier is Tier.HOST:
        return Link("gpus", source.id, "d2h_bytes_per_s")
    return None


def plausible_range(catalog: float) -> tuple[float, float]:
    """The rates a link with this catalog bandwidth can show, within what any scenario may declare."""
    return max(SPEC_FLOOR * catalog, MIN_BANDWIDTH_BYTES_PER_S), min(SPEC_CEILING * catalog, MAX_BANDWIDTH_BYTES_PER_S)


@dataclass(frozen=True, slots=True)
class Estimate:
    """A link's learned bandwidth: the running estimate and what folded into it."""

    value: float  # B/s
    samples: int  # samples accepted into the estimate
    last_measured: float | None = None  # the newest sample within the link's plausible range (B/s)
    outliers: int = 0  # signed: consecutive outliers above (+) or below (-) the estimate
    catalog: float | None = None  # the catalog bandwidth the plausible range is drawn around

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"value": self.value, "samples": self.samples}
        if self.last_measured is not None:
            out["last_measured"] = self.last_measured
        out["outliers"] = self.outliers
        if self.catalog is not None:
            out["catalog"] = self.catalog
        return out

    @classmethod
    def from_json(cls, entry: Any) -> Estimate | None:
        """A stored entry, or None where it holds no bandwidth the live state can take (older builds stored
        whatever they were sent)."""
        try:
            value = float(entry["value"])
            last = entry.get("last_measured")
            catalog = entry.get("catalog")
            estimate = cls(
                value=value,
                samples=int(entry.get("samples", 0)),
                last_measured=None if last is None else float(last),
                outliers=int(entry.get("outliers", 0)),
                catalog=None if catalog is None else float(catalog),
            )
        except (TypeError, KeyError, ValueError, AttributeError):
            return None
        if not (math.isfinite(value) and MIN_BANDWIDTH_BYTES_PER_S <= value <= MAX_BANDWIDTH_BYTES_PER_S):
            return None
        return estimate


class Calibration:
    """The bandwidths the links learned, by link. Stored as the `calibration` meta row:
    {"nodes" | "gpus": {node or GPU id: {field: estimate}}}."""

    def __init__(self, estimates: dict[Link, Estimate] | None = None) -> None:
        self._estimates: dict[Link, Estimate] = dict(estimates or {})

    def get(self, link: Link) -> Estimate | None:
        return self._estimates.get(link)

    def put(self, link: Link, estimate: Estimate) -> None:
        self._estimates[link] = estimate

    def forget(self, link: Link) -> bool:
        """Forget the link's estimate (it plans with its catalog or declared bandwidth again); whether it had one."""
        return self._estimates.pop(link, None) is not None

    def links(self) -> list[Link]:
        return list(self._estimates)

    def of(self, scope: str, key: str) -> dict[str, Estimate]:
        """Field -> estimate of one node's (scope "nodes") or GPU's ("gpus") links."""
        return {link.field: e for link, e in self._estimates.items() if link.scope == scope and link.key == key}

    def of_json(self, scope: str, key: str) -> dict[str, dict[str, Any]]:
        return {name: e.to_json() for name, e in self.of(scope, key).items()}

    def values(self) -> tuple[tuple[str, str, str, float], ...]:
        """The learned values alone, ordered: what planning depends on (not the bookkeeping of refused samples)."""
        return tuple(sorted((link.scope, link.key, link.field, e.value) for link, e in self._estimates.items()))

    def to_json(self) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
        out: dict[str, dict[str, dict[str, dict[str, Any]]]] = {"gpus": {}, "nodes": {}}
        for link, e in self._estimates.items():
            out[link.scope].setdefault(link.key, {})[link.field] = e.to_json()
        return out

    @classmethod
    def from_json(cls, data: Any) -> tuple[Calibration, list[tuple[Link, Any]]]:
        """The stored calibration, and the entries it holds that are no bandwidth (dropped)."""
        estimates: dict[Link, Estimate] = {}
        invalid: list[tuple[Link, Any]] = []
        for scope in ("gpus", "nodes"):
            for key, fields in (data or {}).get(scope, {}).items():
                for name, entry in fields.items():
                    link = Link(scope, key, name)
                    estimate = Estimate.from_json(entry)
                    if estimate is None:
                        invalid.append((link, entry))
                    else:
                        estimates[link] = estimate
        return cls(estimates), invalid


def fold(
    entry: Estimate | None, catalog: float, estimate: float, rate: float, copied: Copy | None
) -> tuple[Estimate | None, str | None]:
    """The link's estimate after a sample of `rate` B/s (`copied`: the copy it was measured on; a heartbeat's
    own reading of a link has none), and why the sample was refused, if it was."""
    if not (math.isfinite(rate) and rate > 0):
        return entry, "no usable rate"
    if (
        copied is not None
        and not 1 / BYTES_TOLERANCE <= copied.measured_bytes / copied.planned_bytes <= BYTES_TOLERANCE
    ):
        return entry, f"{copied.measured_bytes} bytes measured for a copy of {copied.planned_bytes}"
    floor, ceiling = plausible_range(catalog)
    if not floor <= rate <= ceiling:
        return entry, f"{rate:.3g} B/s is outside the link's plausible range around its catalog {catalog:.3g} B/s"
    before = entry or Estimate(value=estimate, samples=0)
    side = 0 if estimate / OUTLIER_FACTOR <= rate <= estimate * OUTLIER_FACTOR else (1 if rate > estimate else -1)
    if side:
        streak = before.outliers
        streak = streak + side if streak * side > 0 else side
        if abs(streak) < OUTLIER_PERSISTENCE:
            return replace(before, last_measured=rate, outliers=streak), (
                f"{rate:.3g} B/s is an outlier against the running estimate {estimate:.3g} B/s "
                f"({abs(streak)} of {OUTLIER_PERSISTENCE} in a row before the link counts as changed)"
            )
    weight = ALPHA * min(1.0, (copied.measured_bytes if copied else FULL_WEIGHT_BYTES) / FULL_WEIGHT_BYTES)
    value = (1 - weight) * estimate + weight * rate
    return Estimate(value=value, samples=before.samples + 1, last_measured=rate, outliers=0), None
