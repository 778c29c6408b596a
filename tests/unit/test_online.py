"""The online rules the service and the replayed `statebudget` policy share: stand-ins, pins, adoption."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest
from tiny_clusters import gpu, held, kv, model, node, on_gpu, on_host, on_nvme, scenario, session, weights

from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.problem import STAND_IN, Session
from planner_service.domain.scenario import Slo, parse_scenario
from planner_service.domain.state import Location, StateObject, Tier
from planner_service.domain.units import GIB
from planner_service.planner.greedy import plan_greedy
from planner_service.planner.objective import evaluate
from planner_service.planner.online import (
    MAX_DEMAND_WINDOW_SECONDS,
    REPLAN_SECONDS,
    Engine,
    MovePrice,
    RecentLoad,
    apportion,
    engines_in,
    for_real,
    move_price,
    pins,
    staying_beats,
    staying_put,
    without_stand_ins,
    worth_adopting,
)
from planner_service.planner.plan import make_plan
from planner_service.solver.registry import solve


def test_apportion_gives_the_largest_remainders_the_seats_left() -> None:
    assert apportion({"a": 6, "b": 2}, 4) == {"a": 3, "b": 1}
    assert apportion({"a": 1, "b": 1, "c": 1}, 2) == {"a": 1, "b": 1, "c": 0}  # ties go by key


def test_stand_ins_spread_the_seats_by_the_windows_request_share() -> None:
    load = RecentLoad(window_seconds=100.0, seats=4, min_requests=0)
    for i in range(6):
        load.add(10.0 + i, "a", 1000)
    for i in range(2):
        load.add(20.0 + i, "b", 3000)
    # a has 6 of 8 requests: 3 seats; b 2 of 8: 1 seat; each at its model's mean context
    assert sorted((s.model, s.context_tokens, s.active) for s in load.stand_ins(50.0, {})) == [
        ("a", 1000, True),
        ("a", 1000, True),
        ("a", 1000, True),
        ("b", 3000, True),
    ]
    # a request of a in flight takes one of a's seats
    assert [s.model for s in load.stand_ins(50.0, {"a": 1})].count("a") == 2
    # requests older than the window no longer count
    assert {s.model for s in load.stand_ins(118.0, {})} == {"b"}
    assert load.stand_ins(500.0, {}) == []


def test_a_quiet_window_reaches_back_for_enough_requests_but_no_further_than_a_day() -> None:
    load = RecentLoad(window_seconds=100.0, seats=4, min_requests=3)
    for t, name in [(0.0, "a"), (10.0, "a"), (20.0, "b"), (900.0, "b")]:
        load.add(t, name, 1000)
    # the last 100 s hold one request: the window reaches back for the last three (a, b, b)
    assert sorted(s.model for s in load.stand_ins(950.0, {})) == ["a", "b", "b", "b"]
    # a busy window needs no reach-back: four requests in the last 100 s, all of b
    for t in (901.0, 902.0, 903.0):
        load.add(t, "b", 1000)
    assert {s.model for s in load.stand_ins(950.0, {})} == {"b"}
    # after a day's silence nothing is left to stand in for
    assert load.stand_ins(950.0 + MAX_DEMAND_WINDOW_SECONDS, {}) == []


def test_a_model_that_served_within_the_window_keeps_its_node_until_it_is_stuck() -> None:
    engines = {"a": Engine("n2", "bf16", last_used=990.0), "b": Engine("n1", "int4", last_used=100.0)}
    assert pins(engines, set(), now=1000.0, window_seconds=300.0) == ({"a": "n2"}, {"a": "bf16"})  # b: idle too long
    assert pins(engines, {"a"}, now=1000.0, window_seconds=300.0) == ({}, {})


def two_gpus(sessions: list, on_gpus: tuple[str, ...] = ()) -> dict:
    """One node of two 24 GiB GPUs; models a and b of 10 GiB, on NVMe (and a GPU for those in `on_gpus`)."""
    residency = [held(weights(m), on_nvme("n1"), 10 * GIB) for m in ("a", "b")]
    residency += [held(weights(m), on_gpu(f"g{i}"), 10 * GIB) for i, m in enumerate(on_gpus)]
    return scenario([node("n1", gpu("g0", 24), gpu("g1", 24))], [model("a", 10), model("b", 10)], sessions, residency)


def test_a_plan_is_adopted_when_it_serves_requests_staying_put_leaves_waiting() -> None:
    problem = problem_from_scenario(parse_scenario(two_gpus([session("s1", "a", active=True)])))
    plan = solve(problem)
    assert plan.operations
    assert worth_adopting(problem, plan)
    assert worth_adopting(problem, plan, waiting_models={"a"})


def test_a_plan_whose_moves_cost_more_than_they_save_is_not_adopted() -> None:
    # b is warm on g0 and idle; a plan that also loads a costs its cold start (30 s + the copy), more than the
    # background session's 0.4 chance of a request to a saves (an interactive one's, at twice the weight, pays)
    problem = problem_from_scenario(parse_scenario(two_gpus([session("s1", "b", slo="background")], on_gpus=("b",))))
    target = {**problem.residency, (StateObject.weights("a", "bf16"), Location.gpu("g1")): 10 * GIB}
    speculative = make_plan(problem, "greedy", target, {})
    assert speculative.operations
    assert not worth_adopting(problem, speculative)
    staying = make_plan(problem, "greedy", problem.residency, {})
    assert not staying.operations and not worth_adopting(problem, staying)
    # ... but where the current plan still has operations to start, staying put means cancelling them
    assert worth_adopting(problem, staying, pending=True)
    # ... unless a request waits for a
    assert worth_adopting(problem, speculative, waiting_models={"a"})


def test_a_forced_replan_stays_put_where_its_plan_scores_worse() -> None:
    """b is warm on g0 with an active interactive session; a plan that drops b for a leaves it unserved and
    scores far worse than staying put, which a forced replan then installs instead (`staying_put`: no moves,
    the session served as it is). A plan that serves a waiting session does not lose to staying put."""
    problem = problem_from_scenario(
        parse_scenario(two_gpus([session("s1", "b", active=True, tokens=1024)], on_gpus=("b",)))
    )
    s1 = StateObject.kv("b", "s1")
    problem = dataclasses.replace(
        problem, residency={**problem.residency, (s1, Location.gpu("g0")): problem.size_of(s1)}
    )
    target = {k: n for k, n in problem.residency.items() if k[0].model != "b" or k[1].tier is not Tier.GPU}
    a_on_g0 = (StateObject.weights("a", "bf16"), Location.gpu("g0"))
    worse = make_plan(problem, "greedy", {**target, a_on_g0: 10 * GIB}, {"s1": "dropped"})
    assert worse.operations and staying_beats(problem, worse)
    stay = staying_put(problem, worse)
    assert stay.operations == [] and stay.placement == dict(problem.residency) and stay.unserved == {}
    waiting = problem_from_scenario(parse_scenario(two_gpus([session("s2", "a", active=True)])))
    serving = solve(waiting)
    assert serving.operations and not staying_beats(waiting, serving)
    assert staying_put(waiting, serving).unserved == {
        "s2": "staying put scores better than the plan that would serve it"
    }


def test_stand_in_kv_is_taken_out_of_a_placement() -> None:
    weights_a = (StateObject.weights("a", "bf16"), Location.gpu("g0"))
    real = (StateObject.kv("a", "s1"), Location.gpu("g0"))
    stand_in = (StateObject.kv("a", "expected-a-0"), Location.gpu("g0"))
    assert without_stand_ins({weights_a: 1, real: 2, stand_in: 3}) == {weights_a: 1, real: 2}


def test_an_engine_is_a_model_complete_on_the_gpus_of_one_node() -> None:
    data = two_gpus([], on_gpus=("a", "b"))
    data["cluster"]["nodes"].append(node("n2", gpu("h0", 24)))
    data["residency"].append(held(weights("b"), on_gpu("h0"), 10 * GIB))  # b complete on both nodes
    data["residency"].append(held(weights("a"), on_nvme("n2"), 10 * GIB))
    problem = problem_from_scenario(parse_scenario(data))
    assert engines_in(problem, {"a": 5.0}) == {"a": Engine("n1", "bf16", 5.0)}


def test_a_plan_for_real_drops_the_stand_ins_and_is_priced_without_them() -> None:
    data = two_gpus([session("s1", "a", active=True), session("expected-b-0", "b", active=True, tokens=20_000)])
    problem = problem_from_scenario(parse_scenario(data))
    planned = solve(problem)
    assert any(key[0].session == "expected-b-0" for key in planned.placement)
    real = for_real(problem, planned)
    ids = {op.id for op in real.operations}
    assert all(op.object.session != "expected-b-0" for op in real.operations)
    assert all(d in ids for op in real.operations for d in op.depends_on)
    assert real.placement == without_stand_ins(planned.placement)
    alone = problem_from_scenario(parse_scenario(two_gpus([session("s1", "a", active=True)])))
    assert real.objective.total == make_plan(alone, "greedy", real.placement, {}).objective.total


def test_room_kept_for_the_recent_load_never_turns_away_a_request_that_is_here() -> None:
    # one 24 GiB card holds one model at a time; `big` (the larger, warm, pinned where it runs) has only stand-ins
    # for its recent load, `small` a real request: the request is served and the stand-ins wait
    data = scenario(
        [node("n1", gpu("g0", 24))],
        [model("big", 16), model("small", 15)],
        [
            session("s0", "big"),
            *(session(f"expected-big-{k}", "big", active=True, tokens=1024) for k in range(5)),
            session("s1", "small", active=True, tokens=1024),
        ],
        [
            held(weights("big"), on_gpu("g0"), 16 * GIB),
            held(weights("big"), on_nvme("n1"), 16 * GIB),
            held(weights("small"), on_nvme("n1"), 15 * GIB),
        ],
    )
    problem = problem_from_scenario(parse_scenario(data))
    engines = engines_in(problem, {"big": 0.0})
    plan = plan_greedy(problem, *pins(engines, set(), 1.0, problem.constants.horizon_seconds))
    assert "s1" not in plan.unserved
    assert (StateObject.weights("small", "bf16"), Location.gpu("g0")) in plan.placement
    assert all(sid.startswith("expected-big-") for sid in plan.unserved)


def moving_a_for_b(rate: float = 0.01) -> tuple:
    """Two nodes of one 12 GiB GPU each; a (10 GiB) serves on n1's g0 with s1's 8,192-token KV in n1's DRAM,
    b (10 GiB) is off GPU with one session; a plan moves a to n2's g1 and brings b onto g0."""
    residency = [held(weights(m), on_nvme(n), 10 * GIB) for m in ("a", "b") for n in ("n1", "n2")]
    residency += [held(weights("a"), on_gpu("g0"), 10 * GIB), held(kv("a", "s1"), on_host("n1"), 8192 * 131072)]
    data = scenario(
        [node("n1", gpu("g0", 12)), node("n2", gpu("g1", 12))],
        [model("a", 10), model("b", 10)],
        [session("s1", "a", tokens=8192), session("t1", "b", tokens=1000)],
        residency,
    )
    problem = problem_from_scenario(parse_scenario(data))
    target = {key: n for key, n in problem.residency.items() if key[1] != Location.gpu("g0")}
    target[(StateObject.weights("a", "bf16"), Location.gpu("g1"))] = 10 * GIB
    target[(StateObject.weights("b", "bf16"), Location.gpu("g0"))] = 10 * GIB
    return problem, make_plan(problem, "greedy", target, {})


