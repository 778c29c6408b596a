"""The engine model: what an inference engine on a node can be, what each of its states holds, which
transitions each engine kind offers, and what each transition costs (DESIGN.md §5).

Pure data and functions on the standard library and the wire's enums, so that the planner, the MILP, the
invariant checker, the simulator and the node agent (which may import this module and the wire package,
nothing else of the server) read one model.

An *engine instance* is an engine kind serving one model at one precision on one GPU group with fixed
launch settings (KV pool, GPU share of a MoE's routed experts, maximum context, launch features). Changing
any of those is a restart into another instance. An instance is in one of four states:

    running           weights shard + KV pool + CUDA context on every GPU of its group
    asleep_host       level 1: weights in pinned host RAM, KV pool freed; the CUDA context stays on the GPUs
    asleep_discarded  level 2: weights and KV discarded; the CUDA context stays on the GPUs
    stopped           nothing (the checkpoint may still sit in the page cache)

Transitions and the engines' behaviour they rest on (the README's "Engines as they are" tables cite the
engines' source files; `RULES` below carries the same citations):

    vllm    sleep level 1 / 2 and wake need --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1 (the endpoints
            exist only in dev mode); `mode=wait` drains running requests (the default aborts them), so a
            sleep needs no prior drain but pays for it; a level-2 wake reloads the weights from disk
            (`collective_rpc reload_weights`); wake frees the host backup.
    sglang  release / resume memory occupation need --enable-memory-saver and an idle engine (release
            asserts no request in flight: drain first); released weights stay in host RAM only with
            --enable-weights-cpu-backup, so the launch flag decides the sleep level.
    local   the node agent's own executor: every transition, with no precondition.
    adopted engines (someone else starts them): only sleep and wake, never start, stop or restart.

Per-session KV moves, run-time changes of a MoE's GPU expert share and precision changes of a running
engine are offered only by `local` (`offers`); on vLLM and SGLang those are launch settings or not
addressable at all.

Costs (seconds; `EngineConstants` holds the named constants, `CONSTANT_SOURCES` where each comes from):

    shard            = ceil((weights_bytes + gpu_expert_bytes) / tp)             bytes per GPU of the group
    load(nvme)       = max(checkpoint_bytes / nvme_read, shard / h2d)            one drive feeds every shard
    load(page cache) = max(shard / page_cache_read, shard / h2d)                 each rank reads its own shard
    wake from host   = wake_fixed + shard / h2d                                  level 1
    wake from disk   = wake_fixed + reload_fixed + load(source)                  level 2, then reload_weights
    sleep level 1    = drain + sleep_fixed + shard / d2h                         the backup copy
    sleep level 2    = drain + sleep_fixed
    cold start       = cold_start_fixed + load(source)                           process, load, compile, graphs
    stop             = drain + stop_fixed
    restart          = stop(old) + cold start(new)
    readahead        = checkpoint_bytes / nvme_read                              into the page cache
    drain            = remaining output tokens x seconds per output token

The fixed parts are recalibrated from measured durations by `fold_measurement`, the way link bandwidths
are recalibrated from measured copies (planner_service/service/calibration.py): the modelled bandwidth
part of a measured transition is subtracted and the rest folds into the fixed constant it samples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from types import MappingProxyType

# the engine model's vocabulary crosses the wire in operations and heartbeats
from planner_service.wire.enums import EngineFeature as EngineFeature  # noqa: PLC0414 -- a re-export
from planner_service.wire.enums import EngineKind as EngineKind  # noqa: PLC0414 -- a re-export
from planner_service.wire.enums import EngineState as EngineState  # noqa: PLC0414 -- a re-export
from planner_service.wire.enums import Management as Management  # noqa: PLC0414 -- a re-export
from planner_service.wire.enums import Precondition as Precondition  # noqa: PLC0414 -- a re-export
from planner_service.wire.enums import Transition as Transition  # noqa: PLC0414 -- a re-export

_GIB = 1 << 30
_GB = 10**9

# The kinds the engine model describes. The wire's `lmcache` and `other` are not engines of their own:
# LMCache is a launch feature of a vLLM engine, and an unknown engine offers nothing the planner can price.
ENGINE_KINDS: tuple[EngineKind, ...] = (EngineKind.VLLM, EngineKind.SGLANG, EngineKind.LOCAL)


class RuntimeMove(StrEnum):
    """Moves the planner's promote / demote / drop vocabulary can ask of a running engine."""

    SESSION_KV = "session_kv"  # move or free one session's KV between tiers
    EXPERT_SHARE = "expert_share"  # change how many routed experts sit on GPU while running
    PRECISION = "precision"  # serve the running engine's model at another precision


class ReadFrom(StrEnum):
    """Where a load reads the checkpoint from."""

    NVME = "nvme"
    PAGE_CACHE = "page_cache"  # read ahead (posix_fadvise WILLNEED) or left there by an earlier load


# The state each transition ends in; a read-ahead leaves the instance's state as it was.
AFTER: Mapping[Transition, EngineState] = MappingProxyType(
    {
        Transition.START: EngineState.RUNNING,
        Transition.STOP: EngineState.STOPPED,
        Transition.SLEEP_LEVEL_1: EngineState.ASLEEP_HOST,
        Transition.SLEEP_LEVEL_2: EngineState.ASLEEP_DISCARDED,
        Transition.WAKE: EngineState.RUNNING,
        Transition.RESTART: EngineState.RUNNING,
    }
)

