"""Agent configuration through pydantic-settings: command-line flags, then `STATEBUDGET_AGENT_*` environment
variables (nested fields with `__`: `STATEBUDGET_AGENT_LEASE_WAIT_SECONDS=5`), then the YAML or JSON file;
checked once, then frozen.

server_url: http://127.0.0.1:8080
node_id: n1
token: n1-secret            # or STATEBUDGET_AGENT_TOKEN
executor: local             # local | vllm | sglang
scale: 0.000001             # local: materialize 1 byte per million planned bytes
nvme_dir: /var/lib/statebudget/nvme
host_dir: /dev/shm/statebudget   # omit: an in-memory store
gpus: [{id: n1-g0, type: l40, hbm_bytes: 48000000000, device: 0}]
engines:                                    # vllm / sglang: model -> its engine (a bare URL also works)
  coder:
    url: http://127.0.0.1:8000
    precision: bf16
    features: [sleep_mode, dev_mode, lmcache]  # what the engine was launched with
    management: managed                      # managed: the agent starts it from `launch`; adopted: sleep/wake only
    model_path: /models/coder                # the checkpoint (read-ahead; SGLang's reload: required there)
    lmcache_instance_id: n1-coder            # with the lmcache feature: this engine's LMCache instance
    launch:
      command: [vllm, serve, /models/coder, --port, "{port}", --enable-sleep-mode]
      env: {VLLM_SERVER_DEV_MODE: "1"}
      port: 8000
engine_gpus: {coder: [n1-g0]}               # the GPUs each engine was launched on (its tensor-parallel group)
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import (
    BaseSettings,
    JsonConfigSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from clients.agent.operations import Capability
from planner_service.wire.enums import EngineFeature, Management


class ExecutorName(StrEnum):
    """The executors the agent can run (`executors/registry.py` builds each by this name)."""

    LOCAL = "local"
    VLLM = "vllm"
    SGLANG = "sglang"


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GpuConfig(_Frozen):
    id: str = Field(min_length=1)
    type: str | None = None
    hbm_bytes: int | None = Field(None, ge=0, description="Capacity reported as used + free in heartbeats.")
    device: int | None = Field(None, ge=0, description="CUDA device index (local executor with torch + CUDA).")


class LaunchSpec(_Frozen):
    """How the agent starts a managed engine (as llama-swap's config does): the command, with `{port}`,
    `{model}` and `{model_path}` filled in, its environment (CUDA_VISIBLE_DEVICES is set from the engine's
    GPUs), and the readiness probe it waits for."""

    command: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(default_factory=dict)
    port: int = Field(ge=1, le=65535)
    ready_path: str = "/health"
    ready_timeout_seconds: float = Field(600.0, gt=0, description="Cold starts take minutes (perf_anchors.md §1).")
    stop_timeout_seconds: float = Field(30.0, gt=0, description="SIGTERM, then SIGKILL after this long.")


class EngineConfig(_Frozen):
    """One engine instance this node runs: where it answers, what it was launched with, who manages it."""

    url: str = Field(min_length=1, description="The engine's OpenAI-compatible base URL.")
    precision: str = "bf16"
    features: list[EngineFeature] = Field(
        default_factory=list,
        description="Launch features: sleep_mode, dev_mode, lmcache (vLLM); sleep_mode, cpu_backup (SGLang).",
    )
    management: Management = Management.ADOPTED
    model_path: str | None = Field(None, description="The checkpoint directory (read-ahead; SGLang's reload).")
    weights_bytes: int = Field(1, ge=1, description="The model's weights at this precision (the engine model's sizes).")
    lmcache_instance_id: str | None = None
    launch: LaunchSpec | None = None
    drain_timeout_seconds: float = Field(60.0, gt=0, description="How long a drain waits for running requests.")

    @model_validator(mode="after")
    def _managed_has_launch(self) -> EngineConfig:
        if self.management is Management.MANAGED and self.launch is None:
            raise ValueError("management: managed needs `launch` (the command the agent starts the engine with)")
        return self


class AgentConfig(BaseSettings):
    model_config = SettingsConfigDict(
        extra="forbid", frozen=True, env_prefix="STATEBUDGET_AGENT_", env_nested_delimiter="__"
    )

    server_url: str = "http://127.0.0.1:8080"
    node_id: str = Field(min_length=1)
    token: str | None = None
    executor: ExecutorName = ExecutorName.LOCAL
    capabilities: list[Capability] | None = Field(
        None, description="Moves to declare at registration; default: what the executor can do."
    )
    gpus: list[GpuConfig] = Field(default_factory=list)
    host_dram_bytes: int | None = Field(None, ge=0)
    nvme_bytes: int | None = Field(None, ge=0)
    # local executor
    nvme_dir: Path | None = None
    host_dir: Path | None = None
    scale: float = Field(1.0, gt=0, le=1, description="Materialized bytes per planned byte (local executor).")
    chunk_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Copy granularity (local executor).")
    seed_from_srv: bool = Field(True, description="Materialize this node's confirmed placement at start (local).")
    # engine executors
    engines: dict[str, EngineConfig] = Field(default_factory=dict, description="Model id -> its engine.")
    engine_gpus: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Model id -> the cluster GPU ids its engine was launched on; declared at registration, so "
        "that the planner serves the model on this node only from them (a vLLM or SGLang engine cannot move).",
    )
    model_paths: dict[str, str] = Field(default_factory=dict, description="Model id -> weights path (SGLang reload).")
    engine_timeout_seconds: float = Field(120.0, gt=0)
    engine_state_dir: Path | None = Field(
        None,
        description="Where the launch records of managed engines are kept (found again after the agent restarts); "
        "default: the temp directory.",
    )
    # loop
    heartbeat_seconds: float = Field(10.0, gt=0)
    lease_wait_seconds: float = Field(10.0, ge=0, le=300)
    max_operations: int = Field(8, ge=1, le=1000)
    max_parallel: int = Field(4, ge=1)
    temporary_attempts: int = Field(3, ge=1, description="Tries of an operation that fails temporarily.")
    retry_delay_seconds: float = Field(1.0, ge=0)
    shutdown_grace_seconds: float = Field(30.0, ge=0, description="On SIGTERM, wait this long for running work.")
    timeout_seconds: float = Field(30.0, gt=0, description="HTTP timeout towards the service.")

    def gpu_devices(self) -> dict[str, int]:
        """Cluster GPU id -> local device index (the configured one, else the GPU's position in `gpus`)."""
        return {g.id: g.device if g.device is not None else i for i, g in enumerate(self.gpus)}

    @model_validator(mode="before")
    @classmethod
    def _bare_engine_urls(cls, data: Any) -> Any:
        """`engines: {model: url}` is shorthand for `{model: {url: url}}`; `model_paths` fills `model_path`."""
        if isinstance(data, dict) and isinstance(data.get("engines"), dict):
            paths = data.get("model_paths") or {}
            engines = {}
            for model, engine in data["engines"].items():
                engine = {"url": engine} if isinstance(engine, str) else engine
                if isinstance(engine, dict) and model in paths and "model_path" not in engine:
                    engine = {**engine, "model_path": paths[model]}
                engines[model] = engine
            data = {**data, "engines": engines}
        return data

    @model_validator(mode="after")
    def _sglang_needs_model_paths(self) -> AgentConfig:
        if self.executor is ExecutorName.SGLANG:
            missing = sorted(m for m, e in self.engines.items() if e.model_path is None)
            if missing:
                raise ValueError(
                    f"engines.{missing[0]}.model_path: SGLang reloads discarded weights from the checkpoint "
                    f"(/update_weights_from_disk needs its path); none given for {missing}"
                )
        return self

    @model_validator(mode="after")
    def _gpu_ids_unique(self) -> AgentConfig:
        ids = [g.id for g in self.gpus]
        if len(set(ids)) != len(ids):
            raise ValueError("gpus: two GPUs share an id")
        return self

    @model_validator(mode="after")
    def _engine_gpus_known(self) -> AgentConfig:
        ids = {g.id for g in self.gpus}
        for model, gpus in self.engine_gpus.items():
            if model not in self.engines:
                raise ValueError(f"engine_gpus.{model}: no engine configured for {model!r} in `engines`")
            if not gpus:
                raise ValueError(f"engine_gpus.{model}: name at least one GPU")
            unknown = sorted(set(gpus) - ids) if ids else []
            if unknown:
                raise ValueError(f"engine_gpus.{model}: {unknown} not among `gpus` ({sorted(ids)})")
        return self


def load_config(path: Path | None, overrides: dict[str, Any]) -> AgentConfig:
    """The flags that were given (None means not given), then the environment, then the file (YAML or JSON)."""
    flags = {k: v for k, v in overrides.items() if v is not None}
    if path is None:
        return AgentConfig(**flags)
    if not path.is_file():
        raise ValueError(f"{path}: no such settings file")
    file_path = path  # bound for the class below
    if path.suffix != ".json":
        loaded = yaml.safe_load(path.read_text())
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping of settings, got {type(loaded).__name__}")

    class FromFile(AgentConfig):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            file: PydanticBaseSettingsSource = (
                JsonConfigSettingsSource(settings_cls, json_file=file_path)
                if file_path.suffix == ".json"
                else YamlConfigSettingsSource(settings_cls, yaml_file=file_path)
            )
            return (init_settings, env_settings, file)

    return FromFile(**flags)
