"""The planner's batched shortcuts give exactly what the one-at-a-time forms give."""

from __future__ import annotations

import heapq
from collections import defaultdict

import numpy as np
import pytest

from planner_service.domain.generate import random_scenario
from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.planner import costs
from planner_service.planner.greedy import GreedyPlanner
from planner_service.planner.objective import (
    Demand,
    _arrival_kv,
    _kv_arrival,
    _kv_ready_of,
    expert_rates,
    kv_ready,
)
from planner_service.planner.operations import (
    PRIORITY_RANK,
    Action,
    Operation,
    kahn_order,
)
from planner_service.planner.residency import ResidencyIndex

SIZES = [(8, 5, 20), (16, 7, 100), (24, 9, 101)]


def problems():
    for seed in range(6):
        for gpus, models, sessions in SIZES:
            yield problem_from_scenario(random_scenario(np.random.default_rng(seed), gpus, models, sessions))


def test_demand_gathers_each_sessions_prediction_and_context() -> None:
    for problem in problems():
        demand = Demand.of(problem)
        for j, sid in enumerate(problem.sessions):
            probs = problem.next_model.get(sid) or {}
            expected = [probs.get(m, 0.0) for m in problem.models]
            assert demand.q[:, j].tolist() == expected
            assert demand.context[j] == problem.sessions[sid].context_tokens


def test_active_requests_kv_in_one_batch_equals_each_alone() -> None:
    for problem in problems():
        target = GreedyPlanner(problem).plan().placement
        now, then = ResidencyIndex.build(problem, problem.residency), ResidencyIndex.build(problem, target)
        position = Demand.of(problem).position
        by_model: dict[str, list[str]] = {}
        for s in problem.sessions.values():
            if s.active and s.model in then.serving:
                by_model.setdefault(s.model, []).append(s.id)
        if not by_model:
            continue
        groups = [
            _arrival_kv(now, problem.models[m], then.serving[m], ids, problem.constants) for m, ids in by_model.items()
        ]
        _, columns, seconds = _kv_ready_of(problem, position, groups)
        batched = dict(zip(columns, seconds.tolist(), strict=True))
        for model_id, ids in by_model.items():
            for sid in ids:
                alone = _kv_arrival(problem, now, problem.models[model_id], sid, then.serving[model_id])
                assert batched[position[sid]] == alone


def test_named_constructors_make_what_the_fields_make() -> None:
    made = [
        (StateObject.weights("m", "fp8"), StateObject(Kind.WEIGHTS, "m", "fp8", None)),
        (StateObject.experts("m"), StateObject(Kind.EXPERTS, "m", None, None)),
        (StateObject.kv("m", "s"), StateObject(Kind.KV, "m", None, "s")),
        (Location.gpu("g"), Location(Tier.GPU, "g")),
        (Location.host("n"), Location(Tier.HOST, "n")),
        (Location.nvme("n"), Location(Tier.NVME, "n")),
    ]
    for fast, general in made:
        assert type(fast) is type(general)
        assert fast == general and hash(fast) == hash(general)
        assert fast._asdict() == general._asdict()


def test_predicted_kv_in_one_batch_equals_each_alone() -> None:
    for problem in problems():
        target = GreedyPlanner(problem).plan().placement
        then = ResidencyIndex.build(problem, target)
        position = Demand.of(problem).position
        groups = []
        for model_id, serving in then.serving.items():
            model = problem.models[model_id]
            holders = then.kv_sessions.get(model_id)
            if holders:
                per_token = costs.prefill_seconds_per_token(model, serving.gpus, problem.constants)
                rates = expert_rates(then, model, serving.node, serving.gpus, problem.constants)
                groups.append((then, len(groups), model, serving.node, serving.gpus, True, per_token, rates, holders))
        if not groups:
            continue
        rows, columns, seconds = _kv_ready_of(problem, position, groups)
        batched = dict(zip(zip(rows, columns, strict=True), seconds.tolist(), strict=True))
        for row, (_, _, model, node, gpus, _, _, _, holders) in enumerate(groups):
            for sid in holders:
                gpu_kv = then.on(StateObject.kv(model.id, sid), node, Tier.GPU)
                assert batched[(row, position[sid])] == kv_ready(problem, then, model, sid, node, gpus, gpu_kv)


def test_rows_summed_at_once_equal_each_row_alone() -> None:
    # the evaluator sums q(s, m) * w_s for every predicted model in one call, and must match row by row
    rng = np.random.default_rng(0)
    for rows, columns in [(1, 1), (3, 7), (7, 100), (16, 500), (9, 1031)]:
        weights = rng.random(columns) * (rng.random((rows, columns)) < 0.4)
        assert weights.sum(axis=1).tolist() == [float(row.sum()) for row in weights]


def test_gpus_by_free_bytes_break_ties_by_id() -> None:
    for problem in problems():
        planner = GreedyPlanner(problem)
        book = planner.book
        for node_id in problem.nodes:
            ids = book.gpu_ids(node_id)
            book.take_from(node_id, [(g, (k % 3) * 1024) for k, g in enumerate(ids)])
            gpus, free = book.by_free(node_id)
            expected = sorted((book.free[g], g) for g in ids)
            assert [(f, g.id) for f, g in zip(free, gpus, strict=True)] == expected


def _reference_order(ranks: list[int], deps: dict[int, set[int]]) -> list[int]:
    """Kahn's order with one heap step per operation, most urgent (then first made) first."""
    children: dict[int, set[int]] = {}
    for i, ds in deps.items():
        for d in ds:
            children.setdefault(d, set()).add(i)
    pending = {i: len(ds) for i, ds in deps.items()}
    ready = [(r, i) for i, r in enumerate(ranks) if i not in pending]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)[1]
        order.append(i)
        for child in children.get(i, ()):
            pending[child] -= 1
            if not pending[child]:
                heapq.heappush(ready, (ranks[child], child))
    return order


def test_operations_come_in_kahns_most_urgent_first_order() -> None:
    rng = np.random.default_rng(0)
    priorities = list(PRIORITY_RANK)
    kv = StateObject.kv("m", "s")
    for n in (1, 2, 5, 30, 120):
        for _ in range(20):
            ranks = rng.integers(0, len(priorities), n).tolist()
            deps = {
                i: {int(d) for d in rng.choice(i, size=min(i, 3), replace=False)}
                for i in range(n)
                if i and rng.random() < 0.2
            }
            ops = [Operation("", Action.DROP, kv, None, None, 1, False, priorities[r]) for r in ranks]
            waiting: defaultdict[int, set[int]] = defaultdict(set)
            for i, ds in deps.items():
                for d in ds:
                    waiting[d].add(i)
            expected = _reference_order(ranks, deps)
            order = kahn_order(ops, {i: set(ds) for i, ds in deps.items()}, waiting)
            assert [ops.index(op) for op in order] == expected
            names = {i: f"op-{k + 1}" for k, i in enumerate(expected)}
            for i, op in enumerate(ops):
                assert op.id == names[i]
                assert op.depends_on == sorted((names[d] for d in deps.get(i, ())), key=lambda name: int(name[3:]))


def test_a_dependency_cycle_is_refused() -> None:
    kv = StateObject.kv("m", "s")
    ops = [Operation("", Action.DROP, kv, None, None, 1, False) for _ in range(3)]
    with pytest.raises(ValueError, match="cycle"):
        kahn_order(ops, {1: {2}, 2: {1}}, defaultdict(set, {1: {2}, 2: {1}}))
