"""The engine model, checked by hand: every cost below is the README's formula ("Engines as they are") worked
out with the catalog's sizes (model_presets), the GPU presets (hardware) and the default constants, whose
sources are in perf_anchors.md.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from planner_service.domain import engines
from planner_service.domain.engines import (
    CONSTANT_SOURCES,
    DEFAULT,
    ENGINE_KINDS,
    MEASURED,
    RULES,
    EngineConstants,
    EngineFeature,
    EngineInstance,
    EngineKind,
    EngineState,
    GroupLinks,
    LaunchSettings,
    Management,
    Measured,
    Precondition,
    ReadFrom,
    RuntimeMove,
    Transition,
    bring_up_fixed_seconds,
    cold_start_seconds,
    drain_seconds,
    fold_measurement,
    holdings,
    leaving_transition,
    may,
    offers,
    restart_seconds,
    sleep_seconds,
    stop_seconds,
    transition_seconds,
    wake_from_disk_seconds,
    wake_from_host_seconds,
)
from planner_service.domain.hardware import DEFAULT_NVME_READ_BYTES_PER_S, gpu_preset
from planner_service.domain.model_presets import model_preset
from planner_service.domain.units import GIB

README = Path(__file__).resolve().parents[2] / "README.md"
C = EngineConstants()
L40 = gpu_preset("l40")
# the slowest GPU of a group of L40s, and the node's default Gen4 NVMe (7 GB/s)
L40_LINKS = GroupLinks(L40.h2d_bytes_per_s, L40.d2h_bytes_per_s, DEFAULT_NVME_READ_BYTES_PER_S)
VLLM_SLEEPS = frozenset({EngineFeature.SLEEP_MODE, EngineFeature.DEV_MODE})

CODER_BYTES = model_preset("qwen2.5-coder-32b-instruct").architecture.dense_weight_bytes("bf16")
LLAMA_BYTES = model_preset("llama-3.1-8b-instruct").architecture.dense_weight_bytes("bf16")


def coder(**launch: object) -> EngineInstance:
    """Qwen2.5-Coder-32B bf16 on four L40s, an 8 GiB KV pool per card."""
    launch.setdefault("features", VLLM_SLEEPS)
    settings = LaunchSettings(kv_pool_bytes_per_gpu=8 * GIB, **launch)  # type: ignore[arg-type]  # keyword fields of LaunchSettings
    return EngineInstance(EngineKind.VLLM, "coder", "bf16", ("g0", "g1", "g2", "g3"), CODER_BYTES, settings)


def llama(kv_pool_gib: int = 20) -> EngineInstance:
    """Llama-3.1-8B bf16 on one L40."""
    settings = LaunchSettings(kv_pool_bytes_per_gpu=kv_pool_gib * GIB, features=VLLM_SLEEPS)
    return EngineInstance(EngineKind.VLLM, "llama", "bf16", ("g0",), LLAMA_BYTES, settings)


# --- the catalog figures the examples use -----------------------------------------------------------------


def test_the_examples_sizes_and_links() -> None:
    assert CODER_BYTES == 65_527_752_704  # 65.5 GB (perf_anchors.md §0 table)
    assert LLAMA_BYTES == 16_060_522_496  # 16.1 GB
    assert (L40.h2d_bytes_per_s, L40.d2h_bytes_per_s) == (24e9, 24e9)
    assert DEFAULT_NVME_READ_BYTES_PER_S == 7e9
    assert coder().shard_bytes == 16_381_938_176  # 65,527,752,704 / 4: a 16.4 GB shard per card


# --- costs --------------------------------------------------------------------------------------------


def test_level_1_wake_of_the_coder_on_four_l40s() -> None:
    # wake_fixed + shard / h2d = 0.1 + 16,381,938,176 / 24e9 = 0.1 + 0.68258 s
    assert wake_from_host_seconds(coder(), L40_LINKS, C) == pytest.approx(0.1 + 0.682581, abs=1e-6)


def test_level_2_wake_of_the_coder_reloads_from_nvme() -> None:
    # wake_fixed + reload_fixed + max(checkpoint / nvme, shard / h2d)
    # = 0.1 + 0.7 + max(65,527,752,704 / 7e9, 0.68258) = 0.8 + 9.36111 s: the one drive is the bottleneck
    assert wake_from_disk_seconds(coder(), L40_LINKS, C, ReadFrom.NVME) == pytest.approx(0.8 + 9.361107, abs=1e-6)


def test_level_2_wake_of_the_coder_reloads_from_the_page_cache() -> None:
    # 0.1 + 0.7 + max(shard / page_cache_read, shard / h2d) = 0.8 + max(16,381,938,176 / 10e9, 0.68258)
    # = 0.8 + 1.63819 s: each rank reads its own shard from DRAM, six times faster than from the drive
    assert wake_from_disk_seconds(coder(), L40_LINKS, C, ReadFrom.PAGE_CACHE) == pytest.approx(0.8 + 1.638194, abs=1e-6)


def test_cold_start_of_llama_8b_on_one_l40() -> None:
    # cold_start_fixed + max(checkpoint / nvme, shard / h2d) = 30 + max(16,060,522,496 / 7e9, 0.66919)
    # = 30 + 2.29436 s: within "a full reload is 30-100+ s per switch" (perf_anchors.md §1)
    assert cold_start_seconds(llama(), L40_LINKS, C) == pytest.approx(30 + 2.294360, abs=1e-6)
    assert 30 <= cold_start_seconds(llama(), L40_LINKS, C) <= 100


def test_restart_of_llama_8b_with_a_bigger_kv_pool() -> None:
    # stop_fixed + cold_start_fixed + max(shard / page_cache_read, shard / h2d)
    # = 2 + 30 + max(16,060,522,496 / 10e9, 0.66919) = 32 + 1.60605 s (the checkpoint is still in the page cache)
    old, new = llama(20), llama(24)
    assert restart_seconds(new, L40_LINKS, C) == pytest.approx(32 + 1.606052, abs=1e-6)
    # from NVMe, had the page cache dropped it: 32 + 2.29436 s
    assert restart_seconds(new, L40_LINKS, C, ReadFrom.NVME) == pytest.approx(32 + 2.294360, abs=1e-6)
    # and the restart is the only way to the new pool: 4 GiB more on the card
    before = holdings(old, EngineState.RUNNING, C).gpu_bytes["g0"]
    after = holdings(new, EngineState.RUNNING, C).gpu_bytes["g0"]
    assert after - before == 4 * GIB
    assert transition_seconds(old, EngineState.RUNNING, Transition.RESTART, L40_LINKS, C, new=new) == pytest.approx(
        restart_seconds(new, L40_LINKS, C)
    )


def test_sleeps_drain_and_stop() -> None:
    drain = drain_seconds(256, 0.02)  # 256 output tokens left at 20 ms each
    assert drain == pytest.approx(5.12)
    # level 1: drain + sleep_fixed + shard / d2h = 5.12 + 0.1 + 0.68258; level 2 copies nothing back
    assert sleep_seconds(coder(), 1, L40_LINKS, C, drain=drain) == pytest.approx(5.12 + 0.1 + 0.682581, abs=1e-6)
    assert sleep_seconds(coder(), 2, L40_LINKS, C) == pytest.approx(0.1)
    assert stop_seconds(C, drain=drain) == pytest.approx(7.12)
    # a sleeping engine has nothing in flight: its stop pays no drain
    sleeping = transition_seconds(coder(), EngineState.ASLEEP_HOST, Transition.STOP, L40_LINKS, C, drain=drain)
    assert sleeping == pytest.approx(2.0)
    with pytest.raises(ValueError, match="sleep level"):
        sleep_seconds(coder(), 3, L40_LINKS, C)


def test_transition_seconds_dispatches_to_the_formulas() -> None:
    i = coder()
    cases = {
        (EngineState.STOPPED, Transition.START): cold_start_seconds(i, L40_LINKS, C),
        (EngineState.ASLEEP_HOST, Transition.WAKE): wake_from_host_seconds(i, L40_LINKS, C),
        (EngineState.ASLEEP_DISCARDED, Transition.WAKE): wake_from_disk_seconds(i, L40_LINKS, C, ReadFrom.NVME),
        (EngineState.RUNNING, Transition.SLEEP_LEVEL_1): sleep_seconds(i, 1, L40_LINKS, C),
        (EngineState.RUNNING, Transition.SLEEP_LEVEL_2): sleep_seconds(i, 2, L40_LINKS, C),
        (EngineState.RUNNING, Transition.STOP): stop_seconds(C),
    }
    for (state, transition), seconds in cases.items():
        assert transition_seconds(i, state, transition, L40_LINKS, C) == seconds
    with pytest.raises(ValueError, match="new instance"):
        transition_seconds(i, EngineState.RUNNING, Transition.RESTART, L40_LINKS, C)


# --- what each state holds --------------------------------------------------------------------------------


def test_what_each_state_of_the_coder_holds() -> None:
    i = coder()
    running = holdings(i, EngineState.RUNNING, C)
    # shard + KV pool + CUDA context on each of the four cards
    assert running.gpu_bytes == dict.fromkeys(("g0", "g1", "g2", "g3"), 16_381_938_176 + 8 * GIB + GIB)
    assert (running.host_bytes, running.page_cache_bytes) == (0, 0)
    # level 1: the CUDA context stays on every card (the residue); the backup is the whole model, pinned
    level_1 = holdings(i, EngineState.ASLEEP_HOST, C)
    assert level_1.gpu_bytes == dict.fromkeys(("g0", "g1", "g2", "g3"), GIB)
    assert level_1.host_bytes == 4 * 16_381_938_176
    level_2 = holdings(i, EngineState.ASLEEP_DISCARDED, C)
    assert (set(level_2.gpu_bytes.values()), level_2.host_bytes) == ({GIB}, 0)
    stopped = holdings(i, EngineState.STOPPED, C, checkpoint_cached=True)
    assert (set(stopped.gpu_bytes.values()), stopped.host_bytes, stopped.page_cache_bytes) == ({0}, 0, CODER_BYTES)


def test_lmcache_holds_its_configured_host_capacity_while_the_engine_lives() -> None:
    i = coder(features=VLLM_SLEEPS | {EngineFeature.LMCACHE})
    # LMCache's default max_local_cpu_size (5 x 1024**3 bytes) per worker, one worker per card
    assert holdings(i, EngineState.RUNNING, C).host_bytes == 4 * 5 * GIB
    assert holdings(i, EngineState.ASLEEP_HOST, C).host_bytes == 4 * 5 * GIB + 4 * 16_381_938_176
    assert holdings(i, EngineState.STOPPED, C).host_bytes == 0
    assert (
        holdings(
            coder(features=VLLM_SLEEPS | {EngineFeature.LMCACHE}, lmcache_host_bytes_per_gpu=GIB),
            EngineState.RUNNING,
            C,
        ).host_bytes
        == 4 * GIB
    )


def test_a_moe_s_gpu_expert_share_is_a_launch_setting_that_splits_its_bytes() -> None:
    arch = model_preset("qwen3-30b-a3b").architecture
    dense, experts = arch.dense_weight_bytes("bf16"), arch.experts_bytes("bf16")
    assert (dense, experts) == (3_082_186_752, 57_982_058_496)
    settings = LaunchSettings(kv_pool_bytes_per_gpu=10 * GIB, gpu_expert_fraction=0.25, features=VLLM_SLEEPS)
    i = EngineInstance(EngineKind.VLLM, "moe", "bf16", ("g0", "g1"), dense, settings, experts_bytes=experts)
    # GPU: (dense + a quarter of the experts) / 2 per card; host: the three quarters left off GPU
    assert i.gpu_expert_bytes == 14_495_514_624
    assert i.shard_bytes == (3_082_186_752 + 14_495_514_624) // 2
    assert holdings(i, EngineState.RUNNING, C).host_bytes == 57_982_058_496 - 14_495_514_624
    # a load reads the whole checkpoint: max(61,064,245,248 / 7e9, shard / 24e9) = 8.72346 s from NVMe
    assert cold_start_seconds(i, L40_LINKS, C) == pytest.approx(30 + 61_064_245_248 / 7e9)


# --- transitions and their preconditions ------------------------------------------------------------------


def instance(kind: EngineKind, *features: EngineFeature, management: Management = Management.MANAGED) -> EngineInstance:
    settings = LaunchSettings(kv_pool_bytes_per_gpu=GIB, features=frozenset(features))
    return EngineInstance(kind, "m", "bf16", ("g0",), 8 * GIB, settings, management=management)


R, H, D, S = EngineState.RUNNING, EngineState.ASLEEP_HOST, EngineState.ASLEEP_DISCARDED, EngineState.STOPPED
SM, DM, CB, LM = EngineFeature.SLEEP_MODE, EngineFeature.DEV_MODE, EngineFeature.CPU_BACKUP, EngineFeature.LMCACHE
VLLM, SGLANG, LOCAL = EngineKind.VLLM, EngineKind.SGLANG, EngineKind.LOCAL


@pytest.mark.parametrize(
    ("engine", "state", "transition", "in_flight", "missing"),
    [
        # vLLM: sleep and wake need sleep mode and the dev-mode endpoints; sleep drains itself (mode=wait)
        (instance(VLLM, SM, DM), R, Transition.SLEEP_LEVEL_1, 3, None),
        (instance(VLLM, SM, DM), R, Transition.SLEEP_LEVEL_2, 0, None),
        (instance(VLLM, SM), R, Transition.SLEEP_LEVEL_1, 0, Precondition.DEV_MODE),
        (instance(VLLM, DM, LM), R, Transition.SLEEP_LEVEL_2, 0, Precondition.SLEEP_MODE),
        (instance(VLLM, SM, DM), H, Transition.WAKE, 0, None),
        (instance(VLLM, SM, DM), D, Transition.WAKE, 0, None),
        (instance(VLLM, SM), H, Transition.WAKE, 0, Precondition.DEV_MODE),
        (instance(VLLM, SM, DM), R, Transition.WAKE, 0, Precondition.FROM_STATE),
        (instance(VLLM, SM, DM), H, Transition.SLEEP_LEVEL_1, 0, Precondition.FROM_STATE),
        (instance(VLLM), S, Transition.START, 0, None),
        (instance(VLLM), R, Transition.START, 0, Precondition.FROM_STATE),
        (instance(VLLM), R, Transition.STOP, 2, Precondition.DRAINED),
        (instance(VLLM), H, Transition.STOP, 2, None),  # asleep: nothing in flight
        (instance(VLLM), R, Transition.RESTART, 1, Precondition.DRAINED),
        (instance(VLLM), D, Transition.RESTART, 0, None),
        # SGLang: release needs the memory saver and an idle engine; the CPU backup decides the level
        (instance(SGLANG, SM, CB), R, Transition.SLEEP_LEVEL_1, 0, None),
        (instance(SGLANG, SM, CB), R, Transition.SLEEP_LEVEL_1, 1, Precondition.DRAINED),
        (instance(SGLANG, SM), R, Transition.SLEEP_LEVEL_1, 0, Precondition.CPU_BACKUP),
        (instance(SGLANG, SM), R, Transition.SLEEP_LEVEL_2, 0, None),
        (instance(SGLANG, SM, CB), R, Transition.SLEEP_LEVEL_2, 0, Precondition.NO_CPU_BACKUP),
        (instance(SGLANG, CB), R, Transition.SLEEP_LEVEL_1, 0, Precondition.SLEEP_MODE),
        (instance(SGLANG, SM), D, Transition.WAKE, 0, None),
        (instance(SGLANG), H, Transition.WAKE, 0, Precondition.SLEEP_MODE),
        # local: everything, without features or a drain
        (instance(LOCAL), R, Transition.SLEEP_LEVEL_1, 5, None),
        (instance(LOCAL), R, Transition.SLEEP_LEVEL_2, 5, None),
        (instance(LOCAL), D, Transition.WAKE, 0, None),
        (instance(LOCAL), R, Transition.RESTART, 5, None),
        # adopted engines: sleep and wake only
        (instance(VLLM, SM, DM, management=Management.ADOPTED), R, Transition.SLEEP_LEVEL_1, 0, None),
        (instance(VLLM, SM, DM, management=Management.ADOPTED), H, Transition.WAKE, 0, None),
        (instance(VLLM, SM, DM, management=Management.ADOPTED), S, Transition.START, 0, Precondition.MANAGED),
        (instance(SGLANG, SM, management=Management.ADOPTED), R, Transition.STOP, 0, Precondition.MANAGED),
        (instance(LOCAL, management=Management.ADOPTED), R, Transition.RESTART, 0, Precondition.MANAGED),
    ],
)
def test_may_names_the_missing_precondition(
    engine: EngineInstance, state: EngineState, transition: Transition, in_flight: int, missing: Precondition | None
) -> None:
    verdict = may(engine, state, transition, in_flight_requests=in_flight)
    assert (verdict.allowed, verdict.missing) == (missing is None, missing)
    assert bool(verdict.why) == (missing is not None)


def test_every_modelled_kind_has_every_transition_and_its_state_after() -> None:
    assert {(k, t) for k in ENGINE_KINDS for t in Transition} == set(RULES)
    assert set(engines.AFTER) == set(Transition) - {Transition.READAHEAD}
    assert engines.AFTER[Transition.SLEEP_LEVEL_1] is H and engines.AFTER[Transition.SLEEP_LEVEL_2] is D


def test_lmcache_and_other_are_no_engines_of_their_own() -> None:
    for kind in (EngineKind.LMCACHE, EngineKind.OTHER):
        with pytest.raises(ValueError, match="no engine kind"):
            instance(kind)


def test_only_local_moves_sessions_kv_experts_or_precision_at_run_time() -> None:
    for move in RuntimeMove:
        assert offers(LOCAL, move)
        assert not offers(VLLM, move) and not offers(SGLANG, move)
        assert not offers(EngineKind.OTHER, move)


@pytest.mark.parametrize(
    "bad",
    [
        {"kv_pool_bytes_per_gpu": -1},
        {"kv_pool_bytes_per_gpu": 0, "gpu_expert_fraction": 1.5},
        {"kv_pool_bytes_per_gpu": 0, "max_context_tokens": 0},
        {"kv_pool_bytes_per_gpu": 0, "lmcache_host_bytes_per_gpu": -1},
    ],
)
def test_launch_settings_check_themselves(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LaunchSettings(**bad)  # type: ignore[arg-type]  # the fields, some of them out of range


def test_an_instance_needs_a_group_of_distinct_gpus() -> None:
    settings = LaunchSettings(kv_pool_bytes_per_gpu=0)
    for gpus in ((), ("g0", "g0")):
        with pytest.raises(ValueError, match="distinct GPUs"):
            EngineInstance(VLLM, "m", "bf16", gpus, GIB, settings)


# --- calibration --------------------------------------------------------------------------------------------


def measured_wake(seconds: float) -> Measured:
    return Measured(coder(), H, Transition.WAKE, seconds, L40_LINKS)


def test_a_measured_wake_folds_into_the_fixed_wake_time() -> None:
    # sample = 1.0 - 0.68258 (the modelled copy) = 0.31742; 0.7 x 0.1 + 0.3 x 0.31742 = 0.16523
    folded, refused = fold_measurement(C, measured_wake(1.0))
    assert refused is None
    assert folded.wake_fixed_seconds == pytest.approx(0.7 * 0.1 + 0.3 * (1.0 - 0.682581), abs=1e-6)
    assert folded.reload_fixed_seconds == C.reload_fixed_seconds and folded.page_cache_read_bytes_per_s == 10e9


def test_repeated_measurements_converge_on_the_engine_s_fixed_part() -> None:
    constants = C
    for _ in range(60):
        constants, _ = fold_measurement(constants, measured_wake(0.682581 + 0.4))
    assert constants.wake_fixed_seconds == pytest.approx(0.4, abs=1e-4)
    assert wake_from_host_seconds(coder(), L40_LINKS, constants) == pytest.approx(1.082581, abs=1e-4)


def test_each_transition_samples_its_own_constant() -> None:
    cold = Measured(llama(), S, Transition.START, 60.0, L40_LINKS)
    # 60 - 2.29436 = 57.70564 sampled; 0.7 x 30 + 0.3 x 57.70564
    assert fold_measurement(C, cold)[0].cold_start_fixed_seconds == pytest.approx(21 + 0.3 * (60 - 2.294360), abs=1e-5)
    restart = Measured(llama(20), R, Transition.RESTART, 40.0, L40_LINKS, ReadFrom.PAGE_CACHE, new=llama(24))
    # 40 - (2 + 1.60605) = 36.39395 sampled for the cold start
    assert fold_measurement(C, restart)[0].cold_start_fixed_seconds == pytest.approx(
        21 + 0.3 * (40 - 3.606052), abs=1e-5
    )
    reload = Measured(coder(), D, Transition.WAKE, 12.0, L40_LINKS)
    # 12 - (0.1 + 9.36111) = 2.53889 sampled for the reload
    assert fold_measurement(C, reload)[0].reload_fixed_seconds == pytest.approx(0.49 + 0.3 * (12 - 9.461107), abs=1e-5)
    sleep = Measured(coder(), R, Transition.SLEEP_LEVEL_2, 0.5, L40_LINKS)
    assert fold_measurement(C, sleep)[0].sleep_fixed_seconds == pytest.approx(0.07 + 0.15)
    stop = Measured(coder(), R, Transition.STOP, 3.0, L40_LINKS)
    assert fold_measurement(C, stop)[0].stop_fixed_seconds == pytest.approx(1.4 + 0.9)


def test_a_wake_faster_than_its_copy_samples_no_fixed_time() -> None:
    folded, refused = fold_measurement(C, measured_wake(0.5))  # less than the 0.68 s copy: the link is faster
    assert refused is None and folded.wake_fixed_seconds == pytest.approx(0.07)


@pytest.mark.parametrize("seconds", [0.0, -1.0, math.nan, math.inf, 4000.0])
def test_a_duration_that_is_no_transition_s_is_refused(seconds: float) -> None:
    folded, refused = fold_measurement(C, measured_wake(seconds))
    assert folded == C and refused is not None and "not a transition's duration" in refused


# --- the constants' sources and the README ------------------------------------------------------------------


def test_every_constant_has_a_source() -> None:
    names = {f for f in EngineConstants.__dataclass_fields__}
    assert set(CONSTANT_SOURCES) == names
    for status, text in CONSTANT_SOURCES.values():
        assert status in (MEASURED, DEFAULT) and text
        if status == MEASURED:
            assert "perf_anchors.md §" in text or "gpus.json" in text


@pytest.mark.parametrize(
    "bad", [{"wake_fixed_seconds": -0.1}, {"page_cache_read_bytes_per_s": 0.0}, {"stop_fixed_seconds": math.nan}]
)
def test_constants_check_themselves(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        EngineConstants(**bad)  # type: ignore[arg-type]  # the fields, some of them out of range


def readme_section() -> str:
    text = README.read_text()
    start = text.index("## Engines as they are")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def test_the_readme_cites_every_engine_source_file_the_model_relies_on() -> None:
    section = readme_section()
    for rule in RULES.values():
        for path in re.findall(r"[\w./]+\.(?:py|md)", rule.relies_on):
            assert path in section, f"{rule.kind.value} {rule.transition.value}: {path} is not in the README"


def test_the_readme_gives_every_constant_with_its_value() -> None:
    section = readme_section()
    for name in EngineConstants.__dataclass_fields__:
        assert f"`{name}`" in section, name


def test_the_fixed_part_of_bringing_an_instance_up_from_each_state() -> None:
    # what the planner and the replay add to a copy (engines.bring_up_fixed_seconds), by the constants above
    cases = {
        (EngineState.RUNNING, True): 0.0,
        (EngineState.ASLEEP_HOST, True): 0.1,  # wake_fixed
        (EngineState.ASLEEP_DISCARDED, True): 0.1 + 0.7,  # wake_fixed + reload_fixed
        (EngineState.RUNNING, False): 2.0 + 30.0,  # a restart with new settings: stop_fixed + cold_start_fixed
        (EngineState.ASLEEP_HOST, False): 2.0 + 30.0,
        (EngineState.STOPPED, False): 30.0,  # cold_start_fixed
    }
    for (state, same), seconds in cases.items():
        assert bring_up_fixed_seconds(state, same, C) == pytest.approx(seconds), (state, same)
    # the wake and cold-start formulas are that part plus their loads
    assert wake_from_host_seconds(llama(), L40_LINKS, C) == pytest.approx(0.1 + LLAMA_BYTES / 24e9)
    assert cold_start_seconds(llama(), L40_LINKS, C) - 30.0 == pytest.approx(LLAMA_BYTES / 7e9)


def test_how_a_running_instance_leaves_its_gpus() -> None:
    sleepy = frozenset({EngineFeature.SLEEP_MODE, EngineFeature.DEV_MODE})
    vllm = EngineInstance(EngineKind.VLLM, "m", "bf16", ("g0",), GIB, LaunchSettings(0, features=sleepy))
    assert leaving_transition(vllm, host_copy=True) is Transition.SLEEP_LEVEL_1
    assert leaving_transition(vllm, host_copy=False) is Transition.SLEEP_LEVEL_2
    plain = EngineInstance(EngineKind.VLLM, "m", "bf16", ("g0",), GIB, LaunchSettings(0))
    assert leaving_transition(plain, host_copy=True) is None  # no sleep mode: it stops
    backup = frozenset({EngineFeature.SLEEP_MODE, EngineFeature.CPU_BACKUP})
    sglang = EngineInstance(EngineKind.SGLANG, "m", "bf16", ("g0",), GIB, LaunchSettings(0, features=backup))
    assert leaving_transition(sglang, host_copy=False) is Transition.SLEEP_LEVEL_1  # its release keeps a copy
