"""The joint node assignment: on its own estimates, and in the greedy where serving in turn takes the wrong node."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_clusters import experts, gpu, held, kv, model, node, on_host, on_nvme, plan_for, scenario, session, weights

from planner_service.domain.state import StateObject, Tier
from planner_service.domain.units import GIB
from planner_service.planner.greedy import plan_greedy
from planner_service.planner.joint import NOWHERE, Option, _Search, assign
from planner_service.planner.objective import evaluate


def _no_moe(node: str, moes: list) -> tuple[list[int], list[float]]:
    raise AssertionError("no option here is a MoE")


def test_a_swap_undoes_the_first_model_taking_the_node_the_second_needs() -> None:
    # rooms 10 and 10. In turn: a takes n0 (cost 1 < 2); b (8) no longer fits beside a's 6 there, so n1 (5):
    # 1 + 5 = 6. Swapping their nodes: a on n1 (2), b on n0 (0): 2.
    options = {
        "a": [Option("n0", "bf16", 6, 1.0, None), Option("n1", "bf16", 6, 2.0, None)],
        "b": [Option("n0", "bf16", 8, 0.0, None), Option("n1", "bf16", 8, 5.0, None)],
    }
    chosen = assign(options, ["a", "b"], {"n0": 10, "n1": 10}, _no_moe)
    assert {m: o.node for m, o in chosen.items()} == {"a": "n1", "b": "n0"}


def test_a_model_moves_to_a_smaller_precision_where_that_frees_a_node() -> None:
    # room 10 on one node. In turn: a at bf16 (8, cost 1) leaves no room for b (4): b infinite. a at fp8 (4,
    # cost 2) beside b (4, cost 0) fits: 2.
    options = {
        "a": [Option("n0", "bf16", 8, 1.0, None), Option("n0", "fp8", 4, 2.0, None)],
        "b": [Option("n0", "bf16", 4, 0.0, None)],
    }
    chosen = assign(options, ["a", "b"], {"n0": 10}, _no_moe)
    assert {m: o.precision for m, o in chosen.items()} == {"a": "fp8", "b": "bf16"}


def test_a_large_idle_model_takes_a_node_cleared_of_a_small_one() -> None:
    # rooms 10 and 10. a (4) and b (4) each take their cheapest node, so x (8, kept warm saves 3) fits on
    # neither and stays off the GPUs: 0. No single move or swap helps (a beside b costs 0.5 before x can
    # move). Clearing n0 for x and placing a again (beside b on n1): -3 + 0.5 = -2.5; stepping out of the
    # local optimum reaches it too, without the clearing move: a to n1 (+0.5), then x onto n0 (-3).
    options = {
        "a": [Option("n0", "bf16", 4, 0.0, None), Option("n1", "bf16", 4, 0.5, None)],
        "b": [Option("n1", "bf16", 4, 0.0, None), Option("n0", "bf16", 4, 0.5, None)],
        "x": [
            Option(NOWHERE, "", 0, 0.0, None),
            Option("n0", "bf16", 8, -3.0, None),
            Option("n1", "bf16", 8, -3.0, None),
        ],
    }
    rooms = {"n0": 10, "n1": 10}
    for evicting in ([], ["x"]):
        chosen = assign(options, ["a", "b", "x"], rooms, _no_moe, evicting)
        assert {m: o.node for m, o in chosen.items()} == {"a": "n1", "b": "n1", "x": "n0"}


def test_stepping_out_of_a_local_optimum_takes_a_costly_move_first() -> None:
    # rooms 10, 10 and 6. a (4) takes n0 (0), b (6) n1 (0); x (7, kept warm on n0 saves 3) fits beside
    # neither and stays off the GPUs: 0. No move or swap lowers that (a to n2 costs 1; x fits nowhere; a
    # and b have no option on each other's node). Stepping out: a to n2 (+1), then x onto the n0 it left
    # (-3): -2.
    options = {
        "a": [Option("n0", "bf16", 4, 0.0, None), Option("n2", "bf16", 4, 1.0, None)],
        "b": [Option("n1", "bf16", 6, 0.0, None)],
        "x": [Option(NOWHERE, "", 0, 0.0, None), Option("n0", "bf16", 7, -3.0, None)],
    }
    chosen = assign(options, ["a", "b", "x"], {"n0": 10, "n1": 10, "n2": 6}, _no_moe)
    assert {m: o.node for m, o in chosen.items()} == {"a": "n2", "b": "n1", "x": "n0"}


def _two_moes() -> dict:
    """deep (16 GiB dense, 128 GiB of experts in 8 GiB chunks) and air (8 GiB, 28 GiB of experts in 1.75 GiB
    chunks), 1 GiB of routed experts read per token; one card per node: n0 40 GiB, n1 32 GiB."""
    caps = ["partial_experts", "kv_offload", "weights_offload"]
    deep = model("deep", 16, experts_bytes=128 * GIB, expert_bytes=GIB // 4, active_expert_bytes_per_token=GIB)
    air = model("air", 8, experts_bytes=28 * GIB, expert_bytes=GIB // 4, active_expert_bytes_per_token=GIB)
    sizes = {"deep": (16, 128), "air": (8, 28)}
    return scenario(
        [node("n0", gpu("g0", 40), capabilities=caps), node("n1", gpu("g1", 32), capabilities=caps)],
        [deep, air],
        [
            session("s1", "deep", active=True, tokens=0),
            session("s2", "air", active=True, tokens=0),
            session("s3", "air", user="v", active=True, tokens=0),
        ],
        [held(weights(m), on_nvme(n), w * GIB) for m, (w, _) in sizes.items() for n in ("n0", "n1")]
        + [held(experts(m), on_nvme(n), e * GIB) for m, (_, e) in sizes.items() for n in ("n0", "n1")],
    )


def test_the_moe_whose_experts_then_fit_gets_the_roomier_node() -> None:
    # Hit rate of the hottest fraction f of experts: f ** 0.5. In turn, deep (the larger) goes first and takes
    # n0: 24 GiB of its experts (hit 0.43) against 16 GiB on n1 (hit 0.35), 0.08 fewer misses; air on n1 then
    # holds 22.75 of its 28 GiB (hit 0.90). Together, air on n0 holds all of its experts (0.10 fewer misses)
    # and air decodes for twice the requests (two sessions to deep's one): air on n0, deep on n1.
    problem, plan = plan_for(_two_moes())
    chosen = plan_greedy(problem)
    assert {m: g.node for m, g in chosen.groups.items()} == {"deep": "n1", "air": "n0"}
    assert plan.objective.total == evaluate(problem, chosen.placement, chosen.now, demand=chosen.demand)[0].total
    in_turn = plan_greedy(problem, {"deep": "n0", "air": "n1"})
    in_turn_total = evaluate(problem, in_turn.placement, in_turn.now, demand=in_turn.demand)[0].total
    assert plan.objective.total < in_turn_total - 4.0  # 56.2 against 60.8: air's decode slowdown
    air_experts = StateObject.experts("air")
    assert sum(b for (o, loc), b in plan.placement.items() if o == air_experts and loc.tier is Tier.GPU) == 28 * GIB


@st.composite
def _local_optima(draw: st.DrawFn) -> tuple[_Search, list[str]]:
    """A search at a local optimum of improving moves and swaps: 2-4 nodes, 2-5 dense models with 1-4 options
    at whole-second costs (exact sums), some of them idle (an option to stay off the GPUs)."""
    nodes = [f"n{i}" for i in range(draw(st.integers(2, 4)))]
    options: dict[str, list[Option]] = {}
    for k in range(draw(st.integers(2, 5))):
        idle = draw(st.booleans())
        where = st.tuples(st.sampled_from(nodes), st.sampled_from(["bf16", "fp8"]))
        placed = draw(st.lists(where, min_size=1, max_size=4, unique=True))
        options[f"m{k}"] = [Option(NOWHERE, "", 0, 0.0, None)] * idle + [
            Option(n, p, draw(st.integers(1, 6)), float(draw(st.integers(-3, 5))), None) for n, p in placed
        ]
    rooms = {n: draw(st.integers(4, 12)) for n in nodes}
    search = _Search(options, list(options), {**rooms, NOWHERE: 0}, _no_moe)
    for m in options:
        search.place_cheapest(m)
    while search.improve():
        pass
    movers = [m for m, opts in options.items() if all(o.node != NOWHERE for o in opts)]
    return search, movers


def _best_pair_total(search: _Search, movers: list[str]) -> float:
    """Brute force: the least total over every move of a mover to another node where it fits, alone or
    followed by any one move or swap of any models (the step out prices only those touching the two nodes the
    move changed: no other can improve at a local optimum)."""
    start = (search.chosen, search.held)
    node = {bit: option.node for bit, option in search.option_of.items()}

    def total_after(moves: list[tuple[str, int]]) -> float:
        search.chosen, search.held = dict(start[0]), dict(start[1])
        for m, bit in moves:
            search._take(m)
            search._put(m, bit)
        return search._total()

    best = math.inf
    for m in movers:
        for bit in search.bits[m]:
            if node[bit] == node[start[0][m]] or math.isinf(search.cost.of(start[1].get(node[bit], 0) | bit)):
                continue  # (as in the step out: a move that does not fit there is no way out)
            best = min(best, total_after([(m, bit)]))
            after = dict(search.chosen)
            for x in after:
                for y in search.bits[x]:
                    best = min(best, total_after([(m, bit), (x, y)]))
            for x, z in itertools.combinations(after, 2):
                if node[after[x]] == node[after[z]]:
                    continue
                for y in search.bits[x]:
                    for w in search.bits[z]:
                        if node[y] == node[after[z]] and node[w] == node[after[x]]:
                            best = min(best, total_after([(m, bit), (x, y), (z, w)]))
    search.chosen, search.held = start
    return best


@settings(max_examples=300, deadline=None)
@given(_local_optima())
def test_the_step_out_finds_the_best_move_and_follow_up(case: tuple[_Search, list[str]]) -> None:
    search, movers = case
    start = search._total()
    best = _best_pair_total(search, movers)
    search.step_out(movers)
    if best < start and not math.isinf(start):
        assert search._total() <= best
    else:
        assert search._total() == start


def test_two_nodes_of_one_room_trade_all_their_models() -> None:
    # rooms 100 and 100. In turn: b (50) and c (50) take n1 (0 each); a (60) fits only on n0 (3): 3. No move
    # fits (b beside a: 110; a beside b and c: 160), no swap (a beside c: 110), nor a step out's first move.
    # Trading the nodes' models: a on n1 (0), b and c on n0 (1 each): 2. With n1's room 101 no trade is tried.
    options = {
        "b": [Option("n1", "bf16", 50, 0.0, None), Option("n0", "bf16", 50, 1.0, None)],
        "c": [Option("n1", "bf16", 50, 0.0, None), Option("n0", "bf16", 50, 1.0, None)],
        "a": [Option("n0", "bf16", 60, 3.0, None), Option("n1", "bf16", 60, 0.0, None)],
    }
    for rooms, after in (({"n0": 100, "n1": 100}, {"a": "n1", "b": "n0", "c": "n0"}), ({"n0": 100, "n1": 101}, None)):
        search = _Search(options, ["b", "c", "a"], {**rooms, NOWHERE: 0}, _no_moe)
        for m in ["b", "c", "a"]:
            search.place_cheapest(m)
        assert search._total() == 3.0
        traded = search.improve()
        assert traded == (after is not None)
        if traded:
            assert {m: search.option_of[b].node for m, b in search.chosen.items()} == after
    # the branch and bound after the local search reaches the trade on unlike nodes too
    chosen = assign(options, ["b", "c", "a"], {"n0": 100, "n1": 101}, _no_moe)
    assert {m: o.node for m, o in chosen.items()} == {"a": "n1", "b": "n0", "c": "n0"}


def test_the_branch_and_bound_finds_a_rotation_of_three_models() -> None:
    # rooms 10, 10 and 10; a (10), b (10) and c (10) fill a node each. From a on n0 (0), b on n1 (0) and c on
    # n2 (5): 5, each model is cheaper on the next node (a on n1, b on n2, c on n0: -1 each), but no move fits
    # (every node is full) and every swap or trade costs more (a and b trading: b on n0 costs 9). Only the
    # rotation gets -3.
    options = {
        "a": [
            Option("n0", "bf16", 10, 0.0, None),
            Option("n1", "bf16", 10, -1.0, None),
            Option("n2", "bf16", 10, 9.0, None),
        ],
        "b": [
            Option("n1", "bf16", 10, 0.0, None),
            Option("n2", "bf16", 10, -1.0, None),
            Option("n0", "bf16", 10, 9.0, None),
        ],
        "c": [
            Option("n2", "bf16", 10, 5.0, None),
            Option("n0", "bf16", 10, -1.0, None),
            Option("n1", "bf16", 10, 9.0, None),
        ],
    }
    search = _Search(options, ["a", "b", "c"], {"n0": 10, "n1": 10, "n2": 10, NOWHERE: 0}, _no_moe)
    for m in options:
        search._put(m, search.bits[m][0])
    assert search._total() == 5.0 and not search.improve()
    search.branch_and_bound(0)  # no step: nothing changes
    assert search._total() == 5.0
    search.branch_and_bound(100)
    assert search._total() == -3.0
    assert {m: search.option_of[b].node for m, b in search.chosen.items()} == {"a": "n1", "b": "n2", "c": "n0"}


@settings(max_examples=300, deadline=None)
@given(_local_optima(), st.integers(0, 40))
def test_the_branch_and_bound_finds_the_least_sum_and_never_a_worse_one(
    case: tuple[_Search, list[str]], steps: int
) -> None:
    search, _ = case
    start = search._total()
    models = list(search.chosen)
    least = math.inf  # brute force over every assignment
    for bits in itertools.product(*(search.bits[m] for m in models)):
        held: dict[str, int] = {}
        for bit in bits:
            held[search.option_of[bit].node] = held.get(search.option_of[bit].node, 0) | bit
        least = min(least, sum(map(search.cost.of, held.values())))
    search.branch_and_bound(steps)
    assert least <= search._total() <= start
    search.branch_and_bound(10**6)
    assert search._total() == least or (math.isinf(start) and search._total() == start)


def test_look_alike_nodes_each_price_the_kv_they_hold() -> None:
    # n0 and n1 alike (one 40 GiB card each, weights on both NVMe drives); a (16 GiB) and b (8 GiB) each have
    # two sessions in flight of 8,192 tokens (1 GiB of KV each). a's sessions' KV sits in n1's host DRAM:
    # restoring it there takes 1 GiB / 20 GB/s = 0.05 s a session, re-prefilling it anywhere else about 1.3 s
    # (2 * 8.6e9 parameters * 8,192 tokens / 100 TFLOP/s). Priced once for both nodes (n0 first by id), a's
    # options would tie and a would take n0; each node priced with the KV it holds, a takes n1.
    caps = ["kv_offload", "weights_offload"]
    data = scenario(
        [node("n0", gpu("g0", 40), capabilities=caps), node("n1", gpu("g1", 40), capabilities=caps)],
        [model("a", 16), model("b", 8)],
        [
            session("s1", "a", active=True),
            session("s2", "a", active=True),
            session("s3", "b", active=True),
            session("s4", "b", active=True),
        ],
        [held(weights(m), on_nvme(n), w * GIB) for m, w in (("a", 16), ("b", 8)) for n in ("n0", "n1")]
        + [held(kv("a", s), on_host("n1"), GIB) for s in ("s1", "s2")],
    )
    problem, plan = plan_for(data)
    chosen = plan_greedy(problem)
    assert chosen.groups["a"].node == "n1"
    elsewhere = plan_greedy(problem, {"a": "n0"})
    assert (
        plan.objective.total
        < evaluate(problem, elsewhere.placement, elsewhere.now, demand=elsewhere.demand)[0].total - 1.0
    )


def test_a_model_beside_an_engine_moe_takes_room_from_its_group_s_cards() -> None:
    # n0 and n1, room 100 each, four cards. The MoE's engine holds its experts in equal shares on two of n0's
    # cards (`expert_room` 20, half the cards: `expert_cards` 0.5); each 10 bytes of experts save 2 s. A
    # dense model of 20 bytes costs 0 on n0, 1 on n1. Spread over n0's four cards it takes 10 of its bytes
    # from the MoE's two: 10 fewer expert bytes, 2 s, more than n1's 1 s. Priced by the node's room alone
    # (100 - 30 = 70 > 20), n0 looked free.
    moe = object()

    def curve(node: str, moes: list) -> tuple[list[int], list[float]]:
        assert moes == [moe]
        return [0, 10, 20], [5.0, 3.0, 1.0]

    options = {
        "m": [Option("n0", "bf16", 10, 0.0, moe, 20, 0.5)],  # type: ignore[arg-type]
        "d": [Option("n0", "bf16", 20, 0.0, None), Option("n1", "bf16", 20, 1.0, None)],
    }
    chosen = assign(options, ["m", "d"], {"n0": 100, "n1": 100}, curve)
    assert chosen["d"].node == "n1"
    # on a MoE's group of all four cards the other bytes come off its room whole: the node's room binds
    whole = {**options, "m": [Option("n0", "bf16", 10, 0.0, moe, 90, 1.0)]}  # type: ignore[arg-type]
    assert assign(whole, ["m", "d"], {"n0": 100, "n1": 100}, curve)["d"].node == "n0"


def test_a_large_model_does_not_fit_beside_a_running_engine_filling_one_card() -> None:
    # n0: four cards of 10 and 40 in all; a's running engine cannot leave card 0 and fills 9 of it. b (28)
    # fits the node's room (31 left) but no even split over its roomiest 1, 2 or 4 cards (10, 2 x 10, 4 x 1):
    # it goes to n1 (cost 1) instead of n0 (cost 0). c (18) fits two of n0's free cards: it stays on n0.
    options = {
        "a": [Option("n0", "bf16", 9, 0.0, None, fixed=(0,))],
        "b": [Option("n0", "bf16", 28, 0.0, None), Option("n1", "bf16", 28, 1.0, None)],
    }
    rooms, cards = {"n0": 40, "n1": 40}, {"n0": [10, 10, 10, 10], "n1": [10, 10, 10, 10]}
    assert assign(options, ["a", "b"], rooms, _no_moe, cards=cards)["b"].node == "n1"
    assert assign(options, ["a", "b"], rooms, _no_moe)["b"].node == "n0"  # priced by the node's room alone
    smaller = {**options, "b": [Option("n0", "bf16", 18, 0.0, None), Option("n1", "bf16", 18, 1.0, None)]}
    assert assign(smaller, ["a", "b"], rooms, _no_moe, cards=cards)["b"].node == "n0"


def test_models_beside_a_narrow_stay_must_fit_its_free_cards_together() -> None:
    # n0: four cards of 43; a stays on card 0 with 34 (9 left there). b (87) fits the three free cards alone
    # (3 x 29), and so does c (44: 3 x 14.7), but not both: beside b a free card has 14 left, and c's four-card
    # split (11) does not fit card 0. One of them goes to n1 (cost 1) rather than both to n0 (cost 0).
    def on(node: str, need: int, cost: float) -> Option:
        return Option(node, "bf16", need, cost, None, width=4, widths=(1, 2, 3, 4))

    options = {
        "a": [Option("n0", "bf16", 34, 0.0, None, fixed=(0,))],
        "b": [on("n0", 87, 0.0), on("n1", 87, 1.0)],
        "c": [on("n0", 44, 0.0), on("n1", 44, 1.0)],
    }
    rooms, cards = {"n0": 172, "n1": 172}, {"n0": [43] * 4, "n1": [43] * 4}
    chosen = assign(options, ["a", "b", "c"], rooms, _no_moe, cards=cards)
    assert {chosen["b"].node, chosen["c"].node} == {"n0", "n1"}
    assert assign({m: options[m] for m in ("a", "b")}, ["a", "b"], rooms, _no_moe, cards=cards)["b"].node == "n0"
