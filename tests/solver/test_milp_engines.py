"""The MILP's plans on vLLM nodes go through the engine model as the greedy's do (planner/plan.py's
make_plan) and pass the same checker: the restart that pays is one engine step, the shift that does not
pay moves no engine; the formulation's engine rows (C10-C12, no group an engine does not offer) each make
the solver's own plan sound where, without them, it is one the checker refuses."""

from __future__ import annotations

import dataclasses

import pytest
from solver_cases import experts, gpu, held, kv, model, node, problem_of, session, weights

from planner_service.domain.engines import EngineState, Transition
from planner_service.domain.problem import Problem
from planner_service.domain.state import Location, StateObject
from planner_service.domain.units import GIB
from planner_service.planner.engine_holdings import launched_pools
from planner_service.planner.engine_instances import ENGINE_CONSTANTS, confirmed_states
from planner_service.planner.invariants import check_plan
from planner_service.planner.plan import Plan, make_plan
from planner_service.solver.formulation import PREFILL_STEP
from planner_service.solver.registry import solve

VLLM = {"kind": "vllm", "features": ["lmcache", "sleep_mode", "dev_mode"]}


@pytest.mark.parametrize(("b_active", "steps"), [(True, {Transition.RESTART, Transition.START}), (False, set())])
def test_milp_plans_on_vllm_nodes_are_engine_steps(b_active: bool, steps: set[Transition]) -> None:
    """One 26 GiB card whose vLLM engine serves a at bf16 (16 GiB); b (12 GiB) fits beside a only at fp8."""
    engines = [{"model": "a", "gpus": ["g0"], **VLLM}, {"model": "b", "gpus": ["g0"], **VLLM}]
    problem = problem_of(
        [{**node("n0", gpu("g0", 26)), "engines": engines}],
        [model("a", {"bf16": 16, "fp8": 8}), model("b", {"bf16": 12})],
        [session("s1", "a", active=True, tokens=4096), session("s2", "b", active=b_active, tokens=8192)],
        [
            held(weights("a"), "gpu", "g0", 16 * GIB),
            held(weights("a"), "nvme", "n0", 16 * GIB),
            held(weights("a", "fp8"), "nvme", "n0", 8 * GIB),
            held(weights("b"), "nvme", "n0", 12 * GIB),
        ],
    )
    plan = solve(problem, "milp", time_limit_seconds=20)
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    made = {op.engine.transition for op in plan.operations if op.engine is not None}
    assert made - {Transition.READAHEAD} == steps


def _fast(gpu_id: str, hbm_gib: float) -> dict[str, object]:
    """A card whose faster link makes it the MILP's first choice for a load."""
    return {**gpu(gpu_id, hbm_gib), "h2d_bytes_per_s": 25e9}


def _own_plan_is_sound(problem: Problem, seconds: float = 20) -> Plan:
    plan = solve(problem, "milp", time_limit_seconds=seconds)
    assert plan.extra["milp"]["plan_from"] == "milp"
    assert plan.extra["milp"]["invariant_errors"] == []
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    return plan


def _a_asleep_beside_b(*, adopted: bool, backup: bool) -> Problem:
    """a's engine fixed on g0 (27.5 GiB), asleep at level 1 where its backup is in host RAM (`backup`), b (24 GiB)
    and its two active sessions' KV (1 GiB each) in host RAM; g1 (4 GiB) holds no shard of b."""
    engines = [{"model": "a", "gpus": ["g0"], **VLLM, **({"management": "adopted"} if adopted else {})}]
    return problem_of(
        [{**node("n0", _fast("g0", 27.5), gpu("g1", 4)), "engines": [*engines, {"model": "b", **VLLM}]}],
        [model("a", {"bf16": 16}), model("b", {"bf16": 24})],
        [session("s1", "b", active=True), session("s2", "b", active=True)],
        [
            *([held(weights("a"), "host", "n0", 16 * GIB)] if backup else []),
            held(weights("a"), "nvme", "n0", 16 * GIB),
            held(weights("b"), "nvme", "n0", 24 * GIB),
            held(kv("b", "s1"), "host", "n0", GIB),
            held(kv("b", "s2"), "host", "n0", GIB),
        ],
    )


