"""Gateway settings: `STATEBUDGET_GATEWAY_*` environment variables (or CLI options), built once."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="STATEBUDGET_GATEWAY_", frozen=True, extra="forbid", hide_input_in_errors=True
    )

    planner_url: str = Field("http://127.0.0.1:8080", description="The planner's base URL.")
    planner_token: str | None = Field(None, repr=False, description="A router token of the planner.")
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8090, ge=0, le=65535, description="TCP port to listen on.")
    routes_wait_seconds: float = Field(20.0, gt=0, le=300, description="Long-poll wait on the route table.")
    planner_retry_seconds: float = Field(1.0, gt=0, description="Pause before asking an unreachable planner again.")
    wake_timeout_seconds: float = Field(
        120.0, gt=0, description="Longest a request waits for its model to run somewhere before a 503."
    )
    queue_limit_per_model: int = Field(256, ge=1, description="Requests held per model while it wakes; more: 503.")
    session_idle_seconds: float = Field(600.0, gt=0, description="A session quiet this long gets a session_end.")
    event_flush_seconds: float = Field(0.05, gt=0, description="Events wait at most this long to be batched.")
    event_batch_max: int = Field(500, ge=1, le=10_000, description="Events per POST /v1/events.")
    event_buffer_max: int = Field(
        100_000, ge=1, description="Events kept while the planner is down; beyond it the oldest are dropped."
    )
    upstream_connect_timeout_seconds: float = Field(2.0, gt=0, description="Connect timeout to an engine.")
    upstream_read_timeout_seconds: float = Field(600.0, gt=0, description="Longest silence from a streaming engine.")
    max_connections: int = Field(2000, ge=1, description="Idle connections kept open to the engines, all together.")
    warmups: bool = Field(
        True, description="Carry out the planner's warm-up directives (prefill a session's history on an idle card)."
    )
    warmup_history_bytes: int = Field(
        64 * 2**20,
        ge=0,
        description="Request bodies kept for warm-ups (sessions in a tool call), all together; the oldest go first.",
    )
    lmcache_controller_url: str | None = Field(
        None,
        description="The LMCache controller's HTTP API (`lmcache_controller --port`); the gateway pins the history "
        "of the sessions the plan keeps there. Unset: pins are off.",
    )
    lmcache_instance_ids: dict[str, str] = Field(
        default_factory=dict,
        description="The route table's instance id -> that engine's LMCache instance id (`lmcache_instance_id`); an "
        "instance not listed: `<node>-<model>`, the node agent's default.",
    )
    lmcache_pin_location: str = Field(
        "LocalCPUBackend", description="The LMCache storage backend a pin keeps the chunks in (`location`)."
    )
    lmcache_pin_refresh_seconds: float = Field(
        240.0,
        gt=0,
        description="A kept session is pinned again this often: LMCache unpins what was pinned longer than its "
        "`pin_timeout_sec` (default 300 s) ago, so keep this below it.",
    )
    lmcache_pin_retry_seconds: float = Field(30.0, gt=0, description="A pin that failed is tried again after this.")
    lmcache_pin_concurrency: int = Field(4, ge=1, le=64, description="Pins (tokenize, then pin) in flight at once.")
    lmcache_timeout_seconds: float = Field(10.0, gt=0, description="Timeout of each /tokenize and /pin call.")
    pin_history_bytes: int = Field(
        64 * 2**20,
        ge=0,
        description="Request bodies kept for pins (each session's last one), all together; the oldest go first.",
    )
    log_level: str = Field("info", description="debug, info, warning or error.")
