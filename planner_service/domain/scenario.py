"""The scenario file: the input of one planning problem, validated by pydantic.

Everything a planner needs is here: the cluster, the model catalog, the
sessions, the confirmed residency, predictor priors and the cost constants.
Sizes may come from a preset, from an HF `config.json`, or be given
explicitly; explicit values win. `schemas/scenario.schema.json` is generated
from these classes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from planner_service.domain.architecture import Precision
from planner_service.domain.engines import ENGINE_KINDS, KIND_FEATURES, EngineFeature, EngineKind, Management
from planner_service.wire.bounds import (
    MAX_CONFIG_MAGNITUDE,
    MAX_KV_HEADS,
    MAX_TENSOR_PARALLEL,
    ByteCount,
    BytesPerSecond,
    ContextTokens,
    FlopsPerSecond,
    Fraction,
    GpuByteCount,
    ParamCount,
    PositiveSeconds,
    PositiveWeight,
    Seconds,
    Tokens,
    Weight,
)
from planner_service.wire.enums import Capability as Capability  # noqa: PLC0414 -- re-exported: it was defined here
from planner_service.wire.enums import Slo as Slo  # noqa: PLC0414 -- re-exported: it was defined here

ALL_CAPABILITIES = tuple(Capability)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class GpuSpecIn(_Strict):
    id: str = Field(min_length=1, description="Unique in the whole cluster.")
    type: str | None = Field(None, description="A GPU preset name, e.g. 'l40' or 'a100-40gb-pcie'.")
    hbm_bytes: GpuByteCount | None = None
    reserved_bytes: GpuByteCount = Field(0, description="Workspace the planner must leave free.")
    hbm_bytes_per_s: BytesPerSecond | None = None
    bf16_flops: FlopsPerSecond | None = None
    h2d_bytes_per_s: BytesPerSecond | None = None
    d2h_bytes_per_s: BytesPerSecond | None = None

    @model_validator(mode="after")
    def _type_or_explicit(self) -> GpuSpecIn:
        if self.type is None:
            missing = [
                name
                for name in ("hbm_bytes", "hbm_bytes_per_s", "bf16_flops", "h2d_bytes_per_s")
                if getattr(self, name) is None
            ]
            if missing:
                raise ValueError(f"without a 'type' preset, give {', '.join(missing)}")
        if self.hbm_bytes is not None and self.reserved_bytes > self.hbm_bytes:
            raise ValueError(f"reserved_bytes: {self.reserved_bytes} is more than the GPU's hbm_bytes {self.hbm_bytes}")
        return self


class NodeEngineIn(_Strict):
    """An inference engine of the node and the model it serves, where models are served only through such
    engines (vLLM, SGLang): launched with tensor parallelism on fixed GPUs, it can wake, sleep or reload
    there, but not move to other cards."""

    model: str
    gpus: list[str] = Field(
        default_factory=list, description="The GPU ids it runs on (its tensor-parallel group); empty: any group."
    )
    kind: EngineKind | None = Field(
        None,
        description="vllm, sglang or local (README, 'Engines as they are'). None: not declared; the planner "
        "plans every move on it, as the local executor can carry out.",
    )
    features: list[EngineFeature] | None = Field(
        None,
        description="Launch features: lmcache, sleep_mode, dev_mode (vLLM); sleep_mode, cpu_backup (SGLang). "
        "None: none.",
    )
    management: Management | None = Field(
        None,
        description="managed (the node agent starts and stops it) or adopted (only sleep and wake). None: managed.",
    )

    @model_validator(mode="after")
    def _kind_and_its_features(self) -> NodeEngineIn:
        if self.kind is None:
            if self.features is not None or self.management is not None:
                raise ValueError("features and management describe an engine kind: give 'kind' too")
            return self
        if self.kind not in ENGINE_KINDS:
            hint = (
                " (LMCache is a feature of a vllm engine: features [lmcache])"
                if self.kind is EngineKind.LMCACHE
                else ""
            )
            raise ValueError(
                f"kind: {self.kind.value!r} is no engine kind; known: {', '.join(k.value for k in ENGINE_KINDS)}{hint}"
            )
        features = self.features or []
        _require_unique([f.value for f in features], "feature")
        foreign = [f.value for f in features if f not in KIND_FEATURES[self.kind]]
        if foreign:
            raise ValueError(f"features: a {self.kind.value} engine has no {', '.join(foreign)}")
        return self


class NodeIn(_Strict):
    id: str = Field(min_length=1)
    host_dram_bytes: ByteCount | None = None
    nvme_bytes: ByteCount | None = None
    nvme_read_bytes_per_s: BytesPerSecond | None = None
    nvme_write_bytes_per_s: BytesPerSecond | None = None
    capabilities: list[Capability] = Field(default_factory=lambda: list(ALL_CAPABILITIES))
    gpus: list[GpuSpecIn] = Field(default_factory=list)
    engines: list[NodeEngineIn] | None = Field(
        None,
        description="The node's engines, where it serves models only through them: only their models are "
        "served here, each from its engine's GPUs where they are given. None: any model, on any group.",
    )

    @model_validator(mode="after")
    def _engines_on_own_gpus(self) -> NodeIn:
        own = {g.id for g in self.gpus}
        engines = self.engines or []
        _require_unique([e.model for e in engines], "engine model")
        for i, engine in enumerate(engines):
            _require_unique(engine.gpus, f"GPU in engines[{i}].gpus")
            for j, gpu in enumerate(engine.gpus):
                if gpu not in own:
                    raise ValueError(
                        f"engines[{i}].gpus[{j}]: {gpu!r} is not a GPU of node {self.id!r}; its GPUs: {sorted(own)}"
                    )
        return self


class ClusterIn(_Strict):
    nodes: list[NodeIn] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_ids(self) -> ClusterIn:
        _require_unique([n.id for n in self.nodes], "node id")
        _require_unique([g.id for n in self.nodes for g in n.gpus], "gpu id")
        return self


class ModelIn(_Strict):
    id: str = Field(min_length=1)
    preset: str | None = Field(None, description="A model preset name, e.g. 'qwen2.5-7b-instruct'.")
    config: dict[str, Any] | None = Field(None, description="Fields of the model's HF config.json.")
    precisions: list[Precision] | None = Field(
        None, min_length=1, description="Allowed serving precisions, preferred first."
    )
    weights_bytes: dict[Precision, ByteCount] | None = Field(
        None, description="Per precision; for a MoE, the non-expert part only."
    )
    kv_bytes_per_token: ByteCount | None = None
    kv_heads: Annotated[int, Field(ge=1, le=MAX_KV_HEADS)] | None = Field(
        None,
        description="KV heads per layer as the engines cache them: the config's num_key_value_heads, 1 under MLA. "
        "A tensor-parallel rank holds max(1, kv_heads / tp) of them. None: the preset's or config's; unknown "
        "without either, and then the KV splits evenly over a group.",
    )
    experts_bytes: ByteCount | None = Field(None, description="All routed experts of all layers.")
    expert_bytes: ByteCount | None = Field(None, description="One routed expert of one layer.")
    active_params: ParamCount | None = Field(None, description="Parameters read per token.")
    active_expert_bytes_per_token: ByteCount | None = Field(
        None, description="Routed-expert bytes one token reads (top-k experts of every MoE layer)."
    )
    min_gpus: dict[str, Annotated[int, Field(ge=1, le=MAX_TENSOR_PARALLEL)]] = Field(
        default_factory=dict, description="Minimum tensor-parallel degree per GPU type."
    )
    max_context_tokens: Annotated[int, Field(gt=0)] | None = Field(
        None,
        description="The longest request its engines serve (vLLM --max-model-len, SGLang --context-length). "
        "None: the config's max_position_embeddings, as the engines default to; unknown without a preset or config.",
    )

    @field_validator("precisions")
    @classmethod
    def _distinct(cls, value: list[Precision] | None) -> list[Precision] | None:
        if value is not None:
            _require_unique([str(p) for p in value], "precision")
        return value

    @field_validator("config")
    @classmethod
    def _finite_config(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            _require_bounded_numbers(value, "config")
        return value


class SessionIn(_Strict):
    id: str = Field(min_length=1)
    user: str = "default"
    slo: Slo = Slo.INTERACTIVE
    model: str
    active: bool = False
    context_tokens: ContextTokens = 0


class ObjectIn(_Strict):
    kind: Literal["weights", "experts", "kv"]
    model: str
    precision: Precision | None = None
    session: str | None = None

    @model_validator(mode="after")
    def _fields_for_kind(self) -> ObjectIn:
        if self.kind == "weights" and self.precision is None:
            raise ValueError("a weights object needs 'precision'")
        if self.kind == "kv" and self.session is None:
            raise ValueError("a kv object needs 'session'")
        return self


class LocationIn(_Strict):
    tier: Literal["gpu", "host", "nvme"]
    gpu: str | None = None
    node: str | None = None

    @model_validator(mode="after")
    def _fields_for_tier(self) -> LocationIn:
        if self.tier == "gpu" and self.gpu is None:
            raise ValueError("a gpu location needs 'gpu'")
        if self.tier != "gpu" and self.node is None:
            raise ValueError(f"a {self.tier} location needs 'node'")
        return self


class ResidencyIn(_Strict):
    object: ObjectIn
    location: LocationIn
    bytes: ByteCount


class PredictorIn(_Strict):
    """Priors for the switch predictor; observations refine them online."""

    handoff: dict[str, dict[str, Weight]] = Field(
        default_factory=dict,
        description="Model -> next model -> relative frequency of a session's next request.",
    )
    stay_probability: Fraction = Field(
        0.6, description="Without priors or observations: chance the next request stays on the same model."
    )
    turn_gap_seconds: PositiveSeconds = Field(30.0, description="Mean gap between a session's turns (tool calls).")


class SloClassConstants(_Strict):
    """A figure per SLO class: a weight, or a target in seconds."""

    blocking: PositiveWeight
    interactive: PositiveWeight
    background: PositiveWeight

    def of(self, slo: Slo) -> float:
        return float(getattr(self, slo.value))


class CostConstants(_Strict):
    """One set of constants for every solver and for the evaluator.

    The objective is in seconds of SLO-weighted switch latency; prices convert
    bytes into that unit.
    """

    gpu_price_seconds_per_gib: Seconds = Field(
        0.02, description="Objective cost of holding one GiB of HBM over the horizon (the warm memory tax)."
    )
    slo_weights: SloClassConstants = SloClassConstants(blocking=4.0, interactive=2.0, background=1.0)
    slo_targets_seconds: SloClassConstants = SloClassConstants(blocking=2.0, interactive=5.0, background=30.0)
    violation_penalty_seconds: Seconds = Field(
        10.0, description="Added per predicted request whose switch latency exceeds its SLO target."
    )
    unserved_penalty_seconds: Seconds = Field(
        600.0, description="Charged per active request the plan cannot serve (it waits)."
    )
    horizon_seconds: PositiveSeconds = Field(300.0, description="How far ahead the predicted requests reach.")
    prefill_efficiency: float = Field(
        0.5, gt=0, le=1, description="Fraction of dense bf16 FLOP/s that prefill achieves."
    )
    expert_popularity_skew: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Hit rate of the hottest fraction f of routed experts is f**skew (1 = uniform routing).",
    )
    output_tokens_per_request: Tokens = Field(256, description="Decode length assumed per predicted request.")
    degraded_precision_seconds: Seconds = Field(
        1.0, description="Cost per request served at a precision other than the model's preferred one."
    )
    move_weight: Weight = Field(
        0.05, description="Fraction of the seconds spent promoting state that the objective charges."
    )


class Scenario(_Strict):
    cluster: ClusterIn
    models: list[ModelIn] = Field(min_length=1)
    sessions: list[SessionIn] = Field(default_factory=list)
    residency: list[ResidencyIn] = Field(default_factory=list)
    predictor: PredictorIn = PredictorIn()
    constants: CostConstants = CostConstants()

    @model_validator(mode="after")
    def _references(self) -> Scenario:
        model_ids = [m.id for m in self.models]
        _require_unique(model_ids, "model id")
        _require_unique([s.id for s in self.sessions], "session id")
        known_models = set(model_ids)
        sessions = {s.id: s for s in self.sessions}
        nodes = {n.id for n in self.cluster.nodes}
        gpus = {g.id for n in self.cluster.nodes for g in n.gpus}
        for i, n in enumerate(self.cluster.nodes):
            for j, engine in enumerate(n.engines or []):
                if engine.model not in known_models:
                    raise ValueError(
                        f"cluster.nodes[{i}].engines[{j}].model: unknown model {engine.model!r}; known: {sorted(known_models)}"
                    )
        for i, s in enumerate(self.sessions):
            if s.model not in known_models:
                raise ValueError(f"sessions[{i}].model: unknown model {s.model!r}; known: {sorted(known_models)}")
        seen: set[tuple[Any, ...]] = set()
        for i, r in enumerate(self.residency):
            where = f"residency[{i}]"
            if r.object.model not in known_models:
                raise ValueError(f"{where}.object.model: unknown model {r.object.model!r}")
            if r.object.kind == "kv" and r.object.session not in sessions:
                raise ValueError(f"{where}.object.session: unknown session {r.object.session!r}")
            loc = r.location
            if loc.tier == "gpu" and loc.gpu not in gpus:
                raise ValueError(f"{where}.location.gpu: unknown gpu {loc.gpu!r}")
            if loc.tier != "gpu" and loc.node not in nodes:
                raise ValueError(f"{where}.location.node: unknown node {loc.node!r}")
            key = (r.object.kind, r.object.model, r.object.precision, r.object.session, loc.tier, loc.gpu, loc.node)
            if key in seen:
                raise ValueError(f"{where}: a location holds at most one copy of an object; this one repeats")
            seen.add(key)
        for src, row in self.predictor.handoff.items():
            for model in (src, *row):
                if model not in known_models:
                    raise ValueError(f"predictor.handoff: unknown model {model!r}")
        return self


def _require_bounded_numbers(value: Any, where: str) -> None:
    """Every number in a JSON tree is finite and within MAX_CONFIG_MAGNITUDE (a config.json holds sizes)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _require_bounded_numbers(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _require_bounded_numbers(item, f"{where}[{i}]")
    elif isinstance(value, int | float) and not isinstance(value, bool) and not abs(value) <= MAX_CONFIG_MAGNITUDE:
        raise ValueError(f"{where}: not a finite number within ±{MAX_CONFIG_MAGNITUDE:.0e}")


def _require_unique(values: list[str], what: str) -> None:
    seen: set[str] = set()
    for v in values:
        if v in seen:
            raise ValueError(f"duplicate {what} {v!r}")
        seen.add(v)


class ScenarioError(ValueError):
    """A scenario file that cannot be read or does not validate; the message names the field."""


def format_validation_error(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        path = ".".join(str(p) for p in item["loc"]) or "(top level)"
        lines.append(f"{path}: {item['msg']}")
    return "\n".join(lines)


def parse_scenario(data: Any) -> Scenario:
    try:
        return Scenario.model_validate(data)
    except ValidationError as error:
        raise ScenarioError(format_validation_error(error)) from None


def load_scenario(path: Path) -> Scenario:
    """Read a JSON or YAML scenario file (YAML is a superset of JSON)."""
    try:
        text = path.read_text()
    except OSError as error:
        raise ScenarioError(f"{path}: {error.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ScenarioError(f"{path}: not valid JSON or YAML: {error}") from None
    return parse_scenario(data)
