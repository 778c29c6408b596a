"""What LMCache's write-through of a prompt's KV to host DRAM stores, and what it costs the engine.

How LMCache stores KV from vLLM (LMCache `lmcache/integration/vllm/vllm_v1_adapter.py`, the
`LMCacheConnectorV1Impl` that vLLM's `LMCacheConnectorV1` wraps; config defaults from `lmcache/v1/config.py`):

* **When**: vLLM calls the connector's `wait_for_save()` as each model step's forward ends, before the step's
  output is returned (`_get_kv_connector_output` in vLLM `vllm/v1/worker/kv_connector_model_runner_mixin.py`).
  Not layer by layer: `save_kv_layer` returns at once unless `use_layerwise` (default False), and
  `wait_for_save` then calls `LMCacheEngine.store` (`lmcache/v1/cache_engine.py`) for every request of the step.
* **Blocking**: `store` copies each 256-token chunk (`chunk_size`, default 256) out of vLLM's paged KV with
  `VLLMPagedMemGPUConnectorV2.from_gpu` (`lmcache/v1/gpu_connector/gpu_connectors.py`), which waits on its
  store stream (`self.store_stream.synchronize()`) whenever the destination is a CPU buffer, before
  `storage_manager.batched_put` registers the chunks with the local CPU backend. The step, and so the
  prefill that produced the KV and whatever the engine runs next on those cards, waits for the D2H copy.
  vLLM's docstring says as much: "Blocking until the KV cache is saved to the connector buffer."
* **What**: the prompt's tokens beyond those LMCache already held for it (`skip_leading_tokens`, the
  request's LMCache hit), in whole chunks: the last partial chunk is dropped (`save_unfull_chunk`, default
  False, makes `discard_partial_chunks` true in `ReqMeta.from_request_tracker`). Tokens generated in decode
  are not stored (`save_decode_cache`, default False): the next turn's prompt carries them, and its prefill
  stores them.
* **Where**: each tensor-parallel worker stores its own shard of the KV heads from its own card, so the
  cards' D2H links copy in parallel.

The cost, charged to the prefill that produced the KV (its first token and its cards wait for it):

    bytes [B]      = (⌊prompt / 256⌋ × 256 − tokens already in host DRAM) [tokens] × kv_bytes_per_token [B]
    t_save [s]     = max over the group's cards i of  shard_i [B] / d2h_i [B/s]
    shard_i        = the group's even split of `bytes` (`greedy.split_evenly`)

The copy runs at each card's whole D2H rate (`GPU.d2h_bytes_per_s`): it is not slowed by, and does not slow,
other transfers on the same link in the replay (`cluster.py`'s processor sharing covers the sleeps, demotes
and restores only).
"""

from __future__ import annotations

from collections.abc import Sequence

from planner_service.domain.problem import Gpu
from planner_service.planner.greedy import split_evenly

CHUNK_TOKENS = 256  # LMCache `chunk_size` default (lmcache/v1/config.py)


def saved_tokens(prompt_tokens: int) -> int:
    """The prompt's tokens LMCache stores: whole chunks only (module doc)."""
    return prompt_tokens // CHUNK_TOKENS * CHUNK_TOKENS


def save_seconds(nbytes: int, gpus: Sequence[Gpu]) -> float:
    """Seconds the engine's step waits for `nbytes` of KV copied to host DRAM, sharded over the group's cards."""
    if nbytes <= 0 or not gpus:
        return 0.0
    return max(b / g.d2h_bytes_per_s for g, b in zip(gpus, split_evenly(nbytes, len(gpus)), strict=True))
