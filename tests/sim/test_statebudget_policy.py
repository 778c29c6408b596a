"""What the `statebudget` policy adds around the planner: the load it plans for, pins, eviction order, hysteresis."""

from __future__ import annotations

import pytest

from planner_service.domain.scenario import Scenario, Slo, parse_scenario
from planner_service.domain.state import Location, StateObject, Tier
from planner_service.planner.operations import Action, Operation
from planner_service.planner.plan import make_plan
from planner_service.planner.registry import SolverName
from planner_service.sim.engine import SessionState, SimRequest, Simulator
from planner_service.sim.policies import create_policy
from planner_service.sim.policies.clairvoyant import ClairvoyantPolicy
from planner_service.sim.policies.statebudget import StatebudgetPolicy
from planner_service.sim.trace import TraceRequest
from tests.sim.test_engine import tiny_scenario, tiny_trace

GB = 10**9


def two_node_scenario() -> Scenario:
    """Two nodes of two 10 GB GPUs; models a, b, c of 4 GB weights and 1,000 bytes of KV per token."""
    model = {"weights_bytes": {"bf16": 4 * GB}, "kv_bytes_per_token": 1000, "active_params": 250_000_000}
    return parse_scenario(
        {
            "cluster": {
                "nodes": [
                    {
                        "id": n,
                        "nvme_read_bytes_per_s": 0.5 * GB,
                        "gpus": [
                            {
                                "id": f"{n}-g{i}",
                                "hbm_bytes": 10 * GB,
                                "hbm_bytes_per_s": 1000 * GB,
                                "bf16_flops": 1e12,
                                "h2d_bytes_per_s": 1 * GB,
                            }
                            for i in range(2)
                        ],
                    }
                    for n in ("n1", "n2")
                ]
            },
            "models": [{"id": m, **model} for m in ("a", "b", "c")],
            "residency": [
                {
                    "object": {"kind": "weights", "model": m, "precision": "bf16"},
                    "location": {"tier": "nvme", "node": n},
                    "bytes": 4 * GB,
                }
                for m in ("a", "b", "c")
                for n in ("n1", "n2")
            ],
        }
    )


def simulator(**options: object) -> tuple[Simulator, StatebudgetPolicy]:
    policy = create_policy("statebudget", warm_start=False, **options)
    assert isinstance(policy, StatebudgetPolicy)
    sim = Simulator(
        two_node_scenario(), [TraceRequest(t=0.0, session="x", model="a", input_tokens=1, output_tokens=1)], policy
    )
    policy.setup(sim.view, sim.executor)
    return sim, policy


def arrive(sim: Simulator, policy: StatebudgetPolicy, t: float, session: str, model: str, context: int) -> None:
    sim.now = t
    state = sim.sessions.setdefault(
        session, SessionState(session, session, Slo.INTERACTIVE, history_tokens=context - 100)
    )
    req = SimRequest(0, t, session, model, 50, 50, Slo.INTERACTIVE, False)
    policy.observe(sim.view, state, req)


def test_the_planned_problem_carries_the_stand_ins_as_active_sessions() -> None:
    sim, policy = simulator(demand_seats=2)
    arrive(sim, policy, 1.0, "s0", "c", 2000)
    problem = policy.problem(sim.view)
    assert {s.id for s in problem.sessions.values() if s.active} == {"expected-c-0", "expected-c-1"}
    assert set(problem.next_model) >= {"expected-c-0", "expected-c-1"}


def test_a_model_that_served_within_the_window_keeps_its_node_until_its_requests_are_stuck() -> None:
    sim, policy = simulator(unpin_after_seconds=60.0)
    sim.executor.place_now("a", "n2", "bf16", [sim.problem.gpus["n2-g0"]])
    sim.executor.place_now("b", "n1", "bf16", [sim.problem.gpus["n1-g0"]])
    sim.now = 1000.0
    sim.touch(StateObject.weights("a", "bf16"))  # a served just now; b last at t=0, beyond the 300 s window
    assert policy.pins(sim.view) == ({"a": "n2"}, {"a": "bf16"})
    waiting = SimRequest(0, 900.0, "s1", "a", 10, 10, Slo.INTERACTIVE, False, admitted_at=900.0)
    sim.waiting.append(waiting)  # waited 100 s > 60 s: a may move
    assert policy.pins(sim.view) == ({}, {})


