"""`independent`: one engine per model on dedicated GPUs, partitioned up front by demand share.

Each model gets the fewest GPUs of one node that hold its weights (largest
models first, on the node with the most room); on a node that declares the
model's engine on fixed GPUs, that group is the only one it may get there.
The GPUs left over go to the other models by their share of the trace's
requests (largest remainder), on the node of their partition (a declared
group does not widen). A model's KV pool is its partition. A model that
gets no partition shares the one of the model it fits with (a time-shared
engine pair). Loads and evictions stay inside a partition; no coordination
across models. When a partition is too small for one request's KV, the model
borrows GPUs outside it (counted as a fallback load).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from planner_service.domain.state import Location
from planner_service.sim.policies.base import Policy, PolicyName
from planner_service.sim.trace import TraceRequest

if TYPE_CHECKING:
    from planner_service.sim.state import SimRequest
    from planner_service.sim.view import SimView


class IndependentPolicy(Policy):
    name = PolicyName.INDEPENDENT

    def __init__(self) -> None:
        self.partition: dict[str, set[str]] = {}

    def place(self, sim: SimView) -> None:
        p = sim.problem
        counts = Counter(r.model for r in sim.records if isinstance(r, TraceRequest) and r.model in p.models)
        total = sum(counts.values()) or 1
        share = {m: counts.get(m, 0) / total for m in p.models}
        free = {n: sorted(node.gpus, key=lambda g: (-p.gpus[g].capacity_bytes, g)) for n, node in p.nodes.items()}
        node_of: dict[str, str] = {}
        order = sorted(p.models.values(), key=lambda m: (share[m.id] == 0, -m.weights_bytes[m.preferred], m.id))
        for model in order:
            nbytes = model.weights_bytes[model.preferred]
            best = None
            for node_id in sorted(free, key=lambda n: (-len(free[n]), n)):
                gpus = free[node_id]
                fixed = p.nodes[node_id].engine_gpus.get(model.id)
                groups = [list(fixed)] if fixed else [gpus[:k] for k in range(1, len(gpus) + 1)]
                for group in groups:
                    k = len(group)
                    if (
                        set(group) <= set(gpus)
                        and k >= max(model.min_gpus.get(p.gpus[g].type, 1) for g in group)
                        and all(math.ceil(nbytes / k) <= p.gpus[g].capacity_bytes for g in group)
                    ):
                        if best is None or k < len(best[1]):
                            best = (node_id, group)
                        break
            if best is not None:
                node_id, group = best
                self.partition[model.id] = set(group)
                node_of[model.id] = node_id
                free[node_id] = [g for g in free[node_id] if g not in group]
        # leftover GPUs by demand share, on the node of each model's partition (its engine may widen there)
        for node_id, gpus in sorted(free.items()):
            owners = [
                m for m in sorted(self.partition) if node_of[m] == node_id and not p.nodes[node_id].engine_gpus.get(m)
            ]
            for g in gpus:
                if not owners:
                    break
                want = max(owners, key=lambda m: (share[m] / (len(self.partition[m]) + 1), m))
                self.partition[want].add(g)
        # models with no partition share the partition they fit in, the least demanded first
        for model_id in sorted(p.models):
            if model_id in self.partition:
                continue
            for other in sorted(self.partition, key=lambda m: (share[m], m)):
                if sim.choose_group(model_id, self._within(self.partition[other])) is not None:
                    self.partition[model_id] = self.partition[other]
                    break
            else:
                self.partition[model_id] = set(p.gpus)
        # each engine starts with its model loaded
        for model_id in sorted(self.partition, key=lambda m: -share[m]):
            choice = sim.choose_group(model_id, self.allowed(sim, model_id))
            if choice is not None and model_id not in sim.models:
                node_id, precision, gpu_group = choice
                shard = -(-p.models[model_id].weights_bytes[precision] // len(gpu_group))
                if all(sim.cluster.free(Location.gpu(g.id)) >= shard for g in gpu_group):
                    self.act.place_now(model_id, node_id, precision, gpu_group)

    def allowed(self, sim: SimView, model: str) -> Callable[[str], bool]:
        return self._within(self.partition.get(model, set()))

    @staticmethod
    def _within(gpus: set[str]) -> Callable[[str], bool]:
        return lambda gpu: gpu in gpus

    def ensure(self, sim: SimView, req: SimRequest) -> None:
        if req.model in sim.models:
            return
        if self.act.load_model(req.model, self.allowed(sim, req.model)):
            return
        mine = self.partition.get(req.model, set())
        busy = any(sim.running.get(m) and {g.id for g in st.gpus} & mine for m, st in sim.models.items()) or any(
            t.dest.id in mine for t in sim.cluster.transfers.values()
        )
        if not busy and self.act.load_model(req.model):
            self.act.count_fallback()  # the partition is too small for this request: borrow GPUs

    def on_model_ready(self, sim: SimView, model: str) -> None:
        state = sim.models[model]
        self.act.fill_experts(
            model, gpu_ids=sorted(g for g in self.partition.get(model, ()) if sim.problem.gpus[g].node == state.node)
        )
