"""The online rules the service and the replayed `statebudget` policy share: stand-ins, pins, adoption."""

from __future__ import annotations

from tiny_clusters import gpu, held, model, node, on_gpu, on_nvme, scenario, session, weights

from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.scenario import parse_scenario
from planner_service.domain.state import Location, StateObject
from planner_service.domain.units import GIB
from planner_service.planner.greedy import plan_greedy
from planner_service.planner.online import (
    MAX_DEMAND_WINDOW_SECONDS,
    Engine,
    RecentLoad,
    apportion,
    engines_in,
    for_real,
    pins,
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
