"""The replay runs the engine model: cold starts, wakes by sleep level, sleeping residue, declared kinds."""

from __future__ import annotations

import pytest

from planner_service.domain.engines import EngineConstants, EngineState
from planner_service.domain.scenario import Scenario, parse_scenario
from planner_service.domain.state import Kind, Location, StateObject
from planner_service.sim.engine import Simulator
from planner_service.sim.policies import create_policy
from planner_service.sim.trace import TraceRequest
from tests.sim.test_engine import GB, tiny_scenario, tiny_trace


def with_engines(scenario: Scenario, **engine: object) -> Scenario:
    data = scenario.model_dump(mode="json", exclude_none=True)
    data["cluster"]["nodes"][0]["engines"] = [{"model": m, **engine} for m in ("a", "b")]
    return parse_scenario(data)


def switches(scenario: Scenario) -> tuple[Simulator, list[float]]:
    sim = Simulator(scenario, tiny_trace(), create_policy("lru"))
    result = sim.run()
    assert result.violations == 0
    return sim, [round(r.switch_seconds, 4) for r in result.requests]


# Room for one model (6 GB): every hand-off takes the other model's engine off the GPU.
def test_a_vllm_engine_without_sleep_mode_stops_and_cold_starts_again() -> None:
    sim, seconds = switches(with_engines(tiny_scenario(6 * GB), kind="vllm"))
    # a cold: 8 s from NVMe + 30 s; b the same + 1 s re-prefill; a again: stopped, so a cold start from the
    # host copy its first load left, 4 + 30, and the 2000-token history re-prefilled, 2
    assert seconds == pytest.approx([38.0, 39.0, 36.0])
    assert not sim.engines.asleep  # a stop leaves no residue


# Room for one running model and a sleeping one's context (6.5 GB: 4 GB of weights and two 1 GiB contexts).
ONE_AND_A_RESIDUE = int(6.5 * GB)


def test_a_vllm_engine_with_sleep_mode_sleeps_at_level_1_and_wakes_from_its_host_backup() -> None:
    scenario = with_engines(tiny_scenario(ONE_AND_A_RESIDUE), kind="vllm", features=["sleep_mode", "dev_mode"])
    sim, seconds = switches(scenario)
    # a again: a level-1 wake, 0.1 s + 4 s from the host backup; its sleep freed its KV: re-prefill 2000, 2
    assert seconds == pytest.approx([38.0, 39.0, 6.1])
    sleeping = sim.engines.asleep[("b", "n1")]
    assert sleeping.state is EngineState.ASLEEP_HOST
    # b's CUDA context stays on the GPU while it sleeps: the GPU holds a's weights and context, b's residue
    # and the KV
    gpu = Location.gpu("g0")
    kv = sum(sim.cluster.bytes_of(o, gpu) for o in sim.cluster.objects_at(gpu) if o.kind is Kind.KV)
    assert sim.cluster.used[gpu] - kv == 4 * GB + 2 * EngineConstants().context_bytes_per_gpu


def test_a_sleeping_engine_whose_context_leaves_no_room_is_stopped_and_cold_starts() -> None:
    """Room for one model and its context only (6 GB): b's start stops a's sleeping engine for the room its
    residue takes, so a comes back cold: 4 s from its host copy + 30 s, and its history re-prefilled, 2 s."""
    scenario = with_engines(tiny_scenario(6 * GB), kind="vllm", features=["sleep_mode", "dev_mode"])
    sim, seconds = switches(scenario)
    assert seconds == pytest.approx([38.0, 39.0, 36.0])
    assert sim.executor.transitions["stop_asleep"] >= 1


def test_a_wake_without_a_host_copy_reloads_from_disk() -> None:
    data = tiny_scenario(ONE_AND_A_RESIDUE).model_dump(mode="json", exclude_none=True)
    data["cluster"]["nodes"][0]["host_dram_bytes"] = 5 * GB  # no room for a second model's host copy
    sim, seconds = switches(with_engines(parse_scenario(data), kind="vllm", features=["sleep_mode", "dev_mode"]))
    c = EngineConstants()
    # a's first load left its host copy; b's did not fit beside it. a again: level-1 wake from that copy.
    assert seconds[2] == pytest.approx(c.wake_fixed_seconds + 4.0 + 2.0)
    assert sim.engines.asleep[("b", "n1")].state is EngineState.ASLEEP_DISCARDED  # no backup: level 2