def test_weights_that_served_within_the_window_are_evicted_after_idle_kv() -> None:
    sim, policy = simulator()
    loc = Location.gpu("n1-g0")
    recent, stale = StateObject.weights("a", "bf16"), StateObject.weights("b", "bf16")
    kv, experts = StateObject.kv("c", "s1"), StateObject.experts("c")
    sim.now = 1000.0
    sim.last_used.update({recent: 990.0, stale: 100.0, kv: 995.0})
    order = sorted((policy.victim_key(sim.view, obj, loc), obj) for obj in (recent, stale, kv, experts))
    assert [obj for _, obj in order] == [experts, stale, kv, recent]
    policy.keep = {(experts, loc)}  # what the adopted plan keeps goes last of all
    order = sorted((policy.victim_key(sim.view, obj, loc), obj) for obj in (recent, stale, kv, experts))
    assert [obj for _, obj in order][-1] == experts


def test_an_on_demand_load_reserves_the_models_working_set() -> None:
    sim, policy = simulator()
    sim.now = 400.0
    for sid, model, last_t, history in [("s1", "a", 350.0, 2000), ("s2", "a", 10.0, 5000), ("s3", "b", 390.0, 7000)]:
        sim.sessions[sid] = SessionState(sid, sid, Slo.INTERACTIVE, history_tokens=history, model=model, last_t=last_t)
    waiting = SimRequest(0, 399.0, "s4", "a", 100, 100, Slo.INTERACTIVE, False, admitted_at=399.0)
    sim.sessions["s4"] = SessionState("s4", "s4", Slo.INTERACTIVE, history_tokens=800, request=waiting)
    sim.waiting.append(waiting)
    # s4's request (800 + 100 + 100 tokens) and s1 (served a within 300 s); not s2 (too long ago) nor s3 (on b)
    assert policy.kv_reserve(sim.view, "a") == (1000 + 2000) * 1000


def test_a_load_whose_working_set_fits_nowhere_still_leaves_room_for_the_waiting_request() -> None:
    sim, _policy = simulator()
    sim.now = 10.0
    for i in range(4):  # 4 x 8 GB of recent sessions on a: more than any node's two GPUs hold beside the weights
        sim.sessions[f"s{i}"] = SessionState(
            f"s{i}", "u", Slo.INTERACTIVE, history_tokens=8_000_000, model="a", last_t=5.0
        )
    waiting = SimRequest(0, 9.0, "w", "a", 100, 100, Slo.INTERACTIVE, False, admitted_at=9.0)
    sim.sessions["w"] = SessionState("w", "w", Slo.INTERACTIVE, history_tokens=11_000_000, request=waiting)
    sim.waiting.append(waiting)
    assert sim.executor.load_model("a")
    # 4 GB of weights + 11 GB of the waiting request's KV need both GPUs of a node
    assert len(sim.models["a"].gpus) == 2


def test_experts_the_engine_evicted_are_not_promoted_back_within_the_window() -> None:
    data = two_node_scenario().model_dump(mode="json", exclude_none=True)
    data["models"].append(
        {
            "id": "moe",
            "weights_bytes": {"bf16": 1 * GB},
            "kv_bytes_per_token": 1000,
            "active_params": 250_000_000,
            "experts_bytes": 4 * GB,
            "expert_bytes": GB // 8,
        }
    )
    policy = create_policy("statebudget", warm_start=False)
    assert isinstance(policy, StatebudgetPolicy)
    trace = [TraceRequest(t=0.0, session="x", model="a", input_tokens=1, output_tokens=1)]
    sim = Simulator(parse_scenario(data), trace, policy)
    policy.setup(sim.view, sim.executor)
    experts, gpu, host = StateObject.experts("moe"), Location.gpu("n1-g0"), Location.host("n1")
    sim.cluster.add(experts, host, 4 * GB)
    sim.cluster.add(experts, gpu, GB)
    sim.now = 1000.0
    assert sim.executor.evict(experts, gpu) == GB  # the engine makes room: the policy hears of it
    promote = Operation("op-1", Action.PROMOTE, experts, host, gpu, GB, True, node="n1")
    assert policy._start(sim.view, promote) == "failed"  # a plan may not hand the room back within the window
    sim.now = 1000.0 + 301.0
    assert policy._start(sim.view, promote) == "started"