def test_a_move_across_nodes_is_priced_its_outage_stranded_kv_and_margin() -> None:
    problem, plan = moving_a_for_b()
    price = move_price(problem, plan, {"a": 0.01}, across_margin=1.0)
    # a's start on g1: 10 GiB read from n2's NVMe at 7 GB/s (slower than the 20 GB/s link) + the 30 s cold start
    start = 10 * GIB / 7e9 + 30.0
    assert price.outage == pytest.approx(0.01 * start * start / 2)  # 0.32 requests, each waiting 15.8 s
    # s1's 8,192 tokens re-prefilled on g1: 2 * 5.37 G parameters (10 GiB of bf16) / (100 TFLOP/s * 0.5)
    assert price.stranded == pytest.approx(8192 * 2 * (10 * GIB / 2) / (1e14 * 0.5))
    assert price.margin == pytest.approx(start)
    assert price.total == pytest.approx(38.26, abs=0.01)
    # b, brought onto g0, is no move: without a's arrivals and the margin, only the stranded KV is left
    assert move_price(problem, plan, {}) == MovePrice(stranded=price.stranded)


def test_the_price_of_its_moves_keeps_an_engine_that_a_plan_would_move() -> None:
    problem, plan = moving_a_for_b()
    # the plan saves 77.7 s of objective (b's next request needs no cold load) against 63.1 s of promotes (the
    # two starts of 31.5 s each): adopted on the promotes alone, kept out by the 38.3 s its move of a costs
    stay, _ = evaluate(problem, problem.residency)
    assert stay.total - plan.objective.total == pytest.approx(77.67, abs=0.01)
    assert worth_adopting(problem, plan)
    assert not worth_adopting(problem, plan, price=move_price(problem, plan, {"a": 0.01}, across_margin=1.0))


