"""`swap-ttl`: llama-swap / Ollama in front of engines on configured groups: a model's engine starts on
its group when a request needs it, stops when another engine of the group needs the room (the least
recently used first) or after a keep-alive with no request, and every start is a real restart.

What it models:

* **Configured groups** (`groups.py`): llama-swap's `groups` with `swap: true` run one member at a time
  and `swap: false` all members together (mostlygeek/llama-swap, docs/config.example.yaml); here models
  sharing a group run together while they fit and the least recently used stops when they do not.
* **A real restart**: an engine that leaves its GPUs is stopped (llama-swap sends SIGTERM to the
  upstream process, same file; Ollama unloads the model), so its next request pays a cold start from the
  engine model (`cold_start_fixed_seconds` plus the copy of the weights), never a wake.
* **Keep-alive**: an engine idle for `keep_alive_seconds` stops. Ollama's default `keep_alive` is 5
  minutes (ollama/ollama, docs/faq.md: "By default models are kept in memory for 5 minutes before being
  unloaded"); llama-swap's per-model `ttl` has no default unload (0: never), so 300 s is the Ollama case.
* KV is written through to host DRAM (LMCache), as for every baseline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner_service.sim.policies.base import PolicyName
from planner_service.sim.policies.groups import FixedGroupsPolicy, Partition
from planner_service.sim.policies.lru import OLLAMA_KEEP_ALIVE_SECONDS, unload_idle

if TYPE_CHECKING:
    from planner_service.sim.view import SimView


class SwapTtlPolicy(FixedGroupsPolicy):
    name = PolicyName.SWAP_TTL
    sleeps_engines = False  # a stopped process, not a sleeping one

    def __init__(
        self, partition: Partition | None = None, keep_alive_seconds: float = OLLAMA_KEEP_ALIVE_SECONDS
    ) -> None:
        super().__init__(partition)
        self.keep_alive_seconds = keep_alive_seconds

    def on_tick(self, sim: SimView) -> None:
        """Stop engines idle for longer than the keep-alive (checked every engine tick)."""
        unload_idle(sim, self.act, self.keep_alive_seconds)