_ASLEEP = frozenset({EngineState.ASLEEP_HOST, EngineState.ASLEEP_DISCARDED})
_UP = frozenset({EngineState.RUNNING}) | _ASLEEP  # a process exists


@dataclass(frozen=True, slots=True)
class Rule:
    """One transition of one engine kind: the states it leaves from, what it needs, and the engine source
    it relies on (a path in the engine's repository)."""

    kind: EngineKind
    transition: Transition
    sources: frozenset[EngineState]
    requires: tuple[Precondition, ...]
    relies_on: str


_VLLM_SLEEP = (
    "vllm/entrypoints/serve/sleep/api_router.py (dev mode only; mode defaults to abort), "
    "vllm/v1/worker/gpu_worker.py (level 1 offloads the 'weights' tag, level 2 none), "
    "vllm/device_allocator/cumem.py (backup to pinned CPU memory, freed on wake)"
)
_SGLANG_RELEASE = (
    "python/sglang/srt/managers/scheduler_update_weights_mixin.py (release asserts no ongoing request), "
    "python/sglang/srt/server_args.py (enable_memory_saver, enable_weights_cpu_backup)"
)
_START_STOP = "the node agent launches and ends the engine process"
_READAHEAD = "posix_fadvise(2) POSIX_FADV_WILLNEED on the checkpoint's files: the kernel's, not the engine's"

_M, _SM, _DM, _CB, _NCB, _DR = (
    Precondition.MANAGED,
    Precondition.SLEEP_MODE,
    Precondition.DEV_MODE,
    Precondition.CPU_BACKUP,
    Precondition.NO_CPU_BACKUP,
    Precondition.DRAINED,
)
_RUN = frozenset({EngineState.RUNNING})
_STOPPED = frozenset({EngineState.STOPPED})


def _rules() -> dict[tuple[EngineKind, Transition], Rule]:
    vllm, sglang, local = EngineKind.VLLM, EngineKind.SGLANG, EngineKind.LOCAL
    t = Transition
    rows = [
        Rule(vllm, t.START, _STOPPED, (_M,), "vllm/engine/arg_utils.py (launch settings are engine arguments)"),
        Rule(vllm, t.STOP, _UP, (_M, _DR), _START_STOP),
        Rule(vllm, t.SLEEP_LEVEL_1, _RUN, (_SM, _DM), _VLLM_SLEEP),
        Rule(vllm, t.SLEEP_LEVEL_2, _RUN, (_SM, _DM), _VLLM_SLEEP),
        Rule(
            vllm,
            t.WAKE,
            _ASLEEP,
            (_SM, _DM),
            "vllm/entrypoints/serve/sleep/api_router.py (/wake_up), vllm/entrypoints/serve/rpc/api_router.py "
            "(/collective_rpc reload_weights after level 2), docs/features/sleep_mode.md",
        ),
        Rule(vllm, t.RESTART, _UP, (_M, _DR), "vllm/engine/arg_utils.py (launch settings are engine arguments)"),
        Rule(sglang, t.START, _STOPPED, (_M,), "python/sglang/srt/server_args.py (launch settings)"),
        Rule(sglang, t.STOP, _UP, (_M, _DR), _START_STOP),
        Rule(sglang, t.SLEEP_LEVEL_1, _RUN, (_SM, _CB, _DR), _SGLANG_RELEASE),
        Rule(sglang, t.SLEEP_LEVEL_2, _RUN, (_SM, _NCB, _DR), _SGLANG_RELEASE),
        Rule(
            sglang,
            t.WAKE,
            _ASLEEP,
            (_SM,),
            "python/sglang/srt/managers/scheduler_update_weights_mixin.py (resume_memory_occupation, "
            "update_weights_from_disk), python/sglang/srt/entrypoints/http_server.py",
        ),
        Rule(sglang, t.RESTART, _UP, (_M, _DR), "python/sglang/srt/server_args.py (launch settings)"),
    ]
    local_source = "clients/agent/executors/local.py (this repository: moves real bytes between tiers)"
    rows += [
        Rule(local, t.START, _STOPPED, (_M,), local_source),
        Rule(local, t.STOP, _UP, (_M,), local_source),
        Rule(local, t.SLEEP_LEVEL_1, _RUN, (), local_source),
        Rule(local, t.SLEEP_LEVEL_2, _RUN, (), local_source),
        Rule(local, t.WAKE, _ASLEEP, (), local_source),
        Rule(local, t.RESTART, _UP, (_M,), local_source),
    ]
    everywhere = frozenset(EngineState)
    rows += [Rule(kind, t.READAHEAD, everywhere, (), _READAHEAD) for kind in (vllm, sglang, local)]
    return {(r.kind, r.transition): r for r in rows}


RULES: Mapping[tuple[EngineKind, Transition], Rule] = MappingProxyType(_rules())

_RUNTIME_MOVES: Mapping[EngineKind, frozenset[RuntimeMove]] = MappingProxyType(
    {
        EngineKind.VLLM: frozenset(),
        EngineKind.SGLANG: frozenset(),
        EngineKind.LOCAL: frozenset(RuntimeMove),
    }
)

