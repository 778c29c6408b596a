"""The `lmcache` executor: a session's KV between GPU, host and disk through the LMCache controller.

Followed: LMCache docs, "LMCache Controller" (Clear, Pin, Move) and the
`examples/cache_controller/{move,pin,clear}` READMEs: `POST /move` with
`old_position` / `new_position` = `[instance_id, location]`, `tokens`, `copy`;
`POST /pin` with `instance_id`, `location`, `tokens`; `POST /clear` with
`instance_id`, `location`. Locations are LMCache backends (`LocalCPUBackend`
for host, `LocalDiskBackend` for NVMe).

LMCache names KV by token ids, not by session: `tokens_for` maps a KV object
to its token ids; without it the field is left out and the controller applies
the call to the whole location.

Mapping (GPU KV belongs to the engine, which stores to and retrieves from LMCache
itself on each prefill):
  * GPU -> host (demote):             `POST /pin` at the host location (the copy LMCache stored stays)
  * host <-> disk (promote / demote): `POST /move` (`copy` = keep_source)
  * host / disk -> GPU (promote):     `POST /pin` at the source (the engine loads it on the next prefill)
  * drop on host / disk:              `POST /clear`
  * created by prefill:               nothing to call (the engine prefills on the session's next request)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx

from clients.agent.errors import CapabilityError
from clients.agent.executors.base import Telemetry
from clients.agent.executors.engine_http import EngineHttp, EngineRequest
from clients.agent.operations import Action, Capability, Kind, Operation, Outcome, StateObject, Tier
from planner_service.wire.enums import EngineKind, EngineStatus

if TYPE_CHECKING:
    from clients.agent.config import AgentConfig, LMCacheConfig

TokensFor = Callable[[StateObject], list[int] | None]


class LMCacheExecutor:
    capabilities = frozenset({Capability.KV_OFFLOAD})

    def __init__(
        self,
        config: LMCacheConfig,
        *,
        http: EngineHttp | None = None,
        tokens_for: TokensFor | None = None,
    ) -> None:
        self.config = config
        self._http = http or EngineHttp()
        self._tokens_for = tokens_for or (lambda _obj: None)

    @classmethod
    def from_config(cls, config: AgentConfig, http_client: httpx.AsyncClient | None = None) -> LMCacheExecutor:
        if config.lmcache is None:
            raise ValueError("executor 'lmcache' needs `lmcache: {url: ..., instance_id: ...}` in the agent config")
        http = EngineHttp(timeout_seconds=config.engine_timeout_seconds, http_client=http_client)
        return cls(config.lmcache, http=http)

    def _location(self, tier: Tier) -> str:
        return self.config.host_location if tier is Tier.HOST else self.config.nvme_location

    def _with_tokens(self, body: dict[str, Any], op: Operation) -> dict[str, Any]:
        tokens = self._tokens_for(op.object)
        return body if tokens is None else {**body, "tokens": tokens}

    def requests_for(self, op: Operation) -> list[EngineRequest]:
        if op.object.kind is not Kind.KV:
            raise CapabilityError(
                Capability.WEIGHTS_OFFLOAD if op.object.kind is Kind.WEIGHTS else Capability.PARTIAL_EXPERTS,
                f"LMCache moves KV cache only, not {op.object.label()}",
            )
        inst = self.config.instance_id
        src, dst = op.source, op.dest
        if op.action is Action.DROP or dst is None:
            if src is None or src.tier is Tier.GPU:
                raise CapabilityError(Capability.KV_OFFLOAD, "LMCache cannot drop KV held by the engine on GPU")
            return [
                EngineRequest(
                    "/clear", json=self._with_tokens({"instance_id": inst, "location": self._location(src.tier)}, op)
                )
            ]
        if src is None:
            return []  # created by prefill: the engine computes it on the session's next request
        if src.tier is Tier.GPU:
            if dst.tier is Tier.NVME:
                raise CapabilityError(
                    Capability.KV_OFFLOAD, "LMCache stores GPU KV to host first; plan GPU -> host -> disk"
                )
            return [
                EngineRequest(
                    "/pin", json=self._with_tokens({"instance_id": inst, "location": self._location(Tier.HOST)}, op)
                )
            ]
        if dst.tier is Tier.GPU:
            return [
                EngineRequest(
                    "/pin", json=self._with_tokens({"instance_id": inst, "location": self._location(src.tier)}, op)
                )
            ]
        body = {
            "old_position": [inst, self._location(src.tier)],
            "new_position": [inst, self._location(dst.tier)],
            "copy": op.keep_source,
        }
        return [EngineRequest("/move", json=self._with_tokens(body, op))]

    async def execute(self, op: Operation) -> Outcome:
        return await self._http.run("lmcache", self.config.url, self.requests_for(op))

    def telemetry(self) -> Telemetry:
        return Telemetry(engines={"lmcache": EngineStatus.READY})

    def engines(self) -> list[dict[str, Any]]:
        return [{"name": "lmcache", "kind": EngineKind.LMCACHE, "url": self.config.url}]

    async def aclose(self) -> None:
        await self._http.aclose()
