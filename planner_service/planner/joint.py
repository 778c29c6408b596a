"""A joint node assignment for the models with requests in flight, on estimated costs.

Serving those models one at a time lets the first take the best nodes: a
MoE whose experts gain little per GiB (DeepSeek-V3) takes a node whole that
another MoE (GLM-4.5-Air) would nearly fill with its hot experts. Here each
model has a few options (node, precision, HBM bytes, estimated cost on its
own), and a node holding some options costs their own costs plus what the
MoE models among them lose sharing its room for experts (the caller's
`experts_curve`), or infinity where their bytes exceed its room (or, where
some cannot leave cards of it, where its cards cannot hold them:
`_NodeCosts._fits_cards`). Starting
from each model taking its cheapest option beside those before it (in the
caller's order, as the greedy would), a local search takes the best move of
one model to another option, swap of two models' nodes, or trade of all
models between two nodes of one room, while that lowers the summed
estimate, at most `MAX_ROUNDS` times. (Trades: the MILP's plans trade whole
nodes where the greedy's did not, four models on one gap-study seed, out of
reach of moves and swaps.) A model that may stay off the GPUs has an option
on `NOWHERE`; for such a large model (`evicting`) the search then tries
moving it onto a node cleared of the others, each of them taking its
cheapest option again: small models on the one node that could hold it
each lose by a single move. Last, it steps out of the local optimum once
(`_Search.step_out`): a move of a model in flight that costs on its own,
followed by the best move or swap it makes possible. Where the choice is
demo-sized, a branch and bound with a budget of priced node costs then
looks for a lower sum over all assignments (`_Search.branch_and_bound`):
the moves, swaps and one step out miss rotations of three models between
nodes, one of them at another precision, that the estimate prices better.

Speed: each option is one bit, a node's set is the OR of its options' bits
(the bits name the node too), and each set is priced once.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import NamedTuple

from planner_service.domain.problem import ModelSpec

# A search prices up to (options + pairs of models) sets per round: it runs online only where the models'
# (node, precision) pairs number at most this (the demo's 7 models x 4 nodes x up to 2 precisions: 56); on
# larger clusters (64 GPUs x 16 models: 512) it would add a third to planning, at 1,000 GPUs 30 times as much.
MAX_OPTIONS = 128
NOWHERE = ""  # the node of an option that leaves a model off the GPUs (it takes no room; see `assign`)
MAX_ROUNDS = (
    3  # improving moves at most; on the 50-scenario gap study a third still pays (median 1.075 -> 1.049), a fourth not
)
# The step out tries every option of the models in flight, each followed by a search round around it: it runs
# where the choice's options number at most this (7 models on 4 nodes at up to 2 precisions, idle ones with
# their option to stay cold: at most 63), costing ~1.5 ms of a compiled demo-sized plan; on 16 GPUs with 12
# models it would double planning.
STEP_OUT_MAX_OPTIONS = 64
# Node costs the branch and bound may price after the step out (where that runs). On the 50-scenario gap study
# it used a median 766 (about 0.5 ms in pure Python) and stopped at the limit on 12; it beat the local search
# on 16, each time within 2,012 steps (the study's p95 ratio 1.08 -> 1.03). Past the limit it keeps the best found.
# Raised from 3,000: on engine scenarios the better assignment of gap-study seeds 4 and 9 (a Llama-3.3-70B down to
# fp8 to share a node with a coder, a rotation of three models) lies past 3,000 (greedy objective 5,587 -> 5,323
# and 5,898 -> 5,828; plain seed 42 6,529 -> 6,497); the demo-sized bench plan never reaches the limit.
MAX_BOUND_STEPS = 10_000

# (node, MoE models with their groups' summed h2d) -> running totals of the expert bytes they take, best first,
# and of their decode slowdown plus HBM price ([slowdown with none], ...)
ExpertsCurve = Callable[[str, list[tuple[ModelSpec, float]]], tuple[list[int], list[float]]]


Moves = tuple[tuple[str, int], ...]  # (model, the bit of its new option) per model moved
_NO_MOVES: Moves = ()
_NONE = (1e-9, _NO_MOVES)  # no improving move found yet


class Option(NamedTuple):
    """One way to serve a model: on `node` at `precision`, taking `need` bytes of HBM (weights and active KV),
    at `cost` estimated objective seconds that do not depend on what else the node holds."""

    node: str
    precision: str
    need: int
    cost: float
    moe: tuple[ModelSpec, float] | None  # a MoE and its group's summed host->GPU bandwidth, for `experts_curve`
    # the most expert bytes its group holds (an engine's experts lie in equal shares on its own group), None: the
    # node's room
    expert_room: int | None = None
    # with `expert_room`: its group's share of the node's cards, the share of each other option's bytes taken
    # from that room (the greedy spreads a model over the widest group that fits: all the node's cards, where
    # they are alike)
    expert_cards: float = 1.0
    # the positions among its node's cards (by id) of the group it cannot leave there (a running engine that
    # stays as it is), its bytes in equal shares on them; () where it spreads over the node's cards
    fixed: tuple[int, ...] = ()
    # the width of the group it was priced on, and the bytes per card of it that a narrower group does not take
    # (an engine's CUDA context)
    width: int = 0
    per_card: int = 0
    # the group sizes its engine takes on the node (vLLM: those that divide the attention heads), () for
    # 1, 2, 4, ... cards
    widths: tuple[int, ...] = ()


def assign(
    options: Mapping[str, Sequence[Option]],
    order: Sequence[str],
    rooms: Mapping[str, int],
    experts_curve: ExpertsCurve,
    evicting: Sequence[str] = (),
    cards: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, Option]:
    """The option per model (models in `order`, each with at least one option) with the least summed node cost found.

    A model that may stay off the GPUs (one without requests in flight, that
    the caller may keep warm) has an option on `NOWHERE` at what staying cold
    costs it beyond its cold loads: it weighs the room the others take against
    what that model saves warm (its other options' costs, negative for dense
    models). Models in `evicting` then try `_Search.evict_for`. `cards`: each node's free bytes per card (by
    id), where options are `fixed` to some of them: a node holding such options fits only where every card
    holds their shares and an even share of the others' bytes.
    """
    search = _Search(options, order, {**rooms, NOWHERE: 0}, experts_curve, cards or {})
    for model in order:
        search.place_cheapest(model)
    for _ in range(MAX_ROUNDS):
        if not search.improve():
            break
    for model in evicting:
        if search.evict_for(model):
            for _ in range(MAX_ROUNDS):
                if not search.improve():
                    break
    if sum(len(options[m]) for m in order) <= STEP_OUT_MAX_OPTIONS:
        search.step_out([m for m in order if all(option.node != NOWHERE for option in options[m])])  # models in flight
        search.branch_and_bound(MAX_BOUND_STEPS)
    return {model: search.option_of[bit] for model, bit in search.chosen.items()}


class _Search:
    def __init__(
        self,
        options: Mapping[str, Sequence[Option]],
        order: Sequence[str],
        rooms: Mapping[str, int],
        experts_curve: ExpertsCurve,
        cards: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        self.option_of: dict[int, Option] = {}  # bit -> option
        self.bits: dict[str, list[int]] = {}  # model -> the bits of its options
        self._on: dict[str, dict[str, list[int]]] = {}  # model -> node -> the bits of its options there
        for model in order:
            self.bits[model] = []
            for option in options[model]:
                bit = 1 << len(self.option_of)
                self.option_of[bit] = option
                self.bits[model].append(bit)
                self._on.setdefault(model, {}).setdefault(option.node, []).append(bit)
        self._model_of = {bit: model for model, bits in self.bits.items() for bit in bits}
        self._twin: dict[tuple[int, str], int] = {}  # (bit, node) -> its model's option there at its precision
        for bits in self.bits.values():
            for bit, other in itertools.product(bits, bits):
                if self.option_of[other].precision == self.option_of[bit].precision:
                    self._twin.setdefault((bit, self.option_of[other].node), other)
        nodes = sorted(node for node in rooms if node != NOWHERE)
        self._alike = [(a, b) for a, b in itertools.combinations(nodes, 2) if rooms[a] == rooms[b]]
        self.chosen: dict[str, int] = {}  # model -> the bit of its option
        self.held: dict[str, int] = {}  # node -> the bits of the options it holds
        self.cost = _NodeCosts(self.option_of, rooms, experts_curve, cards or {})  # a node's options -> its cost

    def place_cheapest(self, model: str) -> None:
        """Give the model its cheapest option beside those placed (the first if none fits)."""
        cost = self.cost
        best, best_delta = self.bits[model][0], math.inf
        for bit in self.bits[model]:
            held = self.held.get(self.option_of[bit].node, 0)
            delta = cost.of(held | bit) - cost.of(held)
            if delta < best_delta:
                best, best_delta = bit, delta
        self._put(model, best)

    def improve(self) -> bool:
        """Take the best improving move (one model to another of its options), swap (two models on different
        nodes trade nodes, each at its best precision there: the two nodes' changes are independent) or trade
        (two nodes of one room trade all their models, each at its precision); False where none improves."""
        cost, held, option_of, on = self.cost, self.held, self.option_of, self._on
        best_gain = 1e-9
        best_move: Moves | None = None
        for model, current in self.chosen.items():
            node = option_of[current].node
            here = held[node]
            without = here ^ current
            freed = cost.of(here) - cost.of(without)
            for bit in self.bits[model]:
                to = option_of[bit].node
                if to == node:
                    gain = cost.of(here) - cost.of(without | bit)
                else:
                    there = held.get(to, 0)
                    gain = freed - cost.of(there | bit) + cost.of(there)
                if gain > best_gain:
                    best_gain, best_move = gain, ((model, bit),)
        for a, b in itertools.combinations(self.chosen, 2):
            bit_a, bit_b = self.chosen[a], self.chosen[b]
            node_a, node_b = option_of[bit_a].node, option_of[bit_b].node
            if node_a == node_b or node_b not in on[a] or node_a not in on[b]:
                continue
            gain_a, new_a = _cheapest(cost, held[node_b] ^ bit_b, on[a][node_b], cost.of(held[node_b]))
            gain_b, new_b = _cheapest(cost, held[node_a] ^ bit_a, on[b][node_a], cost.of(held[node_a]))
            if gain_a + gain_b > best_gain:
                best_gain, best_move = gain_a + gain_b, ((a, new_a), (b, new_b))
        # two nodes of one room trade all their models (nodes of different rooms: the estimates of what fits
        # beside a large model's KV were found too coarse for that, a trade that left more sessions unserved)
        for node_a, node_b in self._alike:
            held_a, held_b = held.get(node_a, 0), held.get(node_b, 0)
            if not (held_a or held_b):
                continue
            new_a, new_b = self._exchanged(held_b, node_a), self._exchanged(held_a, node_b)
            if new_a < 0 or new_b < 0:
                continue
            gain = cost.of(held_a) + cost.of(held_b) - cost.of(new_a) - cost.of(new_b)
            if gain > best_gain:
                best_gain, best_move = gain, tuple((self._model_of[bit], bit) for bit in _bits(new_a | new_b))
        if best_move is None:
            return False
        self._apply(best_move)
        return True

    def _exchanged(self, held: int, node: str) -> int:
        """The options on `node` of the models `held` names, each at the same precision; -1 where one has none."""
        out = 0
        for bit in _bits(held):
            twin = self._twin.get((bit, node))
            if twin is None:
                return -1
            out |= twin
        return out

    def evict_for(self, model: str) -> bool:
        """Take the best move of the model to another node that first clears that node of the other models
        and then gives each of them its cheapest option beside those placed (a chain of moves no single move
        or swap reaches: a large model's way onto a node small ones hold); False where none lowers the sum."""
        option_of = self.option_of
        start = (dict(self.chosen), dict(self.held))
        best_total, best = self._total() - 1e-9, None
        for bit in self.bits[model]:
            node = option_of[bit].node
            if node == option_of[start[0][model]].node:
                continue
            self.chosen, self.held = dict(start[0]), dict(start[1])
            evicted = [m for m, b in start[0].items() if m != model and option_of[b].node == node]
            for m in [model, *evicted]:
                self._take(m)
            self._put(model, bit)
            for m in evicted:
                self.place_cheapest(m)
            total = self._total()
            if total < best_total:
                best_total, best = total, (self.chosen, self.held)
        self.chosen, self.held = best or start
        return best is not None

    def step_out(self, movers: Sequence[str]) -> None:
        """From a local optimum where all fits, take the best pair of a move of one of `movers` to another node
        (worse on its own) and the best improving move or swap after it, where the pair lowers the sum; then
        improve on.

        After the first move only the two nodes it changed can make a move or
        swap improve (the rest was a local optimum), so only moves and swaps
        touching those are priced. Those touching the node the mover left
        are the same for each of its destinations: they are priced once per
        mover, by the node they touch besides (a destination's own are priced
        afresh). Such pairs reach rearrangements of three and more models (a
        MoE moving to the node a dense model leaves, which takes the MoE's
        node) that the gap study found the greedy missing. The caller's
        `movers` are the models in flight: starting from the idle ones too
        found little more on the gap study, at twice the time.
        """
        cost, held, option_of = self.cost, self.held, self.option_of
        members: dict[str, list[str]] = {}  # node -> its models
        for model, bit in self.chosen.items():
            members.setdefault(option_of[bit].node, []).append(model)
        start_costs = {node: cost.of(bits) for node, bits in held.items()}
        if math.isinf(sum(start_costs.values())):
            return  # (the improving moves found no assignment that fits: there is no optimum to step out of)
        best_change, best = -1e-9, _NO_MOVES
        for model in movers:
            current = self.chosen[model]
            here = option_of[current].node
            trials = [
                bit
                for bit in self.bits[model]
                if (to := option_of[bit].node) != here and not math.isinf(cost.of(held.get(to, 0) | bit))
            ]
            if not trials:  # (moves that do not fit on their own, followed by one making room, found next to
                continue  # nothing more on the gap study)
            left = held[here] ^ current
            state, costs = {**held, here: left}, {**start_costs, here: cost.of(left)}
            others = {node: [m for m in ms if m != model] for node, ms in members.items()}
            shared = self._follow_ups(here, state, costs, others, self.chosen)  # the mover off the GPUs meanwhile
            for bit in trials:
                there = option_of[bit].node
                state[there] = held.get(there, 0) | bit
                arrived = costs[there] = cost.of(state[there])
                with_mover = {**others, there: [*others.get(there, ()), model]}
                own = self._follow_ups(there, state, costs, with_mover, {**self.chosen, model: bit})
                state[there], costs[there] = held.get(there, 0), start_costs.get(there, 0.0)
                gain, follow_up = 0.0, _NO_MOVES
                for node, (g, moves) in shared.items():  # (those touching the destination were priced before the move)
                    if node != there and g > gain:
                        gain, follow_up = g, moves
                for g, moves in own.values():
                    if g > gain:
                        gain, follow_up = g, moves
                change = costs[here] + arrived - start_costs[here] - start_costs.get(there, 0.0) - gain
                if change < best_change:
                    best_change, best = change, ((model, bit), *follow_up)
        if not best:
            return
        self._take(best[0][0])
        self._put(*best[0])
        self._apply(best[1:])
        for _ in range(MAX_ROUNDS):
            if not self.improve():
                break

    def branch_and_bound(self, max_steps: int) -> None:
        """Replace the assignment by the least summed estimate over all assignments, found by a depth-first
        branch and bound within `max_steps` priced node costs, where it beats the assignment.

        Models branch in order of how much their options' costs differ (the
        decisive ones first), each option cheapest-alone first. A model's
        option adds at least its cost on an otherwise empty node (sharing a
        node only takes room from MoE experts), so the bound is the sum so far
        plus each model left's cheapest such cost; the local search's sum is
        the first bound to beat. Where the local search has reached the
        optimum, the search proves it; where not (three models rotating
        between nodes, one at another precision), it finds it.
        """
        cost = self.cost
        start = self._total()  # infinite where the local search left a node over its room: any fit beats it
        alone: dict[str, list[tuple[float, int]]] = {}
        for model in self.chosen:
            alone[model] = sorted((c, bit) for bit in self.bits[model] if not math.isinf(c := cost.of(bit)))
            if not alone[model]:
                return  # (no option of it fits even on an empty node)
        models = sorted(alone, key=lambda m: (-(alone[m][-1][0] - alone[m][0][0]), m))
        rest = [0.0] * (len(models) + 1)  # rest[i]: the bound of models[i:]
        for i in range(len(models) - 1, -1, -1):
            rest[i] = rest[i + 1] + alone[models[i]][0][0]
        bound = _Bound(cost, self.option_of, models, alone, rest, start - 1e-9, max_steps)
        bound.descend(0, 0.0)
        if bound.best:
            self.chosen, self.held = {}, {}
            for model, bit in bound.best.items():
                self._put(model, bit)

    def _follow_ups(
        self,
        node: str,
        state: Mapping[str, int],
        costs: Mapping[str, float],
        members: Mapping[str, list[str]],
        chosen: Mapping[str, int],
    ) -> dict[str, tuple[float, Moves]]:
        """The best improving move or swap touching `node`, per the other node it touches (`node` itself for a
        change of precision there), with the nodes holding `state` (at `costs`) and `members` at `chosen`."""
        cost, option_of, on = self.cost, self.option_of, self._on
        held, base = state[node], costs[node]
        found: dict[str, tuple[float, Moves]] = {}
        for other, models in members.items():
            for model in models:
                current = chosen[model]
                if other == node:
                    without = held ^ current
                    freed = base - cost.of(without)
                    for bit in self.bits[model]:
                        to = option_of[bit].node
                        if to == node:
                            gain = base - cost.of(without | bit)
                        else:
                            gain = freed - cost.of(state.get(to, 0) | bit) + costs.get(to, 0.0)
                        if gain > found.get(to, _NONE)[0]:
                            found[to] = (gain, ((model, bit),))
                elif node in on[model]:
                    freed = costs[other] - cost.of(state[other] ^ current)
                    for bit in on[model][node]:
                        gain = freed - cost.of(held | bit) + base
                        if gain > found.get(other, _NONE)[0]:
                            found[other] = (gain, ((model, bit),))
        for a in members.get(node, ()):
            rest_a = held ^ chosen[a]
            for other, models in members.items():
                if other == node or other not in on[a]:
                    continue
                there = state[other]
                for b in models:
                    if node not in on[b]:
                        continue
                    rest_b = there ^ chosen[b]
                    gain_a, new_a = _cheapest(cost, rest_b, on[a][other], costs[other])
                    gain_b, new_b = _cheapest(cost, rest_a, on[b][node], base)
                    if gain_a + gain_b > found.get(other, _NONE)[0]:
                        found[other] = (gain_a + gain_b, ((a, new_a), (b, new_b)))
        return found

    def _apply(self, moves: Moves) -> None:
        for model, _ in moves:
            self._take(model)
        for model, bit in moves:
            self._put(model, bit)

    def _total(self) -> float:
        return sum(map(self.cost.of, self.held.values()))

    def _put(self, model: str, bit: int) -> None:
        self.chosen[model] = bit
        node = self.option_of[bit].node
        self.held[node] = self.held.get(node, 0) | bit

    def _take(self, model: str) -> None:
        bit = self.chosen.pop(model)
        self.held[self.option_of[bit].node] ^= bit


class _Bound:
    """The state of `_Search.branch_and_bound`'s depth-first search."""

    def __init__(
        self,
        cost: _NodeCosts,
        option_of: Mapping[int, Option],
        models: list[str],
        alone: Mapping[str, list[tuple[float, int]]],
        rest: list[float],
        limit: float,
        steps: int,
    ) -> None:
        self.cost, self.option_of, self.models, self.alone, self.rest = cost, option_of, models, alone, rest
        self.limit = limit  # the sum to beat
        self.steps = steps  # node costs left to price
        self.held: dict[str, int] = {}
        self.costs: dict[str, float] = {}
        self.chosen: dict[str, int] = {}
        self.best: dict[str, int] = {}

    def descend(self, i: int, total: float) -> None:
        if i == len(self.models):
            self.limit, self.best = total, dict(self.chosen)
            return
        model, rest = self.models[i], self.rest[i + 1]
        for alone, bit in self.alone[model]:
            if total + alone + rest >= self.limit:
                break  # (in order: the options after it cost more alone)
            if self.steps <= 0:
                return
            self.steps -= 1
            node = self.option_of[bit].node
            held, before = self.held.get(node, 0), self.costs.get(node, 0.0)
            after = self.cost.of(held | bit)
            change = total - before + after
            if change + rest >= self.limit:  # (infinite where it does not fit)
                continue
            self.held[node], self.costs[node], self.chosen[model] = held | bit, after, bit
            self.descend(i + 1, change)
            self.held[node], self.costs[node] = held, before
            del self.chosen[model]


class _NodeCosts:
    """The bits of a node's options -> the node's cost (`of`), each priced once, on first look-up.

    A set's bytes and own costs are those of the set without its lowest bit
    (priced first) plus that option's, and the MoE models' experts curve is
    looked up by the bits of the MoE options alone (sets that differ in
    their dense models share it). (A plain class rather than a dict with
    `__missing__`: compiled, its attributes and methods are reached directly.)
    """

    def __init__(
        self,
        option_of: Mapping[int, Option],
        rooms: Mapping[str, int],
        experts_curve: ExpertsCurve,
        cards: Mapping[str, Sequence[int]],
    ) -> None:
        self._option_of, self._rooms, self._experts_curve, self._cards = option_of, rooms, experts_curve, cards
        self._fixed: dict[int, tuple[int, ...]] = {0: ()}  # bits -> the fixed options' bytes per card
        self._costs: dict[int, float] = {0: 0.0}
        # bits -> (bytes, own costs, MoE bits, the expert bytes their groups hold alone: inf where one is the
        # node's, the sum of their `expert_cards`, and of their `expert_cards` times their own bytes)
        self._sums: dict[int, tuple[int, float, int, float, float, float]] = {0: (0, 0.0, 0, 0.0, 0.0, 0.0)}
        self._curves: dict[int, tuple[list[int], list[float]]] = {}  # MoE bits -> their experts curve

    def of(self, held: int) -> float:
        cost = self._costs.get(held)
        return self._price(held) if cost is None else cost

    def _price(self, held: int) -> float:
        low = held & -held
        rest = held ^ low
        if rest not in self._sums:  # not priced yet
            self._price(rest)
        need, cost, moe_bits, cap, cards, own = self._sums[rest]
        option = self._option_of[low]
        need += option.need
        cost += option.cost
        if option.moe:
            moe_bits |= low
            if option.expert_room is None:
                cap = math.inf
            else:
                cap += option.expert_room
                cards += option.expert_cards
                own += option.expert_cards * option.need
        self._sums[held] = (need, cost, moe_bits, cap, cards, own)
        room = self._rooms[option.node]
        if need > room or not self._fits_cards(held, rest, option):
            cost = math.inf
        elif moe_bits:
            taken, change = self._curve(option.node, moe_bits)
            # each capped group's room less its cards' share of the other options' bytes (`Option.expert_cards`)
            cap -= cards * need - own
            loads = self._fixed.get(held, ())
            if loads:
                # equal shares stop at the fullest card: beside fixed bytes, each card of a capped group loses
                # the most any card holds, not an even split of them (gap-study engine seed 5: GLM-4.5V priced
                # with four A100s' room beside a Qwen2.5-7B staying on one, then placed on the other three)
                cap -= cards * (len(loads) * max(loads) - sum(loads))
            cost += change[bisect.bisect_right(taken, max(0, min(room - need, cap))) - 1]
        self._costs[held] = cost
        return cost

    def _fits_cards(self, held: int, rest: int, option: Option) -> bool:
        """Whether every card of the node holds the `fixed` options' shares, and the others fit beside them in
        the caller's order (`spread_fits`): the node's room alone let a Llama-3.3-70B be chosen beside a coder's
        running engine filling one card (gap-study engine seed 31); sizes of a power of two alone refused it
        three A100s where its `local` engine runs on any number (seed 6); the largest of the others alone let a
        Llama-3.3-70B take three L40S beside a Llama-3.1-8B staying on the fourth, where a coder then fitted on
        none of them and the greedy widened the 8B after all (plain seed 33); and a MoE priced on four L40S
        beside a Llama-3.1-8B staying on one, with a coder and a Qwen2.5-7B placed before it, found three
        (plain seed 12: GLM-4.5-Air, 423.0 s more than with the coder beside the A100s' Llama-3.3-70B)."""
        before = self._fixed.get(rest, ())
        if not before and not option.fixed:
            self._fixed[held] = ()
            return True
        free = self._cards.get(option.node)
        if not free:
            self._fixed[held] = ()
            return True
        loads = list(before) if before else [0] * len(free)
        for i in option.fixed:
            loads[i] += option.need // len(option.fixed)
        self._fixed[held] = tuple(loads)
        left = [room - load for load, room in zip(loads, free, strict=True)]
        if min(left) < 0:
            return False
        return spread_fits(left, [o for bit in _bits(held) if not (o := self._option_of[bit]).fixed])

    def _curve(self, node: str, moe_bits: int) -> tuple[list[int], list[float]]:
        curve = self._curves.get(moe_bits)
        if curve is None:
            moes = [moe for bit in _bits(moe_bits) if (moe := self._option_of[bit].moe) is not None]  # all are MoEs
            curve = self._curves[moe_bits] = self._experts_curve(node, moes)
        return curve


def _cheapest(cost: _NodeCosts, rest: int, bits: Sequence[int], before: float) -> tuple[float, int]:
    """The largest gain `before` - cost(rest + one of `bits`), and that bit (the first among equals)."""
    best_gain, best = -math.inf, bits[0]
    for bit in bits:
        gain = before - cost.of(rest | bit)
        if gain > best_gain:
            best_gain, best = gain, bit
    return best_gain, best


def spread_fits(left: Sequence[int], spread: Sequence[Option]) -> bool:
    """Whether `spread` (options on no fixed cards, in the order the greedy places them) fit cards with `left`
    free bytes, each split evenly over the roomiest cards of the widest group its engine takes that holds it
    (`Option.widths`; `Option.per_card` bytes fewer per card it leaves out of the group it was priced on), a
    MoE only over as many cards as it was priced on (its experts' room and links are those of that width)."""
    left = sorted(left, reverse=True)
    for option in spread:
        sizes = option.widths or tuple(1 << i for i in range(len(left).bit_length()))
        if option.moe and option.width:
            sizes = (option.width,)
        for k in sorted((k for k in sizes if k <= len(left)), reverse=True):
            share = -(-(option.need - max(0, option.width - k) * option.per_card) // k)  # rounded up
            if left[k - 1] >= share:
                left[:k] = [room - share for room in left[:k]]
                left.sort(reverse=True)
                break
        else:
            return False
    return True


def _bits(mask: int) -> Iterator[int]:
    """The set bits of `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low
        mask ^= low