def test_stand_ins_are_priced_as_expected_requests_when_adopting() -> None:
    # a stand-in of b, off GPU: as an active session it is a request left unserved (U = 1200 s), which no
    # move's price outweighs; as an expected one it costs its cold load, and the price of a's move counts
    problem, plan = moving_a_for_b()
    stand_in = Session(f"{STAND_IN}b-0", f"{STAND_IN}b-0", Slo.INTERACTIVE, "b", True, 1000)
    sessions = {sid: s for sid, s in problem.sessions.items() if sid != "t1"} | {stand_in.id: stand_in}
    problem = dataclasses.replace(
        problem,
        sessions=MappingProxyType(sessions),
        next_model=MappingProxyType({sid: row for sid, row in problem.next_model.items() if sid != "t1"}),
    )
    room = {(StateObject.kv("b", stand_in.id), Location.gpu("g0")): 1000 * 131072}  # its KV, beside b
    plan = make_plan(problem, "greedy", {**plan.placement, **room}, {})
    price = move_price(problem, plan, {"a": 0.01}, across_margin=1.0)
    assert worth_adopting(problem, plan, price=price, stand_ins_expected=False)
    assert not worth_adopting(problem, plan, price=price)


def test_the_arrival_rate_is_the_windows_requests_over_its_span() -> None:
    load = RecentLoad(window_seconds=100.0, seats=4, min_requests=0)
    for t, name in [(0.0, "a"), (50.0, "a"), (90.0, "b")]:
        load.add(t, name, 1000)
    assert load.rates(100.0) == {"a": 2 / 100.0, "b": 1 / 100.0}
    # a window begun 5 s ago reads over the replan period, not as a flood
    fresh = RecentLoad(window_seconds=100.0, seats=4, min_requests=0)
    fresh.add(0.0, "a", 1000)
    assert fresh.rates(5.0) == {"a": 1 / REPLAN_SECONDS}
    assert RecentLoad().rates(0.0) == {}