def test_milp_counts_the_context_a_sleeping_adopted_engine_keeps() -> None:
    """(C10) a's adopted engine sleeps on g0 and keeps its 1 GiB CUDA context there; b, its engine's own
    context (C13) and its two active sessions' KV would fill 27 GiB: beside a's context only one session fits.
    Without the row the MILP serves both and the checker refuses the plan."""
    problem = _a_asleep_beside_b(adopted=True, backup=True)
    assert confirmed_states(problem)[("n0", "a")].state is EngineState.ASLEEP_HOST
    plan = _own_plan_is_sound(problem)
    assert len(plan.unserved) == 1


def test_milp_counts_the_context_of_an_engine_asleep_at_a_precision_no_copy_names() -> None:
    """As above with a's adopted engine reported asleep at level 2 and no copy of a's weights off NVMe, so its
    precision is unknown: its context on g0 is counted all the same (the MILP's own plan over capacity by it,
    found by the property test with sleepers, tests/property/test_milp_engine_plans.py)."""
    problem = _a_asleep_beside_b(adopted=True, backup=False)
    problem = dataclasses.replace(problem, observed_engines={("n0", "a"): (EngineState.ASLEEP_DISCARDED, ("g0",))})
    view = confirmed_states(problem)[("n0", "a")]
    assert (view.state, view.precision) == (EngineState.ASLEEP_DISCARDED, None)
    plan = _own_plan_is_sound(problem)
    assert len(plan.unserved) == 1


@pytest.mark.parametrize("solver", ["greedy", "milp"])
@pytest.mark.parametrize("asleep", [EngineState.ASLEEP_HOST, EngineState.ASLEEP_DISCARDED])
def test_a_managed_sleeping_engine_keeps_its_context_until_woken(solver: str, asleep: EngineState) -> None:
    """As above with a's engine managed and reported asleep (a heartbeat), at level 1 (its host backup in the
    placement) or level 2. Its stop would ride on a move that frees nothing on g0 (the backup's drop, or none),
    so no move filling g0 would wait for it: its 1 GiB context stays there until a plan wakes it, and both
    solvers leave it that room. Before, both served the two sessions and the start of b beside the context ran
    out of memory (the checker refuses that plan)."""
    problem = _a_asleep_beside_b(adopted=False, backup=asleep is EngineState.ASLEEP_HOST)
    problem = dataclasses.replace(problem, observed_engines={("n0", "a"): (asleep, ("g0",))})
    assert confirmed_states(problem)[("n0", "a")].state is asleep
    plan = solve(problem, solver, time_limit_seconds=20)
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    assert len(plan.unserved) == 1


def test_milp_keeps_a_running_engines_kv_pool_its_own() -> None:
    """(C11, C12) a's engine runs on g0 (40 GiB) with 16 GiB of KV in its pool (s1 active, s2 idle): the pool
    stays while the engine runs, so b (20 GiB + 1 GiB of KV) goes to g1 (22 GiB), not beside a on the faster
    g0, where dropping s2's KV would have made room and the engine would have kept it."""
    engines = [{"model": "a", "gpus": ["g0"], **VLLM}, {"model": "b", **VLLM}]
    problem = problem_of(
        [{**node("n0", _fast("g0", 40), gpu("g1", 22)), "engines": engines}],
        [model("a", {"bf16": 16}), model("b", {"bf16": 20})],
        [session("s1", "a", active=True), session("s2", "a", tokens=15 * 8192), session("s3", "b", active=True)],
        [
            held(weights("a"), "gpu", "g0", 16 * GIB),
            held(weights("a"), "nvme", "n0", 16 * GIB),
            held(kv("a", "s1"), "gpu", "g0", GIB),
            held(kv("a", "s2"), "gpu", "g0", 15 * GIB),
            held(weights("b"), "nvme", "n0", 20 * GIB),
        ],
    )
    plan = _own_plan_is_sound(problem)
    assert plan.placement[(StateObject.weights("b", "bf16"), Location.gpu("g1"))] == 20 * GIB
    assert plan.placement[(StateObject.kv("a", "s2"), Location.gpu("g0"))] == 15 * GIB


