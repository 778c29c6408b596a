"""Every Prometheus metric of the service, on an injected registry.

Counters and histograms are updated as things happen; the state gauges
(resident bytes, HBM, queues, plan) are read from the service at scrape time
by a custom collector, so they can never drift from the state they describe.
Labels come from a small fixed set: node, gpu, model, state, tier, slo,
solver, outcome, action, priority, type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# seconds: from a hot hit to a cold load of a large model from NVMe
LATENCY_BUCKETS = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
SLO_CLASSES = ("blocking", "interactive", "background")
EVENT_TYPES = ("request", "turn_end", "tool_call_start", "tool_call_end", "session_end")
REPLAN_OUTCOMES = ("installed", "unchanged", "kept", "stale")
# a whole replan: the solve's outcomes, "covered" (a request for a model served nowhere that the current plan
# already brings: no solve), "joined" (a caller that found a replan pending waited for it: no solve of its own)
# and "failed" (the state could not be planned)
REPLAN_DURATION_OUTCOMES = (*REPLAN_OUTCOMES, "covered", "joined", "failed")
PLAN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0)


@dataclass
class StateSnapshot:
    """What the scrape-time gauges show; the service fills one on demand."""

    resident_bytes: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (model, state, tier)
    gpu_used_bytes: dict[tuple[str, str], int] = field(default_factory=dict)  # (node, gpu)
    gpu_capacity_bytes: dict[tuple[str, str], int] = field(default_factory=dict)  # (node, gpu)
    queue: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (node, priority, state or held_back)
    predicted_p95_seconds: float = 0.0
    unserved_sessions: int = 0
    plan_epoch: int = 0


class _StateCollector(Collector):
    def __init__(self, source: Callable[[], StateSnapshot]) -> None:
        self._source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._source()
        resident = GaugeMetricFamily(
            "statebudget_resident_bytes",
            "Confirmed bytes of a model's state on a tier.",
            labels=["model", "state", "tier"],
        )
        for (model, state, tier), value in sorted(snap.resident_bytes.items()):
            resident.add_metric([model, state, tier], value)
        used = GaugeMetricFamily(
            "statebudget_gpu_hbm_used_bytes",
            "HBM bytes the confirmed placement holds on a GPU.",
            labels=["node", "gpu"],
        )
        capacity = GaugeMetricFamily(
            "statebudget_gpu_hbm_capacity_bytes", "HBM bytes the planner may fill on a GPU.", labels=["node", "gpu"]
        )
        for (node, gpu), value in sorted(snap.gpu_capacity_bytes.items()):
            capacity.add_metric([node, gpu], value)
            used.add_metric([node, gpu], snap.gpu_used_bytes.get((node, gpu), 0))
        queue = GaugeMetricFamily(
            "statebudget_queue_operations",
            "Operations waiting (queued), in flight (leased) or held back after a failure (held_back) per node and priority.",
            labels=["node", "priority", "state"],
        )
        for (node, priority, state), value in sorted(snap.queue.items()):
            queue.add_metric([node, priority, state], value)
        yield resident
        yield used
        yield capacity
        yield queue
        yield GaugeMetricFamily(
            "statebudget_predicted_switch_latency_p95_seconds",
            "P95 switch latency the current plan predicts.",
            value=snap.predicted_p95_seconds,
        )
        yield GaugeMetricFamily(
            "statebudget_unserved_sessions",
            "Active sessions the current plan cannot serve (they wait for room).",
            value=snap.unserved_sessions,
        )
        yield GaugeMetricFamily("statebudget_plan_epoch", "Epoch of the current plan.", value=snap.plan_epoch)


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.operation_duration = Histogram(
            "statebudget_operation_duration_seconds",
            "Measured duration of operations reported by node agents.",
            ["action", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.plan_duration = Histogram(
            "statebudget_plan_duration_seconds",
            "Time to compute one plan.",
            ["solver"],
            buckets=PLAN_BUCKETS,
            registry=registry,
        )
        self.replan_duration = Histogram(
            "statebudget_replan_duration_seconds",
            "Wall time of one whole replan, by outcome: waiting for the state, the snapshot, compiling, solving, "
            "installing the operations and writing them (statebudget_plan_duration_seconds times the solve alone).",
            ["outcome"],
            buckets=PLAN_BUCKETS,
            registry=registry,
        )
        self.switch_latency = Histogram(
            "statebudget_switch_latency_seconds",
            "Observed switch latency: from a request event until its model's weights are confirmed on GPU.",
            ["slo"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.events = Counter("statebudget_events", "Session events applied.", ["type"], registry=registry)
        self.replans = Counter(
            "statebudget_replans",
            "Replans by outcome: installed (a new epoch), unchanged (the same target), kept (the plan was not worth "
            "its moves: the current one stays), stale (operations moved during every solve: the loop tries again).",
            ["outcome"],
            registry=registry,
        )
        self.plan_invariant_violations = Counter(
            "statebudget_plan_invariant_violations",
            "Invariants (planner/invariants.py) that the plans of the planning loop broke, by kind (capacity, "
            "engine, ...): a planner bug, logged as an error with the sentence.",
            ["kind"],
            registry=registry,
        )
        self.lease_expiries = Counter(
            "statebudget_lease_expiries",
            "Leases that expired and re-queued their operations.",
            ["node"],
            registry=registry,
        )
        self.calibration_samples = Counter(
            "statebudget_calibration_samples",
            "Measured copies offered to bandwidth calibration, by outcome: accepted, or refused (bytes not the "
            "planned copy's, outside the link's plausible range, or an outlier against the estimate).",
            ["outcome"],
            registry=registry,
        )
        self.report_conflicts = Counter(
            "statebudget_report_conflicts",
            "Operations a node reported done that the confirmed state could not take (a source without the "
            "bytes, a destination without room, an object over its size): recorded, not applied.",
            ["node"],
            registry=registry,
        )
        self.state_lost = Counter(
            "statebudget_node_state_lost",
            "Times a GPU's measured used bytes fell below what the confirmed state holds there by more than the "
            "tolerance, two heartbeats in a row: the node lost state the service believed it held.",
            ["node", "gpu"],
            registry=registry,
        )
        self.reconciled_objects = Counter(
            "statebudget_reconciled_objects",
            "Placement entries taken out of the confirmed state because the node's engines reported them gone "
            "(an instance stopped or asleep, two heartbeats in a row).",
            ["node"],
            registry=registry,
        )
        self.slo_violations = Counter(
            "statebudget_slo_violations",
            "Requests whose observed switch latency exceeded their SLO target.",
            ["slo"],
            registry=registry,
        )

        for slo in SLO_CLASSES:  # known label values start at zero so dashboards see them
            self.switch_latency.labels(slo)
            self.slo_violations.labels(slo)
        for event_type in EVENT_TYPES:
            self.events.labels(event_type)
        for outcome in REPLAN_OUTCOMES:
            self.replans.labels(outcome)
        for outcome in REPLAN_DURATION_OUTCOMES:
            self.replan_duration.labels(outcome)

    def watch(self, source: Callable[[], StateSnapshot]) -> None:
        """Read the state gauges from `source` at every scrape."""
        self.registry.register(_StateCollector(source))
