"""`static-tuned`: the best fixed partition a team could find by trying configurations in the simulator.

The space: for every model, an engine on one node, with a tensor-parallel degree (1, 2, 4, ... GPUs of
that node, at least the model's minimum there) and a precision from its allowed set, or no fixed engine
(the model is loaded on demand into the room the partition leaves, least recently used first, as
`static` does: where the catalog exceeds HBM some models must be). A candidate is
materialised by giving each model (largest weights first) the `k` GPUs of its node with the most room
left; it is pruned when a GPU's weights would leave less than `KV_HEADROOM` of it for KV, so every
engine of a candidate is up at once and never moves, or when a model it serves on demand fits beside
them nowhere; a candidate whose training replay cannot finish is infeasible. Candidates are scored by replaying training
traces (seeds kept apart from the reported ones) under this policy; the score is, as means over the
training traces, first the failed requests (a request no engine of the partition can hold times out,
`engine.REQUEST_TIMEOUT_SECONDS`: an operator would not keep a partition that drops requests), then
the hand-off switch P95 (all requests' where a trace has no hand-off), then the completion P95. The search is exhaustive where the pruned space fits the replay budget, otherwise the
operator partition (`groups.operator_partition`, where it fits at once) and then uniform samples of the
space, up to `budget` replays. `TuneResult` says the space's size, how many candidates were pruned and
how many replays were run.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from planner_service.domain.problem import Problem
from planner_service.domain.scenario import Scenario
from planner_service.domain.state import Kind, Location, StateObject
from planner_service.sim.engine import base_problem, simulate
from planner_service.sim.executor import KV_HEADROOM, SimulationError
from planner_service.sim.metrics import summarize
from planner_service.sim.policies.base import PolicyName
from planner_service.sim.policies.groups import FixedEngine, FixedGroupsPolicy, Partition, operator_partition
from planner_service.sim.trace import TraceRecord

if TYPE_CHECKING:
    from planner_service.sim.state import SimRequest
    from planner_service.sim.view import SimView

Option = tuple[str, int, str] | None  # (node, tensor-parallel degree, precision); None: loaded on demand


class StaticTunedPolicy(FixedGroupsPolicy):
    """Every engine of a searched partition up from t=0 and never moved; KV and experts use the rest."""

    name = PolicyName.STATIC_TUNED

    def __init__(self, partition: Partition | None = None) -> None:
        if partition is None:
            raise ValueError(
                "static-tuned needs a partition found on training traces: `tune_static` searches one "
                "(`statebudget study seeds` runs it on the training seeds)"
            )
        super().__init__(partition)

    def place(self, sim: SimView) -> None:
        for model_id in self.demand_order(sim):
            engine = self.partition[model_id]
            self.act.place_now(model_id, engine.node, engine.precision, engine.gpus)

    def ensure(self, sim: SimView, req: SimRequest) -> None:
        if req.model not in self.partition:
            self.act.load_model(req.model)  # no fixed engine: on demand, by design (not a fallback)
            return
        super().ensure(sim, req)

    def victim_key(self, sim: SimView, obj: StateObject, loc: Location) -> tuple | None:
        if obj.kind is Kind.WEIGHTS and obj.model in self.partition:
            return None  # the partition never moves
        return super().victim_key(sim, obj, loc)

    def on_stuck(self, sim: SimView, req: SimRequest) -> None:
        """The group cannot hold the request's KV: free its other KV and experts (never another engine)."""
        state = sim.models[req.model]
        for g in state.gpus:
            loc = Location.gpu(g.id)
            for obj in list(sim.cluster.objects_at(loc)):
                if obj.kind is not Kind.WEIGHTS:
                    self.act.evict(obj, loc)


def model_options(problem: Problem, model_id: str) -> list[Option]:
    """Each node, tensor-parallel degree and precision the model could be launched with (before packing),
    then None (no fixed engine)."""
    model = problem.models[model_id]
    out: list[Option] = []
    for node_id in sorted(problem.nodes):
        node = problem.nodes[node_id]
        if not node.can_serve(model_id):
            continue
        gpus = [problem.gpus[g] for g in sorted(node.gpus)]
        smallest = min(g.capacity_bytes for g in gpus)
        k = 1
        while k <= len(gpus):
            if k >= max(model.min_gpus.get(g.type, 1) for g in gpus):
                for precision in model.precisions:
                    if math.ceil(model.weights_bytes[precision] / k) <= (1 - KV_HEADROOM) * smallest:
                        out.append((node_id, k, precision))
            k *= 2
    return [*out, None]


def materialise(problem: Problem, choice: dict[str, Option]) -> dict[str, FixedEngine] | None:
    """The partition a choice of options means, or None when its weights do not fit at once (pruned)."""
    used = dict.fromkeys(problem.gpus, 0)
    out: dict[str, FixedEngine] = {}
    fixed = {m: o for m, o in choice.items() if o is not None}
    for model_id in sorted(fixed, key=lambda m: (-problem.models[m].weights_bytes[fixed[m][2]], m)):
        node_id, k, precision = fixed[model_id]
        shard = math.ceil(problem.models[model_id].weights_bytes[precision] / k)
        room = sorted(problem.nodes[node_id].gpus, key=lambda g: (used[g] - problem.gpus[g].capacity_bytes, g))
        group = sorted(room[:k])
        if any(used[g] + shard > (1 - KV_HEADROOM) * problem.gpus[g].capacity_bytes for g in group):
            return None
        for g in group:
            used[g] += shard
        out[model_id] = FixedEngine(model_id, node_id, precision, tuple(problem.gpus[g] for g in group))
    for model_id in sorted(m for m, o in choice.items() if o is None):
        if not _room_on_demand(problem, model_id, used):
            return None  # a model served on demand must fit beside the fixed engines somewhere
    return out


