"""Service settings: `STATEBUDGET_*` environment variables, built once and passed down.

Lists and maps come from the environment as JSON, e.g.
`STATEBUDGET_OPERATOR_TOKENS='["op-secret"]'`, `STATEBUDGET_NODE_TOKENS='{"n1": "n1-secret"}'`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from planner_service.wire.bounds import DEFAULT_MAX_CLOCK_SKEW_SECONDS, MAX_SECONDS


class Settings(BaseSettings):
    # hide_input_in_errors: a refused setting must not print what it was given (the token lists are secrets)
    model_config = SettingsConfigDict(env_prefix="STATEBUDGET_", frozen=True, extra="forbid", hide_input_in_errors=True)

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8080, ge=0, le=65535, description="TCP port to listen on.")
    db_path: Path = Field(Path("statebudget.db"), description="SQLite database file holding the durable state.")
    scenario_path: Path | None = Field(None, description="Scenario file that seeds an empty database.")
    demo: bool = Field(False, description="Seed an empty database with the embedded demo scenario.")
    operator_tokens: list[str] = Field(
        default_factory=list, repr=False, description="Bearer tokens that reach every endpoint (JSON list)."
    )
    node_tokens: dict[str, str] = Field(
        default_factory=dict,
        repr=False,
        description="Node id -> bearer token reaching only that node's endpoints (JSON map).",
    )
    router_tokens: list[str] = Field(
        default_factory=list,
        repr=False,
        description="Bearer tokens of gateways: post events, read routes and the plan, nothing else (JSON list).",
    )
    lease_seconds: float = Field(30.0, gt=0, description="How long a node's lease on operations lasts.")
    event_retention_seconds: float = Field(
        7 * 86400.0, gt=0, description="How long an event id is remembered, so a resend within it is ignored."
    )
    max_wait_seconds: float = Field(30.0, ge=0, description="Longest a lease long-poll may wait.")
    worker_threads: int = Field(
        256,
        ge=1,
        le=4096,
        description="Threads that run the requests touching the state (anyio's default is 40). A request waits in its "
        "thread for the state lock, and urgent ones (leases, events) go first there: with too few threads a burst of "
        "done reports would hold them all and leases would queue for a thread instead.",
    )
    keep_alive_seconds: int = Field(
        30,
        ge=1,
        description="How long an idle HTTP connection stays open (uvicorn's timeout_keep_alive). Longer than clients "
        "keep theirs (the SDK, agent and gateway drop theirs after 5 s), so that no request is sent on a connection "
        "the server is closing: uvicorn's default of 5 s, equal to httpx's, lost requests to that race under load.",
    )
    # the planning rules' defaults are those of the simulator's `statebudget` policy (planner/online.py), so a
    # replay measures what the service runs; tests/unit/test_settings_defaults.py keeps them equal
    replan_debounce_seconds: float = Field(
        0.2,
        ge=0,
        description="At most one replan per this many seconds for requests that wait for a model served nowhere "
        "(or a broken plan): the first is planned at once, those within the window when it ends.",
    )
    replan_interval_seconds: float = Field(
        30.0, gt=0, description="Replan this often; other changes wait for it (planner/online.py says why)."
    )
    background_planning: bool = Field(
        True, description="Run the planning loop thread (tests turn it off and replan with POST /v1/plan)."
    )
    plan_in_worker: bool = Field(
        True,
        description="Solve replans in a worker process, so the planner's CPU does not hold the GIL against the HTTP "
        "requests (tests turn it off to plan in the service's own thread).",
    )
    solver: Literal["greedy", "search", "milp"] = Field("greedy", description="Solver of the online planning loop.")
    warmups_per_instance: int = Field(
        2, ge=0, description="Warm-ups the route table directs to one idle engine instance at most (0: none)."
    )
    warmup_target: Literal["priced", "top", "handoff"] = Field(
        "priced",
        description="Which warm-ups the route table directs (planner/gateway_directives.py): priced, those whose "
        "expected re-prefill saving outweighs the planner's HBM price of their KV, best first; top, the session's "
        "most likely next model; handoff, the most likely model that holds none of its KV.",
    )
    warmup_min_probability: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Under the top and handoff targets, a warm-up needs its model to be at least this likely.",
    )
    demand_window_seconds: float = Field(
        3600.0,
        gt=0,
        description="The planning loop keeps room for the load of this much recent time (stand-in sessions).",
    )
    demand_min_requests: int = Field(
        1000,
        ge=0,
        description="Where that time holds fewer requests, reach back until it holds this many (at most a day).",
    )
    demand_seats: int = Field(
        10, ge=0, description="Stand-in sessions spread over the models by their share of the recent load (0: none)."
    )
    unpin_after_seconds: float = Field(
        60.0,
        ge=0,
        description="A model that served recently stays on its node unless a request has waited this long for it.",
    )
    failed_move_backoff_seconds: float = Field(
        30.0,
        gt=0,
        description="A move a node reported failed waits this long before a plan queues it again; "
        "each further failure doubles the wait.",
    )
    failed_move_backoff_max_seconds: float = Field(
        3600.0, gt=0, description="The longest a failed move waits before a plan queues it again."
    )
    max_clock_skew_seconds: float = Field(
        DEFAULT_MAX_CLOCK_SKEW_SECONDS,
        gt=0,
        le=365 * MAX_SECONDS,
        description="A client's timestamp (an event's `at`) may be this far from the server's clock; "
        "further is refused with a 422 naming the field.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")

    @model_validator(mode="after")
    def _tokens_distinct(self) -> Settings:
        node_values = list(self.node_tokens.values())
        if len(set(node_values)) != len(node_values):
            raise ValueError("node_tokens: two nodes share a token")
        if set(node_values) & set(self.operator_tokens):
            raise ValueError("node_tokens: a node token is also an operator token")
        if set(self.router_tokens) & (set(node_values) | set(self.operator_tokens)):
            raise ValueError("router_tokens: a router token is also an operator or node token")
        if any(not t for t in [*node_values, *self.operator_tokens, *self.router_tokens]):
            raise ValueError("tokens must not be empty")
        return self

    @property
    def auth_enabled(self) -> bool:
        return bool(self.operator_tokens or self.node_tokens or self.router_tokens)


def env_help() -> str:
    """One line per setting: its environment variable, default and meaning (for `serve --help`)."""
    lines = ["Settings (environment variables):"]
    for name, info in Settings.model_fields.items():
        default = info.get_default(call_default_factory=True)
        lines.append(f"STATEBUDGET_{name.upper()} (default {default!s}): {info.description}")
    return "\n\n".join(lines)