def test_an_adopted_engine_is_woken_never_cold_started() -> None:
    # room for both engines running with their contexts: 2 x (4 GB + 1 GiB)
    data = tiny_scenario(int(10.5 * GB)).model_dump(mode="json", exclude_none=True)
    data["cluster"]["nodes"][0]["engines"] = [
        {"model": m, "gpus": ["g0"], "kind": "vllm", "features": ["sleep_mode", "dev_mode"], "management": "adopted"}
        for m in ("a", "b")
    ]
    sim, seconds = switches(parse_scenario(data))
    c = EngineConstants()
    # both sleep at level 2 from t=0 (their owner started them; no host copy yet): a level-2 wake each,
    # 0.1 + 0.7 s + 8 s of copy from NVMe, b also re-prefilling the 1000-token history
    assert seconds == pytest.approx([c.wake_fixed_seconds + c.reload_fixed_seconds + 8.0, 0.8 + 8.0 + 1.0, 1.0])
    assert not sim.engines.asleep  # both woken: their residue serves again


def test_a_vllm_engine_without_lmcache_keeps_no_kv_in_host() -> None:
    # every baseline (static here) writes each turn's KV through to host DRAM where the engine can: LMCache's CPU tier, or local
    plain = with_engines(tiny_scenario(6 * GB), kind="vllm", features=["sleep_mode", "dev_mode"])
    lmcache = with_engines(tiny_scenario(6 * GB), kind="vllm", features=["sleep_mode", "dev_mode", "lmcache"])
    host = Location.host("n1")
    for scenario, keeps in ((plain, False), (lmcache, True)):
        sim = Simulator(scenario, tiny_trace(), create_policy("static"))
        sim.run()
        kv = [o for o in sim.cluster.objects_at(host) if o.kind is Kind.KV]
        assert bool(kv) is keeps


def test_a_plan_may_not_move_one_sessions_kv_on_a_vllm_node() -> None:
    from planner_service.planner.operations import Action, Operation

    for kind, outcome in (("vllm", "failed"), ("local", "started")):
        sim = Simulator(with_engines(tiny_scenario(), kind=kind), tiny_trace(), create_policy("lru"))
        kv, gpu, host = StateObject.kv("a", "s1"), Location.gpu("g0"), Location.host("n1")
        sim.cluster.add(kv, gpu, 1000)
        demote = Operation("op-1", Action.DEMOTE, kv, gpu, host, 1000, False, node="n1")
        assert sim.executor.apply(demote, lambda op, t: None) == outcome


def moe_scenario(**engine: object) -> Scenario:
    """The tiny node's 10 GB GPU and a MoE: 2 GB of dense weights, 20 GB of routed experts, 1 MB of KV a token."""
    data = tiny_scenario().model_dump(mode="json", exclude_none=True)
    data["models"].append(
        {
            "id": "moe",
            "weights_bytes": {"bf16": 2 * GB},
            "kv_bytes_per_token": 1_000_000,
            "active_params": 250_000_000,
            "experts_bytes": 20 * GB,
            "expert_bytes": GB // 8,
        }
    )
    data["residency"] += [
        {
            "object": {"kind": "weights", "model": "moe", "precision": "bf16"},
            "location": {"tier": "nvme", "node": "n1"},
            "bytes": 2 * GB,
        },
        {"object": {"kind": "experts", "model": "moe"}, "location": {"tier": "nvme", "node": "n1"}, "bytes": 20 * GB},
    ]
    if engine:
        data["cluster"]["nodes"][0]["engines"] = [{"model": m, **engine} for m in ("a", "b", "moe")]
    return parse_scenario(data)


@pytest.mark.parametrize("kind", ["vllm", "local"])
def test_a_launch_fixed_expert_share_leaves_the_waiting_requests_kv_room(kind: str) -> None:
    # 3000 tokens in: 3 GB of KV, more than the 1 GB (10 %) an expert fill leaves; vLLM fixes the share at
    # launch, so the fill leaves the request's 3 GB instead (filling 8 GB - 1 GB would strand it: it would wait
    # on a group that never holds it, and each reload would fill the same room again)
    trace = [TraceRequest(t=0.0, session="s1", model="moe", input_tokens=3000, output_tokens=0)]
    sim = Simulator(moe_scenario(kind=kind, features=["sleep_mode", "dev_mode"]), trace, create_policy("lru"))
    result = sim.run()
    assert result.violations == 0 and [r.state for r in result.requests] == ["done"]
    experts = sim.cluster.bytes_of(StateObject.experts("moe"), Location.gpu("g0"))
    # vllm: 10 - 2 of weights - 3 of KV - the engine's 1 GiB CUDA context, in whole experts (1/8 GB):
    # 3.875 GB, which stay while the engine runs; local: the 7 GB fill gives way to the KV (experts are a
    # cache there)
    assert experts == (3_875_000_000 if kind == "vllm" else 0)