# Why vLLM and SGLang cannot make each run-time move (DESIGN.md §5; perf_anchors.md §8).
RUNTIME_REFUSALS: Mapping[RuntimeMove, str] = MappingProxyType(
    {
        RuntimeMove.SESSION_KV: "the engine cannot move or free one request's KV (its pool is LRU inside the "
        "engine; LMCache addresses KV by token ids, not sessions)",
        RuntimeMove.EXPERT_SHARE: "how many routed experts sit on GPU is a launch setting; changing it is a restart",
        RuntimeMove.PRECISION: "the precision is a launch setting; changing it is a restart",
    }
)


def tensor_parallel_ok(kind: EngineKind | None, attention_heads: int, tp: int) -> bool:
    """Whether an engine of `kind` can split a model with `attention_heads` heads over `tp` GPUs. vLLM refuses
    a size that does not divide the heads (vllm/config/__init__.py, `ModelConfig.verify_with_parallel_config`:
    "Total number of attention heads (...) must be divisible by tensor parallel size (...)"); other kinds, and a
    model whose heads are unknown (0), take any size."""
    return kind is not EngineKind.VLLM or attention_heads <= 0 or attention_heads % tp == 0


def offers(kind: EngineKind, move: RuntimeMove) -> bool:
    """Whether an engine of `kind` can carry out `move` while it runs (only `local` can)."""
    return move in _RUNTIME_MOVES.get(kind, frozenset())


# The launch features each kind has (`local` takes any: its executor emulates every engine).
KIND_FEATURES: Mapping[EngineKind, frozenset[EngineFeature]] = MappingProxyType(
    {
        EngineKind.VLLM: frozenset({EngineFeature.LMCACHE, EngineFeature.SLEEP_MODE, EngineFeature.DEV_MODE}),
        EngineKind.SGLANG: frozenset({EngineFeature.SLEEP_MODE, EngineFeature.CPU_BACKUP}),
        EngineKind.LOCAL: frozenset(EngineFeature),
    }
)


@dataclass(frozen=True, slots=True)
class DeclaredEngine:
    """What a node declares of one of its engines, before any launch setting is chosen: the scenario's
    `cluster.nodes[].engines[]` kind, features and management."""

    kind: EngineKind
    features: frozenset[EngineFeature] = frozenset()
    management: Management = Management.MANAGED

    def probe(self) -> EngineInstance:
        """An instance of this declaration, for the rules that read only its kind, features and management
        (`may`, `leaving_transition`): what any instance of it may do."""
        return EngineInstance(self.kind, "probe", "bf16", ("g",), 1, LaunchSettings(0, features=self.features),
                              management=self.management)  # fmt: skip


# LMCache's `max_local_cpu_size` default, 5.0, allocated as `max_local_cpu_size * 1024**3` bytes of host RAM
# by each worker (lmcache/v1/config.py, lmcache/v1/cache_engine.py): one worker per GPU of the group.
LMCACHE_DEFAULT_HOST_BYTES_PER_GPU = 5 * _GIB


# --- KV pools ---------------------------------------------------------------------------------------------
#
# An engine's KV pool is a launch setting. vLLM sizes it from gpu_memory_utilization and refuses to start
# when it cannot hold one request of max_model_len (vllm/v1/core/kv_cache_utils.py,
# `check_enough_kv_cache_memory`: "To serve at least one request with the models's max seq len ..."). SGLang
# sizes max_total_num_tokens from mem_fraction_static, refuses to start at none
# (python/sglang/srt/model_executor/model_runner.py: "Not enough memory. Please try to increase
# --mem-fraction-static") and caps every request's input at max_total_num_tokens - 1
# (python/sglang/srt/managers/tp_worker.py, `max_req_input_len`), so a smaller pool cannot serve the
# model's longest request either. Both keep the pool as launched until a restart.


# --- KV per GPU of a tensor-parallel group ---------------------------------------------------------------
#
# vLLM and SGLang give each rank max(1, kv_heads // tp) of the model's KV heads: "We will replicate the KV
# heads in the case where the number of KV heads is smaller than the tensor parallel size so each GPU has at
# least one KV head" (vllm/config.py `ModelConfig.get_num_kv_heads`; the weights follow it in
# vllm/model_executor/layers/linear.py `QKVParallelLinear`: num_kv_head_replicas = tp_size //
# total_num_kv_heads; python/sglang/srt/configs/model_config.py `get_num_kv_heads`, same formula). Under MLA
# vLLM's `get_num_kv_heads` returns 1 ("When using MLA during decode it becomes MQA") with a head of
# kv_lora_rank + qk_rope_head_dim, and SGLang's `MLATokenToKVPool` (python/sglang/srt/mem_cache/memory_pool.py)
# allocates kv_buffer of shape (tokens, 1, kv_lora_rank + qk_rope_head_dim) per layer on every rank: the
# latent is one KV head that each rank holds whole.


def kv_split_ways(kv_heads: int, tp: int) -> int:
    """Over how many GPUs one token's KV is split on a group of `tp`: each rank holds max(1, kv_heads // tp) of
    the `kv_heads` heads, so a GPU holds kv_bytes_per_token / min(tp, kv_heads) per token (both engines refuse
    a tp that neither divides nor is divided by kv_heads). `kv_heads` is the model's as the engines lay it out
    (`ModelSpec.kv_heads`: 1 under MLA); 0 (unknown) keeps the even split over the group."""
    if tp <= 0 or kv_heads < 0:
        raise ValueError(f"kv split: kv_heads {kv_heads}, tp {tp}")
    return min(tp, kv_heads) if kv_heads else tp


