"""The `vllm` executor: whole-model weights through vLLM's sleep mode; KV through LMCache.

Followed: vLLM docs "Sleep Mode" (docs.vllm.ai/en/latest/features/sleep_mode) and
the dev-mode router (`vllm/entrypoints/serve/sleep/api_router.py`, enabled with
`VLLM_SERVER_DEV_MODE=1` and `--enable-sleep-mode`): `POST /sleep?level=1|2`,
`POST /wake_up?tags=weights` (repeatable `tags`, none = everything),
`GET /is_sleeping`, and `POST /collective_rpc {"method": "reload_weights"}` to
load weights in place after a level-2 sleep.

Mapping (one engine per model, `engines: {model: url}`):
  * weights GPU -> host:           `POST /sleep?level=1`  (weights backed up in host RAM, KV discarded)
  * weights GPU -> NVMe / drop:    `POST /sleep?level=2`  (weights discarded; the NVMe copy remains)
  * weights host -> GPU:           `POST /wake_up?tags=weights`, then `POST /wake_up?tags=kv_cache`
  * weights NVMe -> GPU:           `POST /wake_up?tags=weights`, `POST /collective_rpc` reload_weights,
                                   `POST /wake_up?tags=kv_cache`
  * KV:                            delegated to LMCache when configured (DESIGN.md §5), else not possible
  * experts:                       not possible: vLLM cannot offload part of a MoE's experts at run time
vLLM's /sleep takes a `level`, not `tags`: DESIGN.md's `POST /sleep?tags=kv_cache` for a KV drop is not
an endpoint of vLLM, so a KV drop goes to LMCache's `/clear` as well.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

from clients.agent.errors import CapabilityError, PermanentError
from clients.agent.executors.base import Telemetry
from clients.agent.executors.engine_http import EngineHttp, EngineRequest
from clients.agent.executors.lmcache import LMCacheExecutor
from clients.agent.operations import Action, Capability, Kind, Operation, Outcome, Tier
from clients.agent.probes import GpuProbe, NullProbe, default_probe
from planner_service.wire.enums import EngineKind, EngineStatus

if TYPE_CHECKING:
    from clients.agent.config import AgentConfig

WAKE_WEIGHTS = EngineRequest("/wake_up", params={"tags": "weights"})
WAKE_KV_CACHE = EngineRequest("/wake_up", params={"tags": "kv_cache"})  # the engine serves only with its KV pool
RELOAD_WEIGHTS = EngineRequest("/collective_rpc", json={"method": "reload_weights"})
SLEEP_1 = EngineRequest("/sleep", params={"level": 1})
SLEEP_2 = EngineRequest("/sleep", params={"level": 2})


class VLLMExecutor:
    def __init__(
        self,
        engines: dict[str, str],
        *,
        http: EngineHttp | None = None,
        lmcache: LMCacheExecutor | None = None,
        probe: GpuProbe | None = None,
    ):
        self.engine_urls = dict(engines)
        self._http = http or EngineHttp()
        self.lmcache = lmcache
        self.probe = probe or NullProbe()  # device memory before/after: what the engine really freed
        self.capabilities = frozenset({Capability.WEIGHTS_OFFLOAD} | ({Capability.KV_OFFLOAD} if lmcache else set()))

    @classmethod
    def from_config(cls, config: AgentConfig, http_client: httpx.AsyncClient | None = None) -> VLLMExecutor:
        http = EngineHttp(timeout_seconds=config.engine_timeout_seconds, http_client=http_client)
        lmcache = LMCacheExecutor(config.lmcache, http=http) if config.lmcache else None
        return cls(config.engines, http=http, lmcache=lmcache, probe=default_probe(config.gpu_devices()))

    def requests_for(self, op: Operation) -> list[EngineRequest]:
        kind, src, dst = op.object.kind, op.source, op.dest
        if kind is Kind.EXPERTS:
            raise CapabilityError(
                Capability.PARTIAL_EXPERTS, "vLLM cannot offload part of a MoE's routed experts at run time"
            )
        if kind is Kind.KV:
            if self.lmcache is None:
                raise CapabilityError(
                    Capability.KV_OFFLOAD, "vLLM moves a session's KV only through LMCache; configure `lmcache`"
                )
            return self.lmcache.requests_for(op)
        if src is not None and src.tier is Tier.GPU and (op.action is Action.DROP or dst is None):
            return [SLEEP_2]
        if src is not None and src.tier is Tier.GPU and dst is not None:
            return [SLEEP_1] if dst.tier is Tier.HOST else [SLEEP_2]
        if dst is not None and dst.tier is Tier.GPU and src is not None:
            return (
                [WAKE_WEIGHTS, WAKE_KV_CACHE]
                if src.tier is Tier.HOST
                else [WAKE_WEIGHTS, RELOAD_WEIGHTS, WAKE_KV_CACHE]
            )
        raise CapabilityError(
            Capability.WEIGHTS_OFFLOAD,
            f"vLLM keeps host weights only as the backup of a level-1 sleep; it cannot {op.action.value} "
            f"{op.object.label()} from {src.label() if src else 'nothing'} to {dst.label() if dst else 'nothing'}",
        )

    async def execute(self, op: Operation) -> Outcome:
        requests = self.requests_for(op)
        if op.object.kind is Kind.KV and self.lmcache is not None:
            return await self._http.run("lmcache", self.lmcache.config.url, requests)
        url = self.engine_urls.get(op.object.model)
        if url is None:
            raise PermanentError(
                f"no vLLM engine configured for model {op.object.model!r}; engines: {sorted(self.engine_urls)}"
            )
        return await self._http.run(f"vllm[{op.object.model}]", url, requests, op=op, probe=self.probe)

    def telemetry(self) -> Telemetry:
        return Telemetry(engines={f"vllm-{m}": EngineStatus.CONFIGURED for m in self.engine_urls})

    def engines(self) -> list[dict[str, Any]]:
        return [
            {"name": f"vllm-{m}", "kind": EngineKind.VLLM, "models": [m], "url": u}
            for m, u in sorted(self.engine_urls.items())
        ]

    async def aclose(self) -> None:
        await self._http.aclose()
