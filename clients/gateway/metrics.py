"""The gateway's Prometheus metrics, on an injected registry (labels: model, outcome; never session ids)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "statebudget_gateway_requests_total",
            "Requests by model and outcome (ok, engine_error, bad_request, unavailable, cancelled).",
            ["model", "outcome"],
            registry=registry,
        )
        self.ttft = Histogram(
            "statebudget_gateway_ttft_seconds",
            "Arrival to the first byte of the engine's answer, as the client sees it (wake holds included).",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.wake_hold = Histogram(
            "statebudget_gateway_wake_hold_seconds",
            "Time a request was held while its model had no running instance.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.routed = Counter(
            "statebudget_gateway_routed_total",
            "Requests sent upstream, by whether the instance held the session's KV (kv_holder) or not (other).",
            ["model", "outcome"],
            registry=registry,
        )
        self.retries = Counter(
            "statebudget_gateway_upstream_retries_total",
            "Requests sent to another instance after the first could not be reached (nothing was sent).",
            ["model"],
            registry=registry,
        )
        self.held = Gauge(
            "statebudget_gateway_held_requests", "Requests waiting for a model to run.", ["model"], registry=registry
        )
        self.planner_reachable = Gauge(
            "statebudget_gateway_planner_reachable",
            "1 while the last route-table fetch succeeded; 0: routing from the last known table.",
            registry=registry,
        )
        self.planner_errors = Counter(
            "statebudget_gateway_planner_errors_total", "Failed route-table fetches.", registry=registry
        )
        self.route_epoch = Gauge(
            "statebudget_gateway_route_epoch", "The plan epoch of the table the gateway routes by.", registry=registry
        )
        self.events_sent = Counter(
            "statebudget_gateway_events_sent_total", "Session events the planner acknowledged.", registry=registry
        )
        self.events_pending = Gauge(
            "statebudget_gateway_events_pending", "Session events waiting to be sent.", registry=registry
        )
        self.events_dropped = Counter(
            "statebudget_gateway_events_dropped_total",
            "Events dropped: the buffer was full while the planner was down, or the wire model refused the event.",
            registry=registry,
        )
        self.event_post_failures = Counter(
            "statebudget_gateway_event_post_failures_total", "Failed POST /v1/events batches.", registry=registry
        )
        self.warmups = Counter(
            "statebudget_gateway_warmups_total",
            "Warm-ups by model and outcome: started (sent to the engine) and how each ended (completed, cancelled "
            "for a real request or a withdrawn directive, failed); engine_busy: not sent, the engine's scheduler "
            "reported requests.",
            ["model", "outcome"],
            registry=registry,
        )
        self.warmups_used = Counter(
            "statebudget_gateway_warmups_used_total",
            "Requests sent to the instance a completed warm-up of their session had prefilled.",
            ["model"],
            registry=registry,
        )
        self.pins = Counter(
            "statebudget_gateway_pins_total",
            "Pins of a session's history in LMCache by model and outcome: pinned (the controller pinned some of "
            "its tokens), empty (it found none of their chunks at the location: not stored yet, evicted, or another "
            "prompt), tokenize_failed (the engine's /tokenize failed), controller_failed (the controller refused or was "
            "unreachable), no_history (the gateway holds no request of the session for that model), skipped (a "
            "request that is not one sequence: a batch of prompts).",
            ["model", "outcome"],
            registry=registry,
        )
        self.pins_enabled = Gauge(
            "statebudget_gateway_pins_enabled",
            "1: the gateway carries out pin directives in LMCache (a controller is configured); 0: pins are off.",
            registry=registry,
        )
        self.pinned_sessions = Gauge(
            "statebudget_gateway_pinned_sessions",
            "Sessions whose directive stands and whose last pin the LMCache controller took.",
            registry=registry,
        )
