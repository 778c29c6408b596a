"""Fixed engine groups: each model served by one engine whose GPUs, tensor-parallel degree and precision
are set by its operator, as in a llama-swap or Ollama config (a model's launch command names its GPUs).

`operator_partition` writes the config an operator would: models in decreasing size (weights and a MoE's routed
experts), each on a node whose group holds the whole model with `KV_HEADROOM` of it left where one does, then
on the node with the least size already assigned to it (relative to its HBM) that holds its weights, tensor-parallel
over all of that node's GPUs (llama-swap's `CUDA_VISIBLE_DEVICES` per model; vLLM's
`--tensor-parallel-size`), or over the GPUs the node declares the model's engine on, at its preferred precision where the shards fit with `KV_HEADROOM` of each
GPU left for KV, else the next allowed precision. Models that share a node form one llama-swap group:
they run together while they fit and swap, least recently used first, when they do not.

`FixedGroupsPolicy` serves every model on its group only: a load is a wake or a start of that engine,
never another configuration, and room on the group is made by taking down the least recently used
other engine there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner_service.domain.problem import Gpu, Problem
from planner_service.domain.scenario import Scenario
from planner_service.domain.state import Kind, Location, StateObject
from planner_service.planner.greedy import split_evenly
from planner_service.sim.executor import KV_HEADROOM
from planner_service.sim.policies.base import Policy
from planner_service.sim.trace import TraceRequest

if TYPE_CHECKING:
    from planner_service.sim.state import ModelState, SimRequest
    from planner_service.sim.view import SimView


@dataclass(frozen=True)
class FixedEngine:
    """One model's engine as its operator configured it."""

    model: str
    node: str
    precision: str
    gpus: tuple[Gpu, ...]


Partition = Mapping[str, FixedEngine]


def engine_fits(problem: Problem, model_id: str, node_id: str, precision: str, gpus: tuple[Gpu, ...]) -> bool:
    """Whether the model's weights at `precision`, split over `gpus`, leave `KV_HEADROOM` of each GPU free."""
    model = problem.models[model_id]
    if not gpus or not problem.nodes[node_id].can_serve(model_id):
        return False
    if len(gpus) < max(model.min_gpus.get(g.type, 1) for g in gpus):
        return False
    shard = math.ceil(model.weights_bytes[precision] / len(gpus))
    return all(shard <= (1 - KV_HEADROOM) * g.capacity_bytes for g in gpus)


def node_gpus(problem: Problem, node_id: str) -> tuple[Gpu, ...]:
    return tuple(problem.gpus[g] for g in sorted(problem.nodes[node_id].gpus))


def engine_group(problem: Problem, model_id: str, node_id: str) -> tuple[Gpu, ...]:
    """The GPUs the model's engine spans on the node: those the node declares it on, else all of them."""
    fixed = problem.nodes[node_id].engine_gpus.get(model_id)
    return tuple(problem.gpus[g] for g in sorted(fixed)) if fixed else node_gpus(problem, node_id)


def operator_partition(problem: Problem) -> dict[str, FixedEngine]:
    """The hand-written config: each model tensor-parallel over a whole node, spread by size (module doc)."""
    assigned = dict.fromkeys(problem.nodes, 0)
    hbm = {n: sum(g.capacity_bytes for g in node_gpus(problem, n)) for n in problem.nodes}
    out: dict[str, FixedEngine] = {}

    def size(model_id: str, precision: str) -> int:  # the checkpoint an operator sizes a group by
        model = problem.models[model_id]
        return model.weights_bytes[precision] + model.experts_bytes

    for model in sorted(problem.models.values(), key=lambda m: (-size(m.id, m.preferred), m.id)):
        for precision in model.precisions:  # preferred first
            fits = [
                n
                for n in sorted(problem.nodes)
                if engine_fits(problem, model.id, n, precision, engine_group(problem, model.id, n))
            ]
            if fits:
                whole = size(model.id, precision)
                node_id = (
                    min(  # a node whose group holds the whole model first (a MoE's experts too), then the least loaded
                        fits,
                        key=lambda n: (
                            whole
                            > (1 - KV_HEADROOM) * sum(g.capacity_bytes for g in engine_group(problem, model.id, n)),
                            assigned[n] / hbm[n],
                            n,
                        ),
                    )
                )
                out[model.id] = FixedEngine(model.id, node_id, precision, engine_group(problem, model.id, node_id))
                assigned[node_id] += whole
                break
    return out


def declared_on_groups(scenario: Scenario, partition: Partition) -> Scenario:
    """The scenario deployed as `partition` configures it: each node declares an engine only for the models
    assigned to it, on their groups (so it serves no other), and GPU copies of models a node no longer serves
    are left out. Checkpoints on disk and in host RAM stay where they are."""
    data = scenario.model_dump(mode="json", exclude_none=True)
    node_of_gpu = {g["id"]: n["id"] for n in data["cluster"]["nodes"] for g in n["gpus"]}
    for node in data["cluster"]["nodes"]:
        mine = {m: e for m, e in partition.items() if e.node == node["id"]}
        declared = {e["model"]: e for e in node.get("engines", [])}
        node["engines"] = [
            {**declared.get(m, {"model": m}), "model": m, "gpus": [g.id for g in e.gpus]}
            for m, e in sorted(mine.items())
        ]
    data["residency"] = [
        r
        for r in data["residency"]
        if r["location"]["tier"] != "gpu"
        or (engine := partition.get(r["object"]["model"])) is not None
        and engine.node == node_of_gpu[r["location"]["gpu"]]
    ]
    return Scenario.model_validate(data)


