"""`lru`: load on demand, evict the least recently used, unload after a keep-alive (Ollama, llama-swap)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner_service.domain.state import Kind, Location, StateObject
from planner_service.sim.policies.base import Policy, PolicyName

if TYPE_CHECKING:
    from planner_service.sim.executor import Executor
    from planner_service.sim.view import SimView

OLLAMA_KEEP_ALIVE_SECONDS = 300.0  # Ollama's default keep_alive (docs/faq.md): 5 minutes


class LruPolicy(Policy):
    """Weights come from host DRAM or NVMe on demand onto the smallest group that fits; KV written through."""

    name = PolicyName.LRU

    def __init__(self, keep_alive_seconds: float = OLLAMA_KEEP_ALIVE_SECONDS) -> None:
        self.keep_alive_seconds = keep_alive_seconds

    def on_tick(self, sim: SimView) -> None:
        """Unload models idle for longer than the keep-alive (checked every engine tick)."""
        unload_idle(sim, self.act, self.keep_alive_seconds)


def unload_idle(sim: SimView, act: Executor, keep_alive_seconds: float) -> None:
    """Take every ready model with no request waiting and none for `keep_alive_seconds` off its GPUs: its
    KV and experts there, then its weights (Ollama's keep-alive, llama-swap's `ttl`)."""
    for model_id, state in sorted(sim.models.items()):
        obj = StateObject.weights(model_id, state.precision)
        if state.status != "ready" or sim.demand.get(model_id):
            continue
        if sim.now - sim.last_used.get(obj, 0.0) < keep_alive_seconds:
            continue
        for g in state.gpus:
            loc = Location.gpu(g.id)
            for other in list(sim.cluster.objects_at(loc)):
                if other.model == model_id and other.kind is not Kind.WEIGHTS:
                    act.evict(other, loc)
        act.evict(obj, Location.gpu(state.gpus[0].id))


class LruNoKvPolicy(LruPolicy):
    """Ablation: `lru` without KV write-through (a model's KV is dropped with it)."""

    name = PolicyName.LRU_NOKV
    kv_offload = False
