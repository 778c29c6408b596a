"""The baselines real teams run (sleep-router, swap-ttl, static-tuned) and the KV ablations, on hand-checked tiny traces.

The tiny scenario (test_engine.py): one GPU, two 4 GB models, NVMe 0.5 GB/s (a load from disk 8 s),
PCIe 1 GB/s (from host 4 s), prefill 1 ms/token, KV 1 MB per 1000 tokens; `local` engines with the
engine model's defaults: cold start 30 s, level-1 wake 0.1 s, level-2 wake 0.1 + 0.7 s reload, a sleeping
engine's CUDA context 1 GiB per GPU.
"""

from __future__ import annotations

import pytest
from test_engine import GB, tiny_scenario, tiny_trace

from planner_service.sim.engine import base_problem, simulate
from planner_service.sim.policies import create_policy
from planner_service.sim.policies.groups import operator_partition
from planner_service.sim.policies.static_tuned import StaticTunedPolicy, tune_static
from planner_service.sim.policies.swap_ttl import SwapTtlPolicy
from planner_service.sim.trace import TraceRequest


def switches(policy, gpu_bytes: int) -> tuple[list[float], dict[str, int]]:
    result = simulate(tiny_scenario(gpu_bytes), tiny_trace(), policy)
    assert result.violations == 0
    return [round(r.switch_seconds, 4) for r in result.requests], result.extra["engine_transitions"]


def test_every_baseline_writes_kv_through_and_the_ablations_do_not() -> None:
    for name in ("statebudget", "static", "lru", "oracle", "sleep-router", "swap-ttl", "independent"):
        assert create_policy(name).kv_offload, name
    for name in ("static-nokv", "lru-nokv"):
        assert not create_policy(name).kv_offload, name


def test_sleep_router_pre_launches_and_wakes_on_its_group() -> None:
    """Room for one model (6 GB).

    t=0: both engines were launched and put to sleep (no host copy yet: level 2, each keeps 1 GiB of
    context); a, the more requested, is awake. b at 100 s: a sleeps (level 2), b wakes at level 2:
    0.1 + 0.7 + 8 s from NVMe (which leaves a host copy), then re-prefills its 1000-token history, 1 s.
    a at 200 s: b sleeps at level 1 (its host copy), a wakes at level 2 (8.8 s); LMCache stored 768 of
    a's 1000-token first prompt to host (whole 256-token chunks, sim/kv_save.py): 0.768 ms to restore; the
    other 1232 tokens of the history are re-prefilled, 1.232 s.
    """
    latencies, transitions = switches(create_policy("sleep-router"), 6 * GB)
    assert latencies == pytest.approx([0.0, 9.8, 10.032768], abs=1e-3)
    assert transitions == {"sleep_level_2": 3, "wake_level_2": 2, "sleep_level_1": 1}


def test_sleep_router_with_room_for_both_never_switches() -> None:
    latencies, transitions = switches(create_policy("sleep-router"), 10 * GB)
    assert latencies == pytest.approx([0.0, 1.0, 1.0], abs=1e-3)  # only b's re-prefill, then a's
    assert "cold_start" not in transitions


def test_swap_ttl_restarts_instead_of_waking() -> None:
    """Room for one model: every switch stops the other engine and cold-starts (30 s) its own.

    a: 8 s from NVMe + 30 s. b: 8 + 30 + 1 s of re-prefill. a again: its first load left a host copy,
    4 + 30, the 768 tokens of its first prompt stored to host (sim/kv_save.py) restored in 0.768 ms, the
    other 1232 of the history re-prefilled in 1.232 s.
    """
    latencies, transitions = switches(create_policy("swap-ttl"), 6 * GB)
    assert latencies == pytest.approx([38.0, 39.0, 35.232768], abs=1e-3)
    assert transitions == {"cold_start": 3, "stop": 2}


def test_swap_ttl_stops_an_idle_engine_after_its_keep_alive() -> None:
    """Room for both, keep-alive 50 s, ticks every 60 s: a finishes at 39 s and is idle at the 120 s
    tick (81 s > 50 s): it stops, so at 200 s it cold-starts from its host copy (4 + 30), restores the 768
    tokens of its first prompt stored to host (0.768 ms) and re-prefills the other 1232 (1.232 s). b (at
    100 s, its gap kept from a's arrival) finished at 140 s, is 40 s idle at the 180 s tick and stays; the
    replay ends with a's turn at about 236 s, before the 240 s tick would stop b."""
    latencies, transitions = switches(SwapTtlPolicy(keep_alive_seconds=50.0), 10 * GB)
    assert latencies == pytest.approx([38.0, 39.0, 35.232768], abs=1e-3)
    assert transitions == {"cold_start": 3, "stop": 1}


def test_the_operator_partition_spreads_models_over_whole_nodes_or_their_declared_groups() -> None:
    from planner_service.domain.demo import demo_scenario

    problem = base_problem(demo_scenario())
    partition = operator_partition(problem)
    assert set(partition) == set(problem.models)
    for engine in partition.values():
        declared = problem.nodes[engine.node].engine_gpus.get(engine.model)
        # TP over the whole node, or over the GPUs the node declares the model's engine on
        assert {g.id for g in engine.gpus} == set(declared or problem.nodes[engine.node].gpus)
        assert engine.precision in problem.models[engine.model].precisions
    assert len({e.node for e in partition.values()}) == len(problem.nodes)  # every node group is used
    assert [g.id for g in partition["vision"].gpus] == ["n4-g1"]  # the demo declares vision's engine there


