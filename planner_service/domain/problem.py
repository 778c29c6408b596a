"""A scenario resolved into the plain, typed records the planners work on.

Presets and configs are expanded into bytes here, once, so planners never
look at presets. Everything is immutable; `Problem.residency` is the
confirmed placement.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from planner_service.domain.architecture import PRECISION_BYTES, Architecture, AttentionKind
from planner_service.domain.engines import DeclaredEngine, EngineKind, EngineState, Management, kv_bytes_per_gpu
from planner_service.domain.hardware import (
    DEFAULT_HOST_DRAM_BYTES,
    DEFAULT_NVME_BYTES,
    DEFAULT_NVME_READ_BYTES_PER_S,
    DEFAULT_NVME_WRITE_BYTES_PER_S,
    gpu_preset,
)
from planner_service.domain.model_presets import model_preset
from planner_service.domain.scenario import Capability, CostConstants, ModelIn, Scenario, ScenarioError, Slo
from planner_service.domain.state import Location, Placement, StateObject, location_from_json, object_from_json


@dataclass(frozen=True, slots=True)
class Gpu:
    id: str
    node: str
    type: str
    capacity_bytes: int  # HBM the planner may fill: total minus reserved workspace
    hbm_bytes_per_s: float
    bf16_flops: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    # GPU -> GPU rate of the link a tensor-parallel all-reduce crosses (the preset's `peer_bytes_per_s`;
    # 0: unknown, the card's h2d rate stands in: a peer copy crosses the same PCIe link)
    peer_bytes_per_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Node:
    id: str
    host_bytes: int
    nvme_bytes: int
    nvme_read_bytes_per_s: float
    nvme_write_bytes_per_s: float
    capabilities: frozenset[Capability]
    gpus: tuple[str, ...]
    # the models it can serve, where it serves them only through its engines (None: any; `NodeIn.engines`)
    serves: frozenset[str] | None = None
    # model -> the GPU ids (sorted) of its engine here, where that runs on fixed GPUs
    engine_gpus: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    # model -> its engine's declared kind, features and management, where the scenario gives a kind
    declared_engines: Mapping[str, DeclaredEngine] = field(default_factory=lambda: MappingProxyType({}))

    def can_serve(self, model_id: str) -> bool:
        return self.serves is None or model_id in self.serves

    def engine_kind(self, model_id: str) -> EngineKind | None:
        """The kind of the engine serving `model_id` here, where one is declared (None: plan as today)."""
        declared = self.declared_engines.get(model_id)
        return None if declared is None else declared.kind


@dataclass(frozen=True, slots=True)
class ModelSpec:
    id: str
    precisions: tuple[str, ...]  # preferred first
    weights_bytes: Mapping[str, int]  # per precision; a MoE's non-expert part
    kv_bytes_per_token: int
    experts_bytes: int  # all routed experts, 0 for a dense model
    expert_bytes: int  # one routed expert of one layer: the unit of partial residency
    active_params: int
    active_expert_bytes_per_token: int
    min_gpus: Mapping[str, int]
    # attention heads, where the preset or config gives them (0: unknown): vLLM and SGLang split them over a
    # tensor-parallel group and refuse a group size that does not divide them (`tensor_parallel_ok`)
    attention_heads: int = 0
    # the longest request its engines serve, in tokens (0: unknown): an engine's KV pool must hold one such
    # request (engines.min_kv_pool_bytes_per_gpu)
    max_context_tokens: int = 0
    # decoder layers and hidden size, where the preset or config gives them (0: unknown): what a tensor-parallel
    # group all-reduces per token (costs.tp_allreduce_seconds_per_token)
    num_layers: int = 0
    hidden_size: int = 0
    # prefill FLOPs of one (query, key) pair over all layers (Architecture.attention_flops_per_pair; 0: unknown,
    # prefill priced linear in tokens): what the attention adds as the context grows
    attention_flops_per_pair: int = 0
    # KV heads per layer as vLLM and SGLang lay the cache out: the config's num_key_value_heads, 1 under MLA
    # (one latent every tensor-parallel rank holds whole); 0 where unknown: the KV splits evenly over a group
    # (engines.kv_split_ways)
    kv_heads: int = 0

    def kv_bytes_per_gpu(self, tokens: int, tp: int) -> int:
        """The KV `tokens` of context put on each GPU of a tensor-parallel group of `tp` (engines.kv_bytes_per_gpu)."""
        return kv_bytes_per_gpu(self.kv_bytes_per_token, tokens, self.kv_heads, tp)

    @property
    def is_moe(self) -> bool:
        return self.experts_bytes > 0

    @property
    def preferred(self) -> str:
        return self.precisions[0]


STAND_IN = "expected-"  # the id prefix of the planner's stand-in sessions (the service refuses events for them)


def is_stand_in(session_id: str | None) -> bool:
    """Whether a session id names a stand-in: a seat the online planner keeps for the recent load."""
    return session_id is not None and session_id.startswith(STAND_IN)


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    user: str
    slo: Slo
    model: str
    active: bool
    context_tokens: int

    @property
    def stand_in(self) -> bool:
        return is_stand_in(self.id)


@dataclass(frozen=True, slots=True)
class Problem:
    nodes: Mapping[str, Node]
    gpus: Mapping[str, Gpu]
    models: Mapping[str, ModelSpec]
    sessions: Mapping[str, Session]
    residency: Mapping[tuple[StateObject, Location], int]
    constants: CostConstants
    # session -> next model -> probability of the session's next request going there
    next_model: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    # (node, model) -> the state and GPU group its engine reported (a node agent's heartbeat); where given it
    # wins over the state derived from the placement (planner/engine_instances.py)
    observed_engines: Mapping[tuple[str, str], tuple[EngineState, tuple[str, ...]]] = field(default_factory=dict)
    # (node, model) -> the KV pool per GPU its running or sleeping engine was launched with, where a node
    # reported it (the heartbeat's `kv_pool_bytes_per_gpu`; a wake keeps it); where absent the planner derives
    # it (engine_holdings.launched_pools)
    engine_pools: Mapping[tuple[str, str], int] = field(default_factory=dict)
    # (node, model) -> the GPU expert share a sleeping MoE engine was launched with, where its node reported it
    # (the heartbeat's `gpu_expert_fraction`): its wake maps those experts back with its weights
    # (vllm/device_allocator/cumem.py `CuMemAllocator.wake_up` restores every allocation its sleep offloaded)
    asleep_expert_fractions: Mapping[tuple[str, str], float] = field(default_factory=dict)

    def size_of(self, obj: StateObject) -> int:
        """Full size of an object: what residency fractions are measured against."""
        model = self.models[obj.model]
        if obj.kind == "weights":
            assert obj.precision is not None
            return model.weights_bytes[obj.precision]
        if obj.kind == "experts":
            return model.experts_bytes
        assert obj.session is not None  # a KV object
        return self.sessions[obj.session].context_tokens * model.kv_bytes_per_token

    def capacity_of(self, loc: Location) -> int:
        if loc.tier == "gpu":
            return self.gpus[loc.id].capacity_bytes
        node = self.nodes[loc.id]
        return node.host_bytes if loc.tier == "host" else node.nvme_bytes

    def node_of(self, loc: Location) -> str:
        return self.gpus[loc.id].node if loc.tier == "gpu" else loc.id


def resolve_model(spec: ModelIn, where: str) -> ModelSpec:
    """Sizes from the preset or config, then explicit fields on top."""
    arch: Architecture | None = None
    precisions: tuple[str, ...] | None = None
    if spec.preset is not None:
        try:
            preset = model_preset(spec.preset)
        except KeyError as error:
            raise ScenarioError(f"{where}.preset: {error.args[0]}") from None
        arch = preset.architecture
        precisions = tuple(preset.default_precisions)
    if spec.config is not None:
        try:
            arch = Architecture.from_hf_config(spec.config)
        except ValueError as error:
            raise ScenarioError(f"{where}.config: {error}") from None
    if spec.precisions is not None:
        precisions = tuple(str(p) for p in spec.precisions)
    if precisions is None:
        precisions = tuple(str(p) for p in spec.weights_bytes) if spec.weights_bytes else ("bf16",)
    preferred = precisions[0]

    weights: dict[str, int] = {}
    kv_per_token = experts = expert = active_params = active_expert_per_token = 0
    if arch is not None:
        weights = {p: arch.dense_weight_bytes(p) for p in precisions}
        kv_per_token = arch.kv_bytes_per_token()
        active_params = arch.active_params
        if arch.is_moe:
            experts = arch.experts_bytes(preferred)
            expert = arch.expert_bytes(preferred)
            # top-k routed experts in every MoE layer are read per token
            active_expert_per_token = arch.n_moe_layers * arch.experts_per_token * expert
    if spec.weights_bytes is not None:
        weights.update({str(p): b for p, b in spec.weights_bytes.items()})
    missing = [p for p in precisions if p not in weights]
    if missing:
        raise ScenarioError(f"{where}.weights_bytes: no size for precision {', '.join(missing)}")
    if spec.kv_bytes_per_token is not None:
        kv_per_token = spec.kv_bytes_per_token
    elif arch is None:
        raise ScenarioError(f"{where}.kv_bytes_per_token: required without a preset or config")
    if spec.experts_bytes is not None:
        experts = spec.experts_bytes
    if spec.expert_bytes is not None:
        expert = spec.expert_bytes
    if experts and not expert:
        raise ScenarioError(f"{where}.expert_bytes: required when experts_bytes is given")
    if experts and expert > experts:
        raise ScenarioError(f"{where}.expert_bytes: larger than experts_bytes")
    if spec.active_params is not None:
        active_params = spec.active_params
    elif not active_params:
        active_params = int(weights[preferred] / PRECISION_BYTES[preferred])
    if spec.active_expert_bytes_per_token is not None:
        active_expert_per_token = spec.active_expert_bytes_per_token
    elif experts and not active_expert_per_token:
        active_expert_per_token = expert
    return ModelSpec(
        id=spec.id,
        precisions=precisions,
        weights_bytes=MappingProxyType(weights),
        kv_bytes_per_token=kv_per_token,
        experts_bytes=experts,
        expert_bytes=expert,
        active_params=active_params,
        active_expert_bytes_per_token=active_expert_per_token,
        min_gpus=MappingProxyType(dict(spec.min_gpus)),
        attention_heads=arch.num_attention_heads if arch is not None else 0,
        max_context_tokens=spec.max_context_tokens or (arch.max_position_embeddings if arch is not None else 0),
        num_layers=arch.num_layers if arch is not None else 0,
        hidden_size=arch.hidden_size if arch is not None else 0,
        attention_flops_per_pair=arch.attention_flops_per_pair if arch is not None else 0,
        kv_heads=spec.kv_heads or _kv_heads(arch),
    )


def _kv_heads(arch: Architecture | None) -> int:
    """The KV heads per layer the engines cache (`ModelSpec.kv_heads`): 1 under MLA, whose latent vLLM keeps
    as a single head (vllm/config.py `ModelConfig.get_num_kv_heads`: "When using MLA during decode it becomes
    MQA"); 0 without a preset or config."""
    if arch is None:
        return 0
    return 1 if arch.attention is AttentionKind.mla else arch.num_kv_heads


def _resolve_gpus(scenario: Scenario) -> dict[str, Gpu]:
    gpus: dict[str, Gpu] = {}
    for i, node in enumerate(scenario.cluster.nodes):
        for j, g in enumerate(node.gpus):
            where = f"cluster.nodes[{i}].gpus[{j}]"
            base = None
            if g.type is not None:
                try:
                    base = gpu_preset(g.type)
                except KeyError as error:
                    raise ScenarioError(f"{where}.type: {error.args[0]}") from None

            def pick(explicit: float | None, preset_value: float | None) -> float:
                return explicit if explicit is not None else preset_value  # type: ignore[return-value]  # GpuSpecIn checks that a preset or an explicit value gives each field

            hbm = int(pick(g.hbm_bytes, base.hbm_bytes if base else None))
            if g.reserved_bytes > hbm:
                raise ScenarioError(f"{where}.reserved_bytes: larger than the GPU's {hbm} HBM bytes")
            h2d = pick(g.h2d_bytes_per_s, base.h2d_bytes_per_s if base else None)
            gpus[g.id] = Gpu(
                id=g.id,
                node=node.id,
                type=g.type or "custom",
                capacity_bytes=hbm - g.reserved_bytes,
                hbm_bytes_per_s=pick(g.hbm_bytes_per_s, base.hbm_bytes_per_s if base else None),
                bf16_flops=pick(g.bf16_flops, base.bf16_flops if base else None),
                h2d_bytes_per_s=h2d,
                d2h_bytes_per_s=pick(g.d2h_bytes_per_s, base.d2h_bytes_per_s if base else h2d),
                peer_bytes_per_s=base.peer_bytes_per_s if base else 0.0,
            )
    return gpus


def compile_problem(scenario: Scenario, next_model: Mapping[str, Mapping[str, float]]) -> Problem:
    """Resolve a validated scenario; `next_model` comes from the switch predictor."""
    gpus = _resolve_gpus(scenario)
    nodes = {
        n.id: Node(
            id=n.id,
            host_bytes=n.host_dram_bytes if n.host_dram_bytes is not None else DEFAULT_HOST_DRAM_BYTES,
            nvme_bytes=n.nvme_bytes if n.nvme_bytes is not None else DEFAULT_NVME_BYTES,
            nvme_read_bytes_per_s=n.nvme_read_bytes_per_s or DEFAULT_NVME_READ_BYTES_PER_S,
            nvme_write_bytes_per_s=n.nvme_write_bytes_per_s or DEFAULT_NVME_WRITE_BYTES_PER_S,
            capabilities=frozenset(n.capabilities),
            gpus=tuple(g.id for g in n.gpus),
            serves=None if n.engines is None else frozenset(e.model for e in n.engines),
            engine_gpus=MappingProxyType({e.model: tuple(sorted(e.gpus)) for e in n.engines or [] if e.gpus}),
            declared_engines=MappingProxyType(
                {
                    e.model: DeclaredEngine(
                        kind=e.kind,
                        features=frozenset(e.features or ()),
                        management=e.management or Management.MANAGED,
                    )
                    for e in n.engines or []
                    if e.kind is not None
                }
            ),
        )
        for n in scenario.cluster.nodes
    }
    models = {m.id: resolve_model(m, f"models[{i}]") for i, m in enumerate(scenario.models)}
    sessions = {s.id: Session(s.id, s.user, s.slo, s.model, s.active, s.context_tokens) for s in scenario.sessions}
    residency: Placement = {}
    for i, r in enumerate(scenario.residency):
        obj = object_from_json(r.object.model_dump())
        if obj.kind == "weights" and obj.precision not in models[obj.model].weights_bytes:
            raise ScenarioError(
                f"residency[{i}].object.precision: model {obj.model!r} is not served at {obj.precision}"
            )
        if obj.kind == "experts" and not models[obj.model].is_moe:
            raise ScenarioError(f"residency[{i}].object: model {obj.model!r} has no routed experts")
        if r.bytes:
            residency[(obj, location_from_json(r.location.model_dump()))] = r.bytes
    problem = Problem(
        nodes=MappingProxyType(nodes),
        gpus=MappingProxyType(gpus),
        models=MappingProxyType(models),
        sessions=MappingProxyType(sessions),
        residency=MappingProxyType(residency),
        constants=scenario.constants,
        next_model=MappingProxyType(dict(next_model)),
    )
    _check_residency_sizes(problem)
    return problem


def with_state(
    problem: Problem,
    sessions: Iterable[Session],
    residency: Mapping[tuple[StateObject, Location], int],
    next_model: Mapping[str, Mapping[str, float]],
) -> Problem:
    """`problem` with other sessions, residency and predictions: what `compile_problem` gives for its scenario
    with them, checked the same way, without resolving the catalog and the cluster again (the costly part).
    Residency entries are kept in `placement_to_json`'s order, as a compiled scenario has them."""
    by_id = {s.id: s for s in sessions}
    placed: Placement = {}
    for (obj, loc), nbytes in sorted(residency.items()):
        if nbytes <= 0:
            continue
        where = f"residency: {obj.label()} at {loc.label()}"
        model = problem.models.get(obj.model)
        if model is None:
            raise ScenarioError(f"{where}: unknown model {obj.model!r}")
        if obj.kind == "kv" and obj.session not in by_id:
            raise ScenarioError(f"{where}: unknown session {obj.session!r}")
        if loc.id not in (problem.gpus if loc.tier == "gpu" else problem.nodes):
            raise ScenarioError(f"{where}: unknown {loc.tier} location {loc.id!r}")
        if obj.kind == "weights" and obj.precision not in model.weights_bytes:
            raise ScenarioError(f"{where}: model {obj.model!r} is not served at {obj.precision}")
        if obj.kind == "experts" and not model.is_moe:
            raise ScenarioError(f"{where}: model {obj.model!r} has no routed experts")
        placed[(obj, loc)] = nbytes
    out = replace(
        problem,
        sessions=MappingProxyType(by_id),
        residency=MappingProxyType(placed),
        next_model=MappingProxyType(dict(next_model)),
    )
    _check_residency_sizes(out)
    return out


def _check_residency_sizes(problem: Problem) -> None:
    used: dict[Location, int] = {}
    for (obj, loc), nbytes in problem.residency.items():
        if nbytes > problem.size_of(obj):
            raise ScenarioError(
                f"residency: {obj.label()} at {loc.label()} holds {nbytes} bytes, more than its full size "
                f"{problem.size_of(obj)}"
            )
        used[loc] = used.get(loc, 0) + nbytes
    for loc, nbytes in sorted(used.items()):
        if nbytes > problem.capacity_of(loc):
            raise ScenarioError(
                f"residency: {loc.label()} holds {nbytes} bytes, more than its capacity {problem.capacity_of(loc)}"
            )


def native_precision_scenario(scenario: Scenario) -> Scenario:
    """The scenario with every model allowed only its preferred (first) precision, and the copies of its other
    precisions left out: the same precision for every policy, so no policy buys latency with a degraded model."""
    data = scenario.model_dump(mode="json")
    preferred: dict[str, str] = {}
    for i, spec in enumerate(scenario.models):
        preferred[spec.id] = resolve_model(spec, f"models[{i}]").preferred
    for model in data["models"]:
        model["precisions"] = [preferred[model["id"]]]
        if model.get("weights_bytes"):
            model["weights_bytes"] = {preferred[model["id"]]: model["weights_bytes"][preferred[model["id"]]]}
    data["residency"] = [
        r
        for r in data["residency"]
        if r["object"]["kind"] != "weights" or r["object"]["precision"] == preferred[r["object"]["model"]]
    ]
    return Scenario.model_validate(data)