def test_milp_does_not_restart_an_adopted_engine() -> None:
    """The restart case of the first test with a's engine adopted: only sleep and wake are offered, so a stays
    at bf16 on g0 (its active session keeps it awake) and b's request waits."""
    engines = [
        {"model": "a", "gpus": ["g0"], **VLLM, "management": "adopted"},
        {"model": "b", "gpus": ["g0"], **VLLM},
    ]
    problem = problem_of(
        [{**node("n0", gpu("g0", 26)), "engines": engines}],
        [model("a", {"bf16": 16, "fp8": 8}), model("b", {"bf16": 12})],
        [session("s1", "a", active=True, tokens=4096), session("s2", "b", active=True, tokens=8192)],
        [
            held(weights("a"), "gpu", "g0", 16 * GIB),
            held(weights("a"), "nvme", "n0", 16 * GIB),
            held(weights("a", "fp8"), "nvme", "n0", 8 * GIB),
            held(weights("b"), "nvme", "n0", 12 * GIB),
        ],
    )
    plan = _own_plan_is_sound(problem)
    made = {op.engine.transition for op in plan.operations if op.engine is not None and op.object.model == "a"}
    assert made <= {Transition.READAHEAD}
    assert plan.placement[(StateObject.weights("a", "bf16"), Location.gpu("g0"))] == 16 * GIB
    assert set(plan.unserved) == {"s2"}


def test_milp_keeps_a_running_engines_expert_share() -> None:
    """(C5', C11) the MoE's engine runs on g0 with 2 of its 16 expert chunks (8 GiB) on GPU, a launch
    setting: the model keeps them (a free choice would take more, `test_milp.py`'s breakpoint case), so its
    value is the evaluator's value of the plan the engines reach."""
    moe = model(
        "moe", {"bf16": 8}, experts_bytes=64 * GIB, expert_bytes=GIB // 4, active_expert_bytes_per_token=2 * GIB
    )
    problem = problem_of(
        [{**node("n0", gpu("g0", 48)), "engines": [{"model": "moe", **VLLM}]}],
        [moe],
        [session("s1", "moe", active=True)],
        [
            held(weights("moe"), "gpu", "g0", 8 * GIB),
            held(weights("moe"), "nvme", "n0", 8 * GIB),
            held(experts("moe"), "gpu", "g0", 8 * GIB),
            held(experts("moe"), "nvme", "n0", 64 * GIB),
            held(kv("moe", "s1"), "gpu", "g0", GIB),
        ],
    )
    plan = _own_plan_is_sound(problem)
    assert plan.placement[(StateObject.experts("moe"), Location.gpu("g0"))] == 8 * GIB
    details = plan.extra["milp"]
    assert details["model_objective"] == pytest.approx(details["milp_plan_objective"], rel=1e-6)


def two_running_engines_and_a_start() -> Problem:
    """a and c (8 GiB each, 1 GiB pools holding their active sessions' KV) run on n0's g0 (29.5 GiB, the
    faster card); b (8 GiB) has an active session and starts; n1's g1 (12 GiB) is free."""
    engines = [{"model": m, **VLLM} for m in ("a", "b", "c")]
    small = {"max_context_tokens": 8192}  # the minimum pool: one 8,192-token request, 1 GiB
    return problem_of(
        [{**node("n0", _fast("g0", 29.5)), "engines": engines}, {**node("n1", gpu("g1", 12)), "engines": engines}],
        [model(m, {"bf16": 8}, **small) for m in ("a", "b", "c")],
        [session(f"s{m}", m, active=True) for m in ("a", "b", "c")],
        [
            held(weights("a"), "gpu", "g0", 8 * GIB),
            held(kv("a", "sa"), "gpu", "g0", GIB),
            held(weights("c"), "gpu", "g0", 8 * GIB),
            held(kv("c", "sc"), "gpu", "g0", GIB),
            *(held(weights(m), "nvme", n, 8 * GIB) for m in ("a", "b", "c") for n in ("n0", "n1")),
        ],
    )