def test_static_tuned_searches_the_whole_small_space() -> None:
    """Room for both (10 GB): each model is fixed on g0 or loaded on demand, 2 x 2 = 4 candidates, all fit,
    so the search is exhaustive (4 replays of the one training trace). Both fixed wins: only the
    re-prefills, 1 s per hand-off (the P95 of [1, 1]); with either model on demand its first use is a
    cold start (8 + 30 s). Its completions are the prefills and their stores to host DRAM (sim/kv_save.py):
    1.000768, 2.001792 and 2.002048 s, P95 2.001792 + 0.9 x 0.000256 = 2.0020224 s."""
    tuned = tune_static(tiny_scenario(10 * GB), [tiny_trace()], budget=20)
    assert (tuned.space_size, tuned.replays, tuned.pruned, tuned.exhaustive) == (4, 4, 0, True)
    assert sorted(tuned.partition) == ["a", "b"]
    assert tuned.best_score == pytest.approx((0.0, 1.0, 2.0020224))
    latencies, transitions = switches(StaticTunedPolicy(tuned.partition), 10 * GB)
    assert latencies == pytest.approx([0.0, 1.0, 1.0], abs=1e-3) and transitions == {}


def test_static_tuned_prunes_what_does_not_fit_and_serves_the_rest_on_demand() -> None:
    """Room for one (6 GB): both fixed does not fit, and one fixed leaves the other (4 GB) only 2 GB to be
    loaded into: three of four candidates pruned. Both on demand is the one replay, and it replays as
    `lru` does (write-through included)."""
    tuned = tune_static(tiny_scenario(6 * GB), [tiny_trace()], budget=20)
    assert (tuned.space_size, tuned.replays, tuned.pruned, tuned.failed) == (4, 1, 3, 0)
    assert tuned.partition == {}
    latencies, _ = switches(StaticTunedPolicy(tuned.partition), 6 * GB)
    assert latencies == pytest.approx([38.0, 39.0, 5.332768], abs=1e-3)


def test_static_tuned_ranks_a_partition_that_fails_requests_below_every_one_that_fails_none() -> None:
    """Room for both (10 GB), a first turn on a with 2.5 M tokens of context (2.5 GB of KV): both fixed
    leaves 2 GB beside the weights, so that turn times out (the client's 600 s) though every later hand-off
    would be fastest; a fixed with b on demand (or the reverse, or both on demand) leaves 6 GB and serves
    it. The search ranks failed requests first."""
    trace = [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=2_500_000, output_tokens=0),
        TraceRequest(t=10.0, session="s2", model="a", input_tokens=1000, output_tokens=0),
        TraceRequest(t=20.0, session="s2", model="b", input_tokens=1000, output_tokens=0),
    ]
    tuned = tune_static(tiny_scenario(10 * GB), [trace], budget=20)
    assert tuned.exhaustive and tuned.replays == 4 and tuned.failed == 0
    both = [score for score, choice in tuned.scores if len(choice) == 2]
    assert len(both) == 1 and both[0][0] == 1.0  # both fixed: one failed request
    assert tuned.best_score[0] == 0.0 and len(tuned.partition) < 2


def test_static_tuned_respects_its_replay_budget() -> None:
    """Budget 2 for a 4-candidate space: not exhaustive; the operator's partition, then samples."""
    tuned = tune_static(tiny_scenario(10 * GB), [tiny_trace()], budget=2)
    assert not tuned.exhaustive and tuned.replays <= 2


def test_static_tuned_refuses_to_run_without_a_searched_partition() -> None:
    with pytest.raises(ValueError, match="partition found on training traces"):
        create_policy("static-tuned")


@pytest.mark.parametrize(("name", "moved", "transitions"), [
    ("sleep-router", 0, {"sleep_level_2": 2, "stop_asleep": 1}),
    ("swap-ttl", 4 * GB, {"cold_start": 1}),
])  # fmt: skip
def test_a_fixed_group_too_small_for_a_request_keeps_its_engine_up_until_the_timeout(
    name: str, moved: int, transitions: dict[str, int]
) -> None:
    """Room for one model (6 GB); s1's turn on a needs 10 GB of KV, which a's group never holds. a's engine
    can serve on no other GPUs, so it stays up: no sleep and wake (or stop and restart) on the same GPU at
    every dispatch pass (that was 145 level-1 wakes and 584 GB moved for sleep-router, 17 restarts for
    swap-ttl). s1's turn fails at the client's 600 s; s2's waits behind it (first come, first served per
    model) and is served then: its 1000 tokens of prefill and the store of 768 to host, 601.000768 s."""
    records = [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=10_000_000, output_tokens=0),
        TraceRequest(t=10.0, session="s2", model="a", input_tokens=1000, output_tokens=0),
    ]
    result = simulate(tiny_scenario(6 * GB), records, create_policy(name))
    lost, served = result.requests
    assert (lost.state, lost.failed_at) == ("failed", 600.0)
    assert (served.state, served.switch_seconds) == ("done", pytest.approx(590.0))
    assert result.bytes_moved == moved and result.extra["engine_transitions"] == transitions
    assert result.fallback_loads == 0 and result.duration_seconds == pytest.approx(601.000768)