@pytest.mark.parametrize("old_engine_busy", [False, True])
def test_a_plan_that_widens_a_group_onto_shards_already_there_serves_from_the_wider_group(
    old_engine_busy: bool,
) -> None:
    sim, policy = simulator()
    g0, g1 = sim.problem.gpus["n1-g0"], sim.problem.gpus["n1-g1"]
    weights = StateObject.weights("a", "bf16")
    sim.executor.place_now("a", "n1", "bf16", [g0])
    sim.cluster.add(weights, Location.gpu("n1-g1"), 2 * GB)  # a shard an earlier two-GPU engine left
    sim.demand["a"] = 1  # a request of a is in flight: its weights are pinned
    if old_engine_busy:  # ... and runs on the one-GPU engine, which reads the whole copy on g0
        sim.running_on[("a", sim.models["a"].epoch)] = 1
    target = {
        (weights, Location.gpu("n1-g0")): 2 * GB,
        (weights, Location.gpu("n1-g1")): 2 * GB,
        (weights, Location.nvme("n1")): 4 * GB,
    }
    plan = make_plan(policy.problem(sim.view), SolverName.GREEDY, target, {})
    assert not any(op.action is Action.PROMOTE for op in plan.operations)  # nothing to copy: no copy would finish
    policy.adopt(sim.view, plan)
    assert sim.models["a"].gpus == (g0, g1)
    # the plan's drop of the surplus on g0 waits for the old engine's requests, not for every request of a
    assert sim.cluster.bytes_of(weights, Location.gpu("n1-g0")) == (4 if old_engine_busy else 2) * GB


def test_clairvoyant_predicts_each_session_s_real_next_model_and_nothing_after_its_last() -> None:
    trace = [
        TraceRequest(t=0.0, session="x", model="a", input_tokens=10, output_tokens=10),
        TraceRequest(t=5.0, session="x", model="c", input_tokens=10, output_tokens=10),
    ]
    policy = create_policy("clairvoyant", warm_start=False, demand_seats=1)
    assert isinstance(policy, ClairvoyantPolicy)
    sim = Simulator(two_node_scenario(), trace, policy)
    policy.setup(sim.view, sim.executor)
    arrive(sim, policy, 0.0, "x", "a", 200)
    sim.sessions["x"].model = "a"  # its turn on a served
    problem = policy.problem(sim.view)
    assert problem.next_model["x"] == {"c": 1.0}
    stand_in = next(s for s in problem.sessions if s.startswith("expected-"))
    assert problem.next_model[stand_in] == StatebudgetPolicy.next_models(policy, sim.view, problem.sessions)[stand_in]
    arrive(sim, policy, 5.0, "x", "c", 300)
    sim.sessions["x"].model = "c"
    assert policy.problem(sim.view).next_model["x"] == {}


def test_the_control_path_is_charged_to_the_requests_a_plan_serves() -> None:
    # room for one model: the hand-off to b waits for a plan that loads it, which reaches the node's engine
    # `control_path_seconds` after it is made; the hand-off back to a, prefetched within its gap, does not wait
    def switch_seconds(control_path_seconds: float) -> list[float]:
        policy = StatebudgetPolicy(control_path_seconds=control_path_seconds)
        result = Simulator(tiny_scenario(6 * GB), tiny_trace(), policy).run()
        return [r.switch_seconds for r in result.requests]

    direct, charged = switch_seconds(0.0), switch_seconds(2.0)
    assert charged[1] == pytest.approx(direct[1] + 2.0)
    assert charged[2] == pytest.approx(direct[2])


