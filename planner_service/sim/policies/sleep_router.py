"""`sleep-router`: every model's engine pre-launched on its configured group, vLLM sleep mode, wake on
request, the least recently used engine on a group put to sleep when another needs the room (llama-swap
in front of vLLM engines launched with `--enable-sleep-mode`).

What it models, from the engines' behaviour (DESIGN.md section 5, `domain/engines.py`):

* **Pre-launched**: at t=0 every configured engine has started once (its cold start is paid before the
  trace) and sleeps; the most requested models that fit together on their groups are awake. An engine
  whose weights have no copy in host RAM at t=0 sleeps at level 2 (weights discarded: its wake reloads
  them from disk; these t=0 sleeps are counted among the run's engine transitions); once a load has
  staged them through host DRAM, its later sleeps are level 1 (vLLM's
  `POST /sleep?level=1` keeps them in pinned host RAM; `POST /wake_up` copies them back).
* **Wake on request**: a request for a sleeping model wakes its engine on its group (the engine model's
  wake cost plus the copy of the weights); it never starts a new configuration elsewhere.
* **LRU sleep under memory pressure**: room on a group is made by putting its least recently used other
  engine to sleep (its GPU KV is freed, its CUDA context stays; perf_anchors.md section 1).
* KV is written through to host DRAM (LMCache), as for every baseline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner_service.domain.state import Location, StateObject
from planner_service.sim.policies.base import PolicyName
from planner_service.sim.policies.groups import FixedGroupsPolicy, engine_fits

if TYPE_CHECKING:
    from planner_service.sim.view import SimView


class SleepRouterPolicy(FixedGroupsPolicy):
    name = PolicyName.SLEEP_ROUTER

    def place(self, sim: SimView) -> None:
        super().place(sim)
        order = self.demand_order(sim)
        for model_id in reversed(order):  # launch each engine once, then put it to sleep
            engine = self.partition[model_id]
            if not engine_fits(sim.problem, model_id, engine.node, engine.precision, engine.gpus):
                continue
            if self._room_for(sim, model_id):
                self.act.place_now(model_id, engine.node, engine.precision, engine.gpus)
                self.act.evict(StateObject.weights(model_id, engine.precision), Location.gpu(engine.gpus[0].id))
        for model_id in order:  # then wake the most requested that fit together
            engine = self.partition[model_id]
            if model_id not in sim.models and self._room_for(sim, model_id):
                self.act.place_now(model_id, engine.node, engine.precision, engine.gpus)

    def _room_for(self, sim: SimView, model_id: str) -> bool:
        """Whether the weights' shards fit in the group's free bytes and the residue their engine's wake frees."""
        engine = self.partition[model_id]
        shard = -(-sim.problem.models[model_id].weights_bytes[engine.precision] // len(engine.gpus))
        return all(sim.cluster.free(Location.gpu(g.id)) + sim.own_residue(model_id, g.id) >= shard for g in engine.gpus)