@pytest.mark.parametrize("solver", ["greedy", "milp"])
def test_a_start_leaves_room_for_the_running_engines_contexts(solver: str) -> None:
    """(C13) a and c (8 GiB each) run on n0's g0 (29.5 GiB, the faster card) with 1 GiB pools, their active
    sessions' KV in them; b (8 GiB, a 1 GiB pool for its new session's KV) starts. Shards and pools come to
    27 GiB: b fits beside a and c by them, but each engine holds its 1 GiB CUDA context on g0 too, and three
    (30 GiB) do not fit where two (28 GiB) do. Counted without the contexts, b started on g0 and would have
    run out of memory; now it starts on n1's g1, and a and c keep running on g0."""
    problem = two_running_engines_and_a_start()
    states = confirmed_states(problem)
    assert {m for (_, m), v in states.items() if v.state is EngineState.RUNNING} == {"a", "c"}
    assert launched_pools(problem, states) == {("n0", "a"): GIB, ("n0", "c"): GIB}
    plan = solve(problem, solver, time_limit_seconds=20)
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    assert plan.unserved == {}
    on = {(obj.model, loc.id) for (obj, loc), n in plan.placement.items() if obj.kind.value == "weights" and n
          and loc.tier.value == "gpu"}  # fmt: skip
    assert on == {("a", "g0"), ("c", "g0"), ("b", "g1")}
    starts = {op.engine.instance.model for op in plan.operations if op.engine is not None and
              op.engine.transition is Transition.START}  # fmt: skip
    assert starts == {"b"}


def test_the_checker_refuses_a_start_beside_running_engines_without_room_for_its_context() -> None:
    """The plan above with b started on g0 instead: shards, pools and KV fit the card, the three contexts do
    not, and the checker says so."""
    problem = two_running_engines_and_a_start()
    plan = solve(problem, "greedy")
    g0, g1 = Location.gpu("g0"), Location.gpu("g1")
    moved = {(obj, loc): n for (obj, loc), n in plan.placement.items() if loc != g1}
    b_on_g1 = {obj: n for (obj, loc), n in plan.placement.items() if loc == g1}
    assert set(b_on_g1) == {StateObject.weights("b", "bf16"), StateObject.kv("b", "sb")}
    moved |= {(obj, g0): n for obj, n in b_on_g1.items()}
    made = make_plan(problem, "greedy", moved, {})
    errors = check_plan(problem, made.placement, made.operations, made.unserved)
    context = ENGINE_CONSTANTS.context_bytes_per_gpu
    assert f"capacity: gpu:g0 holds {27 * GIB} bytes and {3 * context} of engine pools and engines' CUDA contexts" in {
        e.split(" > ")[0] for e in errors
    }