def shards_fit_now(sim: SimView, engine: FixedEngine) -> bool:
    """Whether the weights' shards and the engine's CUDA context fit in the group's free bytes and the residue
    their engine's wake keeps (`SimView.bring_up_bytes`)."""
    shard = -(-sim.problem.models[engine.model].weights_bytes[engine.precision] // len(engine.gpus))
    return all(
        sim.cluster.free(Location.gpu(g.id))
        >= shard + sim.bring_up_bytes(engine.model, engine.node, engine.precision, engine.gpus, g.id)
        for g in engine.gpus
    )


def launch_asleep(sim: SimView, policy: Policy, engine: FixedEngine) -> bool:
    """Launch the model's engine on its group once and put it to sleep, as a deployment that ran before has it
    at t=0; False (nothing done) where the engine does not fit there or its shards do not fit now."""
    model_id = engine.model
    if not engine_fits(sim.problem, model_id, engine.node, engine.precision, engine.gpus):
        return False
    if not shards_fit_now(sim, engine):
        return False
    policy.act.place_now(model_id, engine.node, engine.precision, engine.gpus)
    policy.act.evict(StateObject.weights(model_id, engine.precision), Location.gpu(engine.gpus[0].id))
    return True


def bring_up(sim: SimView, policy: Policy, engine: FixedEngine) -> bool:
    """Start or wake the model's engine on exactly its group, making room there (least recently used
    other engines first); False when the group cannot make room now (the request waits)."""
    if engine.model in sim.models:
        return True
    weights = StateObject.weights(engine.model, engine.precision)
    shards = split_evenly(sim.problem.models[engine.model].weights_bytes[engine.precision], len(engine.gpus))
    for g, nbytes in zip(engine.gpus, shards, strict=True):
        loc = Location.gpu(g.id)
        need = (
            nbytes
            - sim.cluster.bytes_of(weights, loc)
            + sim.bring_up_bytes(engine.model, engine.node, engine.precision, engine.gpus, g.id)
        )
        if need > sim.cluster.free(loc):
            policy.act.make_room(loc, need - sim.cluster.free(loc), protect={engine.model})
        if need > sim.cluster.free(loc):
            return False
    policy.act.promote_weights(engine.model, engine.node, engine.precision, engine.gpus)
    return True


class FixedGroupsPolicy(Policy):
    """Every model on its configured group only (module doc); subclasses say what runs at t=0 and when an
    idle engine leaves."""

    def __init__(self, partition: Partition | None = None) -> None:
        self.partition: dict[str, FixedEngine] = dict(partition or {})

    def place(self, sim: SimView) -> None:
        if not self.partition:
            self.partition = operator_partition(sim.problem)

    def allowed(self, sim: SimView, model: str) -> Callable[[str], bool]:
        engine = self.partition.get(model)
        if engine is None:
            return lambda gpu: True  # a model the config leaves out: anywhere (counted as a fallback load)
        ids = {g.id for g in engine.gpus}
        return lambda gpu: gpu in ids

    def ensure(self, sim: SimView, req: SimRequest) -> None:
        if req.model in sim.models:
            return
        engine = self.partition.get(req.model)
        if engine is None:
            if self.act.load_model(req.model):
                self.act.count_fallback()
            return
        bring_up(sim, self, engine)

    def on_stuck(self, sim: SimView, req: SimRequest) -> None:
        """The engine is up but its group cannot hold the request's KV: take the group's other engines and
        KV down. When the empty group is still too small, the model moves (a fallback), unless its engine is
        on its configured group and restarting it there frees nothing the KV needs: it can serve on no other
        GPUs, so it stays up and the request waits (failing at the client's timeout, `engine.py`) rather than
        sleep and wake on the same GPUs at every dispatch pass."""
        state = sim.models[req.model]
        for g in state.gpus:
            loc = Location.gpu(g.id)
            for obj in list(sim.cluster.objects_at(loc)):
                if obj.model != req.model or obj.kind is Kind.KV:
                    self.act.evict(obj, loc)
        shard = -(-sim.kv_footprint(req) // len(state.gpus))
        if any(sim.cluster.free(Location.gpu(g.id)) < shard for g in state.gpus):
            if self._on_own_group(req.model, state) and not self._restart_helps(sim, req.model, state, shard):
                return
            self.act.count_fallback()
            super().on_stuck(sim, req)

    def _on_own_group(self, model_id: str, state: ModelState) -> bool:
        engine = self.partition.get(model_id)
        return engine is not None and {g.id for g in state.gpus} == {g.id for g in engine.gpus}

    @staticmethod
    def _restart_helps(sim: SimView, model_id: str, state: ModelState, shard: int) -> bool:
        """Whether the KV would fit once the engine's own GPU experts go (an expert share fixed at launch is
        re-sized only by a restart, `Executor.fill_experts`) and the engines asleep on the group stop."""
        experts = StateObject.experts(model_id)
        room = {g.id: sim.cluster.free(Location.gpu(g.id)) + sim.stoppable_residue(g.id) for g in state.gpus}
        held = {g.id: sim.cluster.bytes_of(experts, Location.gpu(g.id)) for g in state.gpus}
        return any(held.values()) and all(room[g] + held[g] >= shard for g in room)

    def demand_order(self, sim: SimView) -> list[str]:
        """The configured models, most requested in the trace first (ties by name)."""
        counts: dict[str, int] = dict.fromkeys(self.partition, 0)
        for r in sim.records:
            if isinstance(r, TraceRequest) and r.model in counts:
                counts[r.model] += 1
        return sorted(counts, key=lambda m: (-counts[m], m))