def test_a_moe_prefill_queued_behind_its_own_engine_s_shares_its_passes() -> None:
    """The MoE's vLLM engine, launched for s1's 1000-token prompt with its experts mostly off GPU (streamed over
    the card's 1 GB/s every pass), gets two 500-token prompts at once later, in the room s1's KV gives up. The
    first prefills alone: its one chunk touches 1 - (159/160)^500 of the experts and pays that pass whole.
    The second waits behind it, and its tokens fill the engine's next passes with others': a full 2048-token
    chunk's passes per token, 500 / 2048 of a pass."""
    trace = [
        TraceRequest(t=0.0, session="s1", model="moe", input_tokens=1000, output_tokens=0),
        *(TraceRequest(t=100.0, session=s, model="moe", input_tokens=500, output_tokens=0) for s in ("s2", "s3")),
    ]
    sim = Simulator(moe_scenario(kind="vllm", features=["sleep_mode", "dev_mode"]), trace, create_policy("lru"))
    _, first, second = sim.run().requests
    f, in_dram = sim.expert_share("moe", sim.models["moe"])
    assert 0 < f < 1 and not in_dram
    per_pass = (1 - f) * 20 * GB / GB
    assert first.prefill_queue_seconds == 0 and second.prefill_queue_seconds > 0
    alone = 500 * 1e-3 + (1 - (159 / 160) ** 500) * per_pass
    packed = 500 * 1e-3 + 500 * (1 - (159 / 160) ** 2048) / 2048 * per_pass
    assert first.ttft_seconds - first.switch_seconds == pytest.approx(alone, rel=1e-9)
    assert second.ttft_seconds - second.switch_seconds == pytest.approx(packed, rel=1e-9)
    assert packed < alone / 3


def test_a_sleep_keeps_its_context_in_the_room_its_own_weights_leave() -> None:
    """a's `local` engine (its context charged asleep only) serves on g0 + g1 (2 GB of weights on each); other
    engines hold 7.6 GB of g1 beside it, so 0.4 GB is free there, less than the CUDA context (1 GiB) a
    sleeping engine keeps. A plan drops a's shard on g0 first: the sleep that takes the engine down is one
    call for its group and frees its shard on g1 with it, so the context stays and the engine sleeps, never
    stops."""
    from planner_service.planner.operations import Action, Operation
    from tests.sim.test_engine import two_gpu_scenario

    sim = Simulator(with_engines(two_gpu_scenario(), kind="local"), [], create_policy("lru"))
    gpus = tuple(sim.problem.gpus[g] for g in ("g0", "g1"))
    g0, g1 = Location.gpu("g0"), Location.gpu("g1")
    weights = StateObject.weights("a", "bf16")
    sim.executor.place_now("a", "n1", "bf16", gpus)
    sim.cluster.hold("b", g1, int(7.6 * GB))
    assert sim.cluster.free(g1) < sim.engines.residue_bytes()
    drop = Operation("op-1", Action.DROP, weights, g0, None, 2 * GB, False, node="n1")
    assert sim.executor.apply(drop, lambda op, transfer: None) == "done"
    assert sim.engines.asleep[("a", "n1")].state is EngineState.ASLEEP_DISCARDED  # no host copy: level 2
    assert sim.executor.transitions["stop"] == 0
    assert sim.cluster.bytes_of(weights, g1) == 0
    assert sim.cluster.violations == 0
    for loc in (g0, g1):
        assert sim.cluster.free(loc) >= 0


def test_a_running_vllm_engine_holds_its_context_and_its_sleep_keeps_it() -> None:
    """a's vLLM engine serves on g0 + g1 (2 GB of weights on each) and holds its CUDA context (1 GiB) on both
    from its start, as the planner counts it (engine_holdings.context_bytes); other engines then fill g1 but for
    0.4 GB, less than a context. A plan drops a's shard on g0: the sleep keeps the context the engine held
    running as its residue, so it needs no room there and the engine sleeps, never stops."""
    from planner_service.planner.operations import Action, Operation
    from tests.sim.test_engine import two_gpu_scenario

    sim = Simulator(
        with_engines(two_gpu_scenario(), kind="vllm", features=["sleep_mode", "dev_mode"]), [], create_policy("lru")
    )
    gpus = tuple(sim.problem.gpus[g] for g in ("g0", "g1"))
    g0, g1 = Location.gpu("g0"), Location.gpu("g1")
    weights = StateObject.weights("a", "bf16")
    sim.executor.place_now("a", "n1", "bf16", gpus)
    context = EngineConstants().context_bytes_per_gpu
    assert sim.cluster.used[g0] == sim.cluster.used[g1] == 2 * GB + context
    sim.cluster.hold("b", g1, sim.cluster.free(g1) - int(0.4 * GB))
    used = sim.cluster.used[g1]
    drop = Operation("op-1", Action.DROP, weights, g0, None, 2 * GB, False, node="n1")
    assert sim.executor.apply(drop, lambda op, transfer: None) == "done"
    assert sim.engines.asleep[("a", "n1")].state is EngineState.ASLEEP_DISCARDED  # no host copy: level 2
    assert sim.executor.transitions["stop"] == 0
    assert sim.cluster.used[g1] == used  # the residue is the context it held running
    assert sim.cluster.used[g0] == context
    assert sim.cluster.violations == 0