def test_engines_are_prelaunched_asleep_as_sleep_router_s_are() -> None:
    """A deployment that has run before starts no engine cold for its first request: like `sleep-router`'s, every
    engine the warm start leaves off is launched once before the trace and sleeps on the operator's group.

    What it buys is the cold starts' bytes, not hand-off time: on the demo hour (gaps x16, seeds 1 to 8) both
    runs' hand-offs wait alike, to the millisecond; prelaunched, seed 2 moves 531 GB against 568 GB."""
    from planner_service.domain.demo import demo_scenario
    from planner_service.domain.predictions import problem_from_scenario
    from planner_service.domain.problem import native_precision_scenario
    from planner_service.sim.engine import Simulator
    from planner_service.sim.policies.groups import operator_partition

    scenario = native_precision_scenario(demo_scenario())
    partition = operator_partition(problem_from_scenario(scenario))

    def asleep(prelaunch: bool) -> dict[str, str]:
        sim = Simulator(scenario, [], StatebudgetPolicy(prelaunch=prelaunch))  # no request: no warm model
        sim.run()
        return {model: node for model, node in sim.engines.asleep}

    assert asleep(prelaunch=True) == {model: engine.node for model, engine in partition.items()}
    assert asleep(prelaunch=False) == {}


def test_statebudget_groups_declares_each_model_on_its_operator_group_only() -> None:
    """`declared_on_groups`: a node declares engines only for its models, on their groups, and keeps no GPU
    copy of another model; the checkpoints on disk stay on every node."""
    from planner_service.domain.demo import demo_scenario
    from planner_service.domain.predictions import problem_from_scenario
    from planner_service.sim.policies.groups import declared_on_groups, operator_partition

    scenario = demo_scenario()
    partition = operator_partition(problem_from_scenario(scenario))
    deployed = problem_from_scenario(declared_on_groups(scenario, partition))
    for node_id, node in deployed.nodes.items():
        mine = {m for m, e in partition.items() if e.node == node_id}
        assert node.serves == mine
        assert {m: tuple(g) for m, g in node.engine_gpus.items()} == {
            m: tuple(g.id for g in partition[m].gpus) for m in mine
        }
    for obj, loc in deployed.residency:
        if loc.tier is Tier.GPU:
            assert partition[obj.model].node == deployed.gpus[loc.id].node
    assert {loc.id for obj, loc in deployed.residency if loc.tier is Tier.NVME} == set(deployed.nodes)


def test_statebudget_groups_serves_every_model_on_its_operator_group() -> None:
    """Over a demo hour every engine `statebudget-groups` brings up runs on the group `sleep-router` would
    wake it on, and no engine starts cold (all were launched before the trace and sleep there)."""
    from planner_service.domain.demo import demo_scenario
    from planner_service.domain.predictions import problem_from_scenario
    from planner_service.domain.problem import native_precision_scenario
    from planner_service.sim.engine import simulate
    from planner_service.sim.metrics import summarize
    from planner_service.sim.policies.groups import operator_partition
    from planner_service.sim.policies.statebudget import StatebudgetGroupsPolicy
    from planner_service.sim.seeds import trace
    from planner_service.sim.synth import SynthParams

    scenario = native_precision_scenario(demo_scenario())
    partition = operator_partition(problem_from_scenario(scenario))
    served: set[tuple[str, str, tuple[str, ...]]] = set()

    class Recording(StatebudgetGroupsPolicy):
        def on_model_ready(self, sim, model: str) -> None:  # type: ignore[no-untyped-def]
            state = sim.models[model]
            served.add((model, state.node, tuple(g.id for g in state.gpus)))
            super().on_model_ready(sim, model)

    records = trace(scenario, SynthParams(sessions=5, hours=1.0, gap_scale=8), 1)
    result = simulate(scenario, records, Recording(), seed=1)
    assert served and {(m, n, g) for m, n, g in served} <= {
        (m, e.node, tuple(g.id for g in e.gpus)) for m, e in partition.items()
    }
    assert summarize(result)["engine_transitions"].get("cold_start", 0) == 0