def _room_on_demand(problem: Problem, model_id: str, used: dict[str, int]) -> bool:
    """Whether some allowed launch of the model fits in what the fixed engines leave free."""
    model = problem.models[model_id]
    for node_id, k, precision in (o for o in model_options(problem, model_id) if o is not None):
        shard = math.ceil(model.weights_bytes[precision] / k)
        room = sorted((problem.gpus[g].capacity_bytes - used[g] for g in problem.nodes[node_id].gpus), reverse=True)
        if all(r * (1 - KV_HEADROOM) >= shard for r in room[:k]):
            return True
    return False


@dataclass
class TuneResult:
    partition: dict[str, FixedEngine]
    space_size: int  # candidates before pruning by memory fit
    replays: int  # replays run (candidates scored x training traces)
    candidates_scored: int
    pruned: int  # candidates drawn that did not fit
    exhaustive: bool
    failed: int  # candidates whose training replay could not finish
    best_score: tuple[float, float, float]  # failed requests, hand-off P95 s, completion P95 s
    scores: list[tuple[tuple[float, float, float], dict[str, str]]] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "partition": {
                m: {"node": e.node, "precision": e.precision, "gpus": [g.id for g in e.gpus]}
                for m, e in sorted(self.partition.items())
            },
            "space_size": self.space_size,
            "replays": self.replays,
            "candidates_scored": self.candidates_scored,
            "pruned": self.pruned,
            "exhaustive": self.exhaustive,
            "failed": self.failed,
            "best_score": {
                "failed_requests": self.best_score[0],
                "handoff_p95_seconds": self.best_score[1],
                "completion_p95_seconds": self.best_score[2],
            },
        }


def _candidates(
    problem: Problem, options: dict[str, list[Option]], budget: int, rng: np.random.Generator
) -> Iterator[tuple[dict[str, Option], bool]]:
    """Candidate choices: all of them when the space is at most `budget`, else the operator's then samples.
    The flag says whether the enumeration is exhaustive."""
    models = sorted(options)
    size = math.prod(len(options[m]) for m in models)
    if size <= budget:
        for combo in itertools.product(*(options[m] for m in models)):
            yield dict(zip(models, combo, strict=True)), True
        return
    operator = operator_partition(problem)
    yield {m: (e.node, len(e.gpus), e.precision) if (e := operator.get(m)) else None for m in models}, False
    while True:
        yield {m: options[m][int(rng.integers(len(options[m])))] for m in models}, False


def tune_static(
    scenario: Scenario,
    training: Sequence[Sequence[TraceRecord]],
    *,
    budget: int = 200,
    seed: int = 0,
    max_draws: int = 100_000,
) -> TuneResult:
    """Search fixed partitions by replaying `training` traces (module doc); `budget` bounds the replays."""
    if not training:
        raise ValueError("training: at least one training trace is needed")
    problem = base_problem(scenario)
    options = {m: model_options(problem, m) for m in sorted(problem.models)}
    space = math.prod(len(o) for o in options.values())
    rng = np.random.default_rng(seed)
    seen: set[tuple] = set()
    best: tuple[tuple[float, float, float], dict[str, FixedEngine]] | None = None
    replays = pruned = scored = draws = failed = 0
    exhaustive = False
    scores: list[tuple[tuple[float, float, float], dict[str, str]]] = []
    for choice, whole_space in _candidates(problem, options, budget // len(training), rng):
        exhaustive = whole_space
        draws += 1
        if draws > max_draws or replays + len(training) > budget:
            break
        key = tuple(sorted(choice.items()))
        if key in seen:
            continue
        seen.add(key)
        partition = materialise(problem, choice)
        if partition is None:
            pruned += 1
            continue
        lost, handoff, done = [], [], []
        for records in training:
            replays += 1
            try:
                summary = summarize(simulate(scenario, records, StaticTunedPolicy(partition)))
            except SimulationError:
                break  # the partition cannot serve this trace: infeasible
            switch = summary["switch_latency_seconds"]
            lost.append(summary["failed_requests"]["all"])
            handoff.append(switch["handoff"]["p95"] if summary.get("handoffs") else switch["all"]["p95"])
            done.append(summary["completion_seconds"]["p95"])
        if len(handoff) < len(training):
            failed += 1
            continue
        score = (float(np.mean(lost)), float(np.mean(handoff)), float(np.mean(done)))
        scored += 1
        scores.append((score, {m: f"{e.node}/tp{len(e.gpus)}/{e.precision}" for m, e in partition.items()}))
        if best is None or score < best[0]:
            best = (score, partition)
    if best is None:
        raise ValueError(
            f"budget: {budget} replays score no candidate ({pruned} pruned by memory fit, {failed} infeasible)"
        )
    return TuneResult(best[1], space, replays, scored, pruned, exhaustive, failed, best[0], scores)