def kv_bytes_per_gpu(kv_bytes_per_token: int, tokens: int, kv_heads: int, tp: int) -> int:
    """The KV bytes `tokens` of context put on each GPU of a group of `tp` (`kv_split_ways`),

        ceil(kv_bytes_per_token x tokens / min(tp, kv_heads))

    e.g. DeepSeek-V3 on 4 cards: every card holds the whole latent, 61 layers x (512 + 64) x 2 bytes per token."""
    return -(-kv_bytes_per_token * tokens // kv_split_ways(kv_heads, tp))


# --- KV pools ---------------------------------------------------------------------------------------------
#
# An engine's KV pool is a launch setting. vLLM sizes it from gpu_memory_utilization and refuses to start
# when it cannot hold one request of max_model_len (vllm/v1/core/kv_cache_utils.py,
# `check_enough_kv_cache_memory`: "To serve at least one request with the models's max seq len ..."). SGLang
# sizes max_total_num_tokens from mem_fraction_static, refuses to start at none
# (python/sglang/srt/model_executor/model_runner.py: "Not enough memory. Please try to increase
# --mem-fraction-static") and caps every request's input at max_total_num_tokens - 1
# (python/sglang/srt/managers/tp_worker.py, `max_req_input_len`), so a smaller pool cannot serve the
# model's longest request either. Both keep the pool as launched until a restart.


def min_kv_pool_bytes_per_gpu(kv_bytes_per_token: int, max_context_tokens: int, tp: int, kv_heads: int = 0) -> int:
    """The smallest pool an engine starts with, per GPU of its group: one request of its maximum context, as
    much of its KV as one rank holds (`kv_bytes_per_gpu`: the whole latent under MLA, one head's share where
    the model has fewer KV heads than `tp`),

        ceil(kv_bytes_per_token x max_context_tokens / min(tp, kv_heads))

    0 where the maximum context or the KV per token is unknown (0)."""
    if kv_bytes_per_token < 0 or max_context_tokens < 0 or tp <= 0:
        raise ValueError(f"min pool: kv_bytes_per_token {kv_bytes_per_token}, max_context_tokens "
                         f"{max_context_tokens}, tp {tp}")  # fmt: skip
    return kv_bytes_per_gpu(kv_bytes_per_token, max_context_tokens, kv_heads, tp)


def kv_pool_tokens(kv_bytes_per_token: int, kv_pool_bytes_per_gpu: int, tp: int, kv_heads: int = 0) -> int:
    """The tokens of KV a pool of `kv_pool_bytes_per_gpu` on each of `tp` GPUs holds, each GPU holding its
    rank's share of every token (the inverse of `min_kv_pool_bytes_per_gpu`); 0 where the KV per token is
    unknown (0)."""
    ways = kv_split_ways(kv_heads, tp)
    return kv_pool_bytes_per_gpu * ways // kv_bytes_per_token if kv_bytes_per_token > 0 else 0


def launch_kv_pool_bytes_per_gpu(minimum: int, planned: int) -> int:
    """The pool a start or restart is launched with, per GPU: what the plan means to keep there, and never
    less than the minimum the engine starts with."""
    return max(minimum, planned)


def kv_held_in_pool(pool_bytes_per_gpu: int, wanted_bytes_per_gpu: int) -> int:
    """The KV a running engine holds on one GPU of its group when `wanted_bytes_per_gpu` of its sessions' KV
    would be there: no more than its pool (the rest is evicted by the pool's LRU: in LMCache's tiers where
    the node has them, else gone and re-prefilled)."""
    return max(0, min(pool_bytes_per_gpu, wanted_bytes_per_gpu))


@dataclass(frozen=True, slots=True)
class LaunchSettings:
    """What an engine is started with; none of it changes until a restart."""

    kv_pool_bytes_per_gpu: int  # the fixed KV pool on each GPU (vLLM: from gpu_memory_utilization)
    gpu_expert_fraction: float = 1.0  # the share of a MoE's routed experts on GPU; the rest in host RAM
    max_context_tokens: int | None = None  # None: the model's own limit
    features: frozenset[EngineFeature] = frozenset()
    lmcache_host_bytes_per_gpu: int = LMCACHE_DEFAULT_HOST_BYTES_PER_GPU  # held only with the lmcache feature

    def __post_init__(self) -> None:
        if self.kv_pool_bytes_per_gpu < 0:
            raise ValueError(f"kv_pool_bytes_per_gpu: {self.kv_pool_bytes_per_gpu} is negative")
        if not 0.0 <= self.gpu_expert_fraction <= 1.0:
            raise ValueError(f"gpu_expert_fraction: {self.gpu_expert_fraction} is not within [0, 1]")
        if self.max_context_tokens is not None and self.max_context_tokens <= 0:
            raise ValueError(f"max_context_tokens: {self.max_context_tokens} is not positive")
        if self.lmcache_host_bytes_per_gpu < 0:
            raise ValueError(f"lmcache_host_bytes_per_gpu: {self.lmcache_host_bytes_per_gpu} is negative")


@dataclass(frozen=True, slots=True)
class EngineInstance:
    """An engine kind serving one model at one precision on one GPU group with fixed launch settings.

    `weights_bytes` and `experts_bytes` are the model's sizes at this precision (the catalog's
    `ModelSpec.weights_bytes[precision]`, the non-expert part of a MoE, and `experts_bytes`), carried here
    so that the engine model needs no catalog.
    """

    kind: EngineKind
    model: str
    precision: str
    gpus: tuple[str, ...]  # the tensor-parallel group
    weights_bytes: int
    launch: LaunchSettings
    experts_bytes: int = 0  # all routed experts; 0 for a dense model
    management: Management = Management.MANAGED
    kv_bytes_per_token: int = 0  # the model's KV per token of context, all layers (0: unknown)
    model_max_context_tokens: int = 0  # the model's own limit, where the launch sets none (0: unknown)
    kv_heads: int = 0  # the model's KV heads as the engines lay them out (`ModelSpec.kv_heads`; 0: unknown)

    def __post_init__(self) -> None:
        if self.kind not in ENGINE_KINDS:
            raise ValueError(f"kind: {self.kind.value!r} is no engine kind; known: {[k.value for k in ENGINE_KINDS]}")
        if not self.gpus or len(set(self.gpus)) != len(self.gpus):
            raise ValueError(f"gpus: {list(self.gpus)} is not a group of distinct GPUs")
        if self.weights_bytes <= 0 or self.experts_bytes < 0:
            raise ValueError(f"sizes: weights {self.weights_bytes}, experts {self.experts_bytes}")
        if self.kv_bytes_per_token < 0 or self.model_max_context_tokens < 0 or self.kv_heads < 0:
            raise ValueError(
                f"kv_bytes_per_token {self.kv_bytes_per_token}, model_max_context_tokens "
                f"{self.model_max_context_tokens}, kv_heads {self.kv_heads}: not non-negative"
            )

    @property
    def max_context_tokens(self) -> int:
        """The longest request it serves: the launch's limit, else the model's own (0: unknown)."""
        return self.launch.max_context_tokens or self.model_max_context_tokens

    @property
    def min_kv_pool_bytes_per_gpu(self) -> int:
        """The smallest KV pool it starts with (`min_kv_pool_bytes_per_gpu`)."""
        return min_kv_pool_bytes_per_gpu(self.kv_bytes_per_token, self.max_context_tokens, self.tp, self.kv_heads)

    @property
    def tp(self) -> int:
        """Tensor-parallel degree: the GPUs the shards split over."""
        return len(self.gpus)

    def has(self, feature: EngineFeature) -> bool:
        return feature in self.launch.features

    @property
    def gpu_expert_bytes(self) -> int:
        """Routed-expert bytes on the group's GPUs (the launch share of all experts)."""
        return math.floor(self.experts_bytes * self.launch.gpu_expert_fraction)

    @property
    def shard_bytes(self) -> int:
        """Weight bytes on each GPU: non-expert weights and GPU experts split evenly over the group."""
        return math.ceil((self.weights_bytes + self.gpu_expert_bytes) / self.tp)

    @property
    def checkpoint_bytes(self) -> int:
        """What a load reads from disk: every weight, the experts kept in host RAM included."""
        return self.weights_bytes + self.experts_bytes


_FIXED_SECONDS = (
    "wake_fixed_seconds",
    "reload_fixed_seconds",
    "sleep_fixed_seconds",
    "cold_start_fixed_seconds",
    "stop_fixed_seconds",
)


@dataclass(frozen=True, slots=True)
class EngineConstants:
    """The named constants of the transition costs; `CONSTANT_SOURCES` says where each comes from."""

    wake_fixed_seconds: float = 0.1
    reload_fixed_seconds: float = 0.7
    sleep_fixed_seconds: float = 0.1
    cold_start_fixed_seconds: float = 30.0
    stop_fixed_seconds: float = 2.0
    page_cache_read_bytes_per_s: float = 10.0 * _GB
    context_bytes_per_gpu: int = _GIB

    def __post_init__(self) -> None:
        for name in _FIXED_SECONDS + ("page_cache_read_bytes_per_s", "context_bytes_per_gpu"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: {value} is not a finite non-negative number")
        if self.page_cache_read_bytes_per_s <= 0:
            raise ValueError("page_cache_read_bytes_per_s: must be positive")


MEASURED = "measured"  # a source that is a published measurement
DEFAULT = "default"  # a project default, to be replaced by measurement (`fold_measurement`)

# constant -> (measured | default, where it comes from)
CONSTANT_SOURCES: Mapping[str, tuple[str, str]] = MappingProxyType(
    {
        "wake_fixed_seconds": (
            MEASURED,
            (
                "perf_anchors.md §1, vLLM sleep mode: 'Level 1: **0.1–6 s**' (a 0.6B model's wake, whose copy is "
                "negligible, is the low end: the fixed part)"
            ),
        ),
        "reload_fixed_seconds": (
            MEASURED,
            "perf_anchors.md §1, vLLM sleep mode: 'Level 2: **0.8–2.6 s**'; the low end less wake_fixed_seconds",
        ),
        "sleep_fixed_seconds": (DEFAULT, "no published figure; set equal to wake_fixed_seconds"),
        "cold_start_fixed_seconds": (
            MEASURED,
            (
                "perf_anchors.md §1, vLLM sleep mode: 'A full reload is **30–100+ s per switch**' (the low end; "
                "the copy is a few seconds of it)"
            ),
        ),
        "stop_fixed_seconds": (DEFAULT, "no published figure: process exit and memory release"),
        "page_cache_read_bytes_per_s": (
            DEFAULT,
            (
                "no published figure: one rank's read of its shard out of DRAM; the copy to the GPU after it runs "
                "at perf_anchors.md §0's 'Pinned H2D measures about 25 GB/s on PCIe4'"
            ),
        ),
        "context_bytes_per_gpu": (
            MEASURED,
            (
                "shared/data/gpus.json notes: 'Reserve ~0.5-1 GiB for CUDA context' (the high end: a sleeping "
                "engine's residue; agents measure it with NVML)"
            ),
        ),
    }
)


@dataclass(frozen=True, slots=True)
class GroupLinks:
    """The bandwidths a transition of an instance crosses: the slowest GPU of its group, the node's NVMe."""

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    nvme_read_bytes_per_s: float


@dataclass(frozen=True, slots=True)
class Holdings:
    """What an instance's state holds: bytes on each GPU of its group, in host RAM, in the page cache."""

    gpu_bytes: Mapping[str, int]
    host_bytes: int
    page_cache_bytes: int  # clean checkpoint pages the kernel may evict; not the engine's own memory


def context_bytes_per_gpu(state: EngineState, constants: EngineConstants) -> int:
    """The CUDA context an instance in `state` holds on each GPU of its group beside its shard and pool: in
    every state its process exists (running, or asleep as its residue), none once stopped (`holdings`)."""
    return constants.context_bytes_per_gpu if state in _UP else 0


def holdings(
    instance: EngineInstance, state: EngineState, constants: EngineConstants, *, checkpoint_cached: bool = False
) -> Holdings:
    """Bytes held in `state`:

    GPU, per GPU of the group:
        running            shard_bytes + kv_pool_bytes_per_gpu + context_bytes_per_gpu
        asleep (1 or 2)    context_bytes_per_gpu                 (the CUDA context stays: the residue)
        stopped            0
    host RAM (the engine process's own memory):
        asleep_host        shard_bytes x tp                      (the level-1 backup, pinned)
        not stopped        + (experts_bytes - gpu_expert_bytes)  (experts left off GPU at launch)
                           + lmcache_host_bytes_per_gpu x tp     (with the lmcache feature: LMCache's CPU tier)
    page cache: checkpoint_bytes when the checkpoint is cached (read ahead, or left by a load), else 0.
    """
    launch = instance.launch
    per_gpu = context_bytes_per_gpu(state, constants)
    if state is EngineState.RUNNING:
        per_gpu += instance.shard_bytes + launch.kv_pool_bytes_per_gpu
    host = 0
    if state in _UP:
        host += instance.experts_bytes - instance.gpu_expert_bytes
        if instance.has(EngineFeature.LMCACHE):
            host += launch.lmcache_host_bytes_per_gpu * instance.tp
    if state is EngineState.ASLEEP_HOST:
        host += instance.shard_bytes * instance.tp
    return Holdings(
        gpu_bytes=MappingProxyType(dict.fromkeys(instance.gpus, per_gpu)),
        host_bytes=host,
        page_cache_bytes=instance.checkpoint_bytes if checkpoint_cached else 0,
    )


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a transition may happen, and if not, which precondition is missing and why."""

    allowed: bool
    missing: Precondition | None = None
    why: str = ""


_PRECONDITION_WORDS: Mapping[Precondition, str] = MappingProxyType(
    {
        Precondition.MANAGED: "the engine is adopted: someone else starts and stops it, so only sleep and wake",
        Precondition.SLEEP_MODE: "the engine was launched without sleep mode (vLLM --enable-sleep-mode, "
        "SGLang --enable-memory-saver)",
        Precondition.DEV_MODE: "vLLM's /sleep, /wake_up and /collective_rpc exist only with VLLM_SERVER_DEV_MODE=1",
        Precondition.CPU_BACKUP: "SGLang keeps released weights in host RAM only with --enable-weights-cpu-backup",
        Precondition.NO_CPU_BACKUP: "with --enable-weights-cpu-backup SGLang keeps released weights in host RAM: "
        "a release is level 1",
        Precondition.DRAINED: "requests are in flight: drain the engine first (they would be aborted)",
    }
)


def may(
    instance: EngineInstance, state: EngineState, transition: Transition, *, in_flight_requests: int = 0
) -> Verdict:
    """May `transition` happen to `instance` in `state` (with `in_flight_requests` running on it)?

    An asleep or stopped engine has no request in flight, so `drained` holds there whatever is passed.
    """
    rule = RULES.get((instance.kind, transition))
    if rule is None:
        return Verdict(False, Precondition.KNOWN_KIND, f"the engine model does not describe {instance.kind.value}")
    if state not in rule.sources:
        sources = ", ".join(sorted(s.value for s in rule.sources))
        return Verdict(False, Precondition.FROM_STATE, f"{transition.value} leaves from {sources}, not {state.value}")
    for need in rule.requires:
        if not _holds(need, instance, state, in_flight_requests):
            return Verdict(False, need, _PRECONDITION_WORDS[need])
    return Verdict(True)


def _holds(need: Precondition, instance: EngineInstance, state: EngineState, in_flight_requests: int) -> bool:
    if need is Precondition.MANAGED:
        return instance.management is Management.MANAGED
    if need is Precondition.SLEEP_MODE:
        return instance.has(EngineFeature.SLEEP_MODE)
    if need is Precondition.DEV_MODE:
        return instance.has(EngineFeature.DEV_MODE)
    if need is Precondition.CPU_BACKUP:
        return instance.has(EngineFeature.CPU_BACKUP)
    if need is Precondition.NO_CPU_BACKUP:
        return not instance.has(EngineFeature.CPU_BACKUP)
    if need is Precondition.DRAINED:
        return state is not EngineState.RUNNING or in_flight_requests == 0
    raise ValueError(f"precondition {need.value} is not checked per instance")


# --- costs ------------------------------------------------------------------------------------------------


def pipelined_copy_seconds(copy_seconds: float, read_bytes: float, read_bytes_per_s: float) -> float:
    """A read feeding the copies to the GPUs through pinned host buffers: the two stages overlap, so the
    slower decides, max(copy_seconds, read_bytes / read_bytes_per_s). The planner's copy costs
    (`planner/costs.py`) and `load_seconds` both use it."""
    return max(copy_seconds, read_bytes / read_bytes_per_s)


def load_seconds(instance: EngineInstance, links: GroupLinks, constants: EngineConstants, read_from: ReadFrom) -> float:
    """Read the checkpoint and copy the shards to the GPUs, pipelined (the slower stage decides):

    from NVMe:        max(checkpoint_bytes / nvme_read, shard / h2d)   one drive feeds every rank
    from page cache:  max(shard / page_cache_read, shard / h2d)        each rank reads its own shard from DRAM
    """
    h2d = instance.shard_bytes / links.h2d_bytes_per_s
    if read_from is ReadFrom.NVME:
        return pipelined_copy_seconds(h2d, instance.checkpoint_bytes, links.nvme_read_bytes_per_s)
    return pipelined_copy_seconds(h2d, instance.shard_bytes, constants.page_cache_read_bytes_per_s)


def bring_up_fixed_seconds(state: EngineState, same_instance: bool, constants: EngineConstants) -> float:
    """The fixed part of bringing an instance to running from `state`, its copy of the weights priced apart
    (`same_instance`: the instance in `state` is the one brought up, same precision, group and settings):

        running, same instance           0                                nothing to do
        asleep_host, same instance       wake_fixed                       level-1 wake
        asleep_discarded, same instance  wake_fixed + reload_fixed        level-2 wake, then reload_weights
        running or asleep, another one   stop_fixed + cold_start_fixed    a restart with new settings
        stopped                          cold_start_fixed                 a cold start

    The wake, cold-start and restart costs below are this plus their loads; the planner
    (planner/engine_costs.py) and the simulator (sim/instances.py) add the same fixed part to the copies
    they price or simulate, so that both charge one engine model.
    """
    if state is EngineState.STOPPED:
        return constants.cold_start_fixed_seconds
    if not same_instance:
        return constants.stop_fixed_seconds + constants.cold_start_fixed_seconds
    if state is EngineState.ASLEEP_HOST:
        return constants.wake_fixed_seconds
    if state is EngineState.ASLEEP_DISCARDED:
        return constants.wake_fixed_seconds + constants.reload_fixed_seconds
    return 0.0


def leaving_transition(instance: EngineInstance, host_copy: bool) -> Transition | None:
    """How a running instance leaves its GPUs: a level-1 sleep where host RAM holds the weights (its backup)
    and its kind and features offer one, else a level-2 sleep, else None (it stops). SGLang launched with
    --enable-weights-cpu-backup releases into host RAM whether or not a copy was there: its level 1."""
    order = (Transition.SLEEP_LEVEL_1, Transition.SLEEP_LEVEL_2) if host_copy else (Transition.SLEEP_LEVEL_2,)
    for transition in order:
        if may(instance, EngineState.RUNNING, transition).allowed:
            return transition
    if not host_copy and may(instance, EngineState.RUNNING, Transition.SLEEP_LEVEL_1).allowed:
        return Transition.SLEEP_LEVEL_1
    return None


def wake_from_host_seconds(instance: EngineInstance, links: GroupLinks, constants: EngineConstants) -> float:
    """Level-1 wake: wake_fixed + shard / h2d (the shards copy back in parallel, one per GPU link)."""
    fixed = bring_up_fixed_seconds(EngineState.ASLEEP_HOST, True, constants)
    return fixed + instance.shard_bytes / links.h2d_bytes_per_s


def wake_from_disk_seconds(
    instance: EngineInstance, links: GroupLinks, constants: EngineConstants, read_from: ReadFrom
) -> float:
    """Level-2 wake and reload: wake_fixed + reload_fixed + load(read_from)."""
    fixed = bring_up_fixed_seconds(EngineState.ASLEEP_DISCARDED, True, constants)
    return fixed + load_seconds(instance, links, constants, read_from)


def sleep_seconds(
    instance: EngineInstance,
    level: int,
    links: GroupLinks,
    constants: EngineConstants,
    *,
    drain: float = 0.0,
) -> float:
    """Sleep: drain + sleep_fixed, plus the level-1 backup copy shard / d2h."""
    if level not in (1, 2):
        raise ValueError(f"sleep level {level}: 1 or 2")
    backup = instance.shard_bytes / links.d2h_bytes_per_s if level == 1 else 0.0
    return drain + constants.sleep_fixed_seconds + backup


def cold_start_seconds(
    instance: EngineInstance, links: GroupLinks, constants: EngineConstants, read_from: ReadFrom = ReadFrom.NVME
) -> float:
    """A cold start of the configuration: cold_start_fixed (process, compilation, CUDA graphs) + load."""
    return bring_up_fixed_seconds(EngineState.STOPPED, False, constants) + load_seconds(
        instance, links, constants, read_from
    )


def readahead_seconds(instance: EngineInstance, links: GroupLinks) -> float:
    """The whole checkpoint read from NVMe into the page cache."""
    return instance.checkpoint_bytes / links.nvme_read_bytes_per_s


def stop_seconds(constants: EngineConstants, *, drain: float = 0.0) -> float:
    """Stop: drain + stop_fixed."""
    return drain + constants.stop_fixed_seconds


def restart_seconds(
    new: EngineInstance,
    links: GroupLinks,
    constants: EngineConstants,
    read_from: ReadFrom = ReadFrom.PAGE_CACHE,
    *,
    drain: float = 0.0,
) -> float:
    """A restart with new launch settings: stop the old instance, cold-start the new one. The old
    instance read the checkpoint when it started, so the new one usually finds it in the page cache."""
    return stop_seconds(constants, drain=drain) + cold_start_seconds(new, links, constants, read_from)


def drain_seconds(remaining_output_tokens: int, seconds_per_output_token: float) -> float:
    """Drain: the longest request in flight decodes its remaining tokens (requests decode together)."""
    if remaining_output_tokens < 0 or seconds_per_output_token < 0:
        raise ValueError("drain: tokens and seconds per token are non-negative")
    return remaining_output_tokens * seconds_per_output_token


def transition_seconds(
    instance: EngineInstance,
    state: EngineState,
    transition: Transition,
    links: GroupLinks,
    constants: EngineConstants,
    *,
    read_from: ReadFrom | None = None,
    new: EngineInstance | None = None,
    drain: float = 0.0,
) -> float:
    """The cost of `transition` from `state` by the formulas above (`new`: a restart's new instance).

    `read_from` None: where the transition usually reads the checkpoint: NVMe for a start or a level-2
    wake, the page cache for a restart (the old instance read the checkpoint when it started).
    """
    source = read_from or ReadFrom.NVME
    if transition is Transition.READAHEAD:
        return readahead_seconds(instance, links)
    if transition is Transition.START:
        return cold_start_seconds(instance, links, constants, source)
    if transition is Transition.STOP:
        return stop_seconds(constants, drain=drain if state is EngineState.RUNNING else 0.0)
    if transition is Transition.SLEEP_LEVEL_1:
        return sleep_seconds(instance, 1, links, constants, drain=drain)
    if transition is Transition.SLEEP_LEVEL_2:
        return sleep_seconds(instance, 2, links, constants, drain=drain)
    if transition is Transition.WAKE:
        if state is EngineState.ASLEEP_HOST:
            return wake_from_host_seconds(instance, links, constants)
        return wake_from_disk_seconds(instance, links, constants, source)
    if new is None:
        raise ValueError("a restart needs the new instance")
    return restart_seconds(
        new, links, constants, read_from or ReadFrom.PAGE_CACHE, drain=drain if state is EngineState.RUNNING else 0.0
    )


# --- calibration ------------------------------------------------------------------------------------------

ALPHA = 0.3  # weight of one measured transition in the running estimate of its fixed part
MAX_TRANSITION_SECONDS = 3600.0  # a transition reported slower than this is a hung engine, not a sample


@dataclass(frozen=True, slots=True)
class Measured:
    """A node agent's measured duration of one transition, with what the model needs to price it."""

    instance: EngineInstance
    state: EngineState  # the state it left
    transition: Transition
    seconds: float
    links: GroupLinks
    read_from: ReadFrom | None = None  # None: the transition's usual source (`transition_seconds`)
    new: EngineInstance | None = None  # a restart's new instance
    drain: float = 0.0  # seconds of it spent draining, where the agent measured them


def sampled_constant(transition: Transition, state: EngineState) -> str:
    """The fixed constant a measured transition samples."""
    if transition is Transition.WAKE:
        return "wake_fixed_seconds" if state is EngineState.ASLEEP_HOST else "reload_fixed_seconds"
    if transition in (Transition.SLEEP_LEVEL_1, Transition.SLEEP_LEVEL_2):
        return "sleep_fixed_seconds"
    if transition is Transition.STOP:
        return "stop_fixed_seconds"
    return "cold_start_fixed_seconds"  # a start, or a restart's cold start


def fold_measurement(
    constants: EngineConstants, measured: Measured, alpha: float = ALPHA
) -> tuple[EngineConstants, str | None]:
    """The constants after one measured transition, and why the sample was refused, if it was.

    The sample of the fixed constant c the transition exercises is what the measurement leaves once every
    other modelled term is taken off, floored at 0:
        sample = max(0, measured - (modelled(constants) - c))
    and c becomes (1 - alpha) * c + alpha * sample. Bandwidth terms are not touched: the copies' own
    calibration owns them.
    """
    seconds = measured.seconds
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TRANSITION_SECONDS):
        return constants, f"{seconds!r} s is not a transition's duration (0 < s <= {MAX_TRANSITION_SECONDS:g})"
    name = sampled_constant(measured.transition, measured.state)
    current = float(getattr(constants, name))
    modelled = transition_seconds(
        measured.instance,
        measured.state,
        measured.transition,
        measured.links,
        constants,
        read_from=measured.read_from,
        new=measured.new,
        drain=measured.drain,
    )
    sample = max(0.0, seconds - (modelled - current))
    folded = (1 - alpha) * current + alpha * sample
    return replace(constants, **{name: folded}), None  # type: ignore[arg-type]  # `name` is one of the float fields