def asleep_moe(gpu_expert_fraction: float) -> Problem:
    """m's engine sleeps at level 1 on g0 (24 GiB; its host backup in the placement, none of its 16 GiB of
    experts on GPU), launched with `gpu_expert_fraction` of them on GPU (a heartbeat reports both); one of its
    sessions is in flight."""
    engines = [{"model": "m", "gpus": ["g0"], **VLLM}]
    moe = model("m", {"bf16": 4}, experts_bytes=16 * GIB, expert_bytes=GIB // 4, active_expert_bytes_per_token=GIB // 8)
    problem = problem_of(
        [{**node("n0", gpu("g0", 24)), "engines": engines}],
        [moe],
        [session("s1", "m", active=True)],
        [
            held(weights("m"), "host", "n0", 4 * GIB),
            held(weights("m"), "nvme", "n0", 4 * GIB),
            held(experts("m"), "nvme", "n0", 16 * GIB),
        ],
    )
    return dataclasses.replace(
        problem,
        observed_engines={("n0", "m"): (EngineState.ASLEEP_HOST, ("g0",))},
        asleep_expert_fractions={("n0", "m"): gpu_expert_fraction},
    )


def test_a_woken_moe_engine_brings_back_the_expert_share_it_was_launched_with() -> None:
    """A quarter of m's experts: its wake maps that share back (vllm/device_allocator/cumem.py
    `CuMemAllocator.wake_up`): the greedy's plan that wakes it for the active session puts the 4 GiB of
    experts on g0 with the weights, carried by the wake, and the checker passes it. Before, the plan woke it
    with no experts on GPU and the SRV left out the 4 GiB the engine held."""
    problem = asleep_moe(0.25)
    plan = solve(problem, "greedy")
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    assert plan.placement[(StateObject.experts("m"), Location.gpu("g0"))] == 4 * GIB
    (move,) = [op for op in plan.operations if op.object == StateObject.experts("m")]
    assert move.engine is not None and move.engine.transition is Transition.WAKE


@pytest.mark.parametrize("gpu_expert_fraction", [0.25, 0.5])
def test_milp_wakes_a_moe_engine_with_the_expert_share_it_was_launched_with(gpu_expert_fraction: float) -> None:
    """(C5w) The MILP's wake of m's engine brings back its launched share, no other: its own plan puts that
    share on g0, carried by the wake. Choosing the fraction freely, it put all 16 GiB there (they fit, and
    decode is fastest with every expert on GPU), a share the woken engine does not hold."""
    problem = asleep_moe(gpu_expert_fraction)
    plan = _own_plan_is_sound(problem)
    assert plan.placement[(StateObject.experts("m"), Location.gpu("g0"))] == int(gpu_expert_fraction * 16 * GIB)
    (move,) = [op for op in plan.operations if op.object == StateObject.experts("m")]
    assert move.engine is not None and move.engine.transition is Transition.WAKE
    details = plan.extra["milp"]
    # exact but for the prefill both the KV and the experts on GPU spare, priced to within PREFILL_STEP / 2
    assert details["model_objective"] == pytest.approx(details["milp_plan_objective"], abs=PREFILL_STEP / 2)


def test_the_checker_refuses_a_wake_with_another_expert_share() -> None:
    """The greedy's wake of m with half its experts on g0 instead of the quarter it was launched with: the
    wake maps back the quarter, and the checker says so (the MILP's free choice of the share passed it)."""
    problem = asleep_moe(0.25)
    plan = solve(problem, "greedy")
    on_g0 = (StateObject.experts("m"), Location.gpu("g0"))
    made = make_plan(problem, "greedy", {**plan.placement, on_g0: 8 * GIB}, {})
    assert made.placement[on_g0] == 8 * GIB
    errors = check_plan(problem, made.placement, made.operations, made.unserved)
    assert (
        f"engine: m's engine on n0 is woken with {8 * GIB} bytes of its routed experts on GPU, not the {4 * GIB} it "
        "was launched with: a wake maps back what its sleep offloaded"
    ) in errors


def test_the_greedy_wakes_a_moe_engine_only_where_its_launched_share_fits() -> None:
    """m's engine sleeps on four 43 GiB cards launched with 3/16 of its 608 GiB of experts on GPU (28.5 GiB a
    card) and a 4.8 GiB pool; v's engine runs on the same cards (3.9 GiB shards, a 1.4 GiB pool, its context).
    Both have a request in flight. m's weights and KV fit beside v, its wake does not: 4 + 28.5 + 4.8 GiB a
    card beside the 7.3 v and the two contexts take. The greedy chose m's group by its weights and KV and woke
    it there (the demo cluster on fake engines: the wake refused for CUDA out of memory, 1.6 GiB a card over);
    it now leaves m's requests waiting rather than plan what the cards cannot hold."""
    cards = [f"g{i}" for i in range(4)]
    engines = [{"model": "m", "gpus": cards, **VLLM}, {"model": "v", "gpus": cards, **VLLM}]
    moe = model(
        "m", {"fp8": 16}, experts_bytes=608 * GIB, expert_bytes=GIB // 16, active_expert_bytes_per_token=19 * GIB
    )
    problem = problem_of(
        [{**node("n0", *(gpu(g, 43) for g in cards), host_gib=1024), "engines": engines}],
        [moe, model("v", {"bf16": 15.5})],
        [session("s1", "m", active=True, tokens=32_768), session("sv", "v", active=True, tokens=4096)],
        [
            *(held(weights("v"), "gpu", g, 3.875 * GIB) for g in cards),
            held(weights("v"), "nvme", "n0", 15.5 * GIB),
            held(weights("m", "fp8"), "host", "n0", 16 * GIB),
            held(weights("m", "fp8"), "nvme", "n0", 16 * GIB),
            held(experts("m"), "nvme", "n0", 608 * GIB),
        ],
    )
    problem = dataclasses.replace(
        problem,
        engine_pools={("n0", "m"): int(4.8 * GIB), ("n0", "v"): int(1.4 * GIB)},
        observed_engines={("n0", "m"): (EngineState.ASLEEP_HOST, tuple(cards))},
        asleep_expert_fractions={("n0", "m"): 0.1875},
    )
    plan = solve(problem, "greedy")
    assert check_plan(problem, plan.placement, plan.operations, plan.unserved) == []
    assert "s1" in plan.unserved and "sv" not in plan.unserved
