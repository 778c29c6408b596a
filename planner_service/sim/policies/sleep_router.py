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

from planner_service.sim.policies.base import PolicyName
from planner_service.sim.policies.groups import FixedGroupsPolicy, launch_asleep, shards_fit_now

if TYPE_CHECKING:
    from planner_service.sim.view import SimView


class SleepRouterPolicy(FixedGroupsPolicy):
    name = PolicyName.SLEEP_ROUTER

    def place(self, sim: SimView) -> None:
        super().place(sim)
        order = self.demand_order(sim)
        for model_id in reversed(order):  # launch each engine once, then put it to sleep
            launch_asleep(sim, self, self.partition[model_id])
        for model_id in order:  # then wake the most requested that fit together
            engine = self.partition[model_id]
            if model_id not in sim.models and shards_fit_now(sim, engine):
                self.act.place_now(model_id, engine.node, engine.precision, engine.gpus)
