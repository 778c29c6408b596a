"""The `sglang` executor: weights through SGLang's memory saver; a KV drop through its cache flush.

Followed: SGLang docs "SGLang for RL Systems" (fine-grained engine sleep and wake up,
docs.sglang.io/advanced_features/sglang_for_rl) and "SGLang Native APIs"
(docs.sglang.io/basic_usage/native_api; `http_server.py`): `POST /release_memory_occupation`
and `POST /resume_memory_occupation` with `{"tags": ["weights"]}` (`--enable-memory-saver`),
`POST /update_weights_from_disk {"model_path": ...}`, `POST /flush_cache`.

Mapping (one engine per model, `engines: {model: url}`; `model_paths: {model: path}`):
  * weights GPU -> NVMe / drop:    `POST /release_memory_occupation {"tags": ["weights"]}`
  * weights host|NVMe -> GPU:      `POST /resume_memory_occupation {"tags": ["weights"]}`,
                                   `POST /update_weights_from_disk {"model_path": ...}`
  * weights GPU -> host:           not possible: release discards the weights, nothing stays in host RAM
  * KV drop on GPU:                `POST /flush_cache` (SGLang flushes its whole radix cache)
  * KV moves:                      not possible over HTTP: HiCache moves KV between tiers by itself
  * experts:                       not possible: no run-time partial offload of routed experts
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

from clients.agent.errors import CapabilityError, PermanentError
from clients.agent.executors.base import Telemetry
from clients.agent.executors.engine_http import EngineHttp, EngineRequest
from clients.agent.operations import Action, Capability, Kind, Operation, Outcome, Tier
from clients.agent.probes import GpuProbe, NullProbe, default_probe
from planner_service.wire.enums import EngineKind, EngineStatus

if TYPE_CHECKING:
    from clients.agent.config import AgentConfig

RELEASE_WEIGHTS = EngineRequest("/release_memory_occupation", json={"tags": ["weights"]})
RESUME_WEIGHTS = EngineRequest("/resume_memory_occupation", json={"tags": ["weights"]})
FLUSH_CACHE = EngineRequest("/flush_cache")


class SGLangExecutor:
    capabilities: frozenset[Capability] = frozenset()  # none of the planner's partial moves

    def __init__(
        self,
        engines: dict[str, str],
        *,
        model_paths: dict[str, str] | None = None,
        http: EngineHttp | None = None,
        probe: GpuProbe | None = None,
    ):
        self.engine_urls = dict(engines)
        self.model_paths = dict(model_paths or {})
        self._http = http or EngineHttp()
        self.probe = probe or NullProbe()  # device memory before/after: what the engine really freed

    @classmethod
    def from_config(cls, config: AgentConfig, http_client: httpx.AsyncClient | None = None) -> SGLangExecutor:
        http = EngineHttp(timeout_seconds=config.engine_timeout_seconds, http_client=http_client)
        return cls(config.engines, model_paths=config.model_paths, http=http, probe=default_probe(config.gpu_devices()))

    def requests_for(self, op: Operation) -> list[EngineRequest]:
        kind, src, dst = op.object.kind, op.source, op.dest
        if kind is Kind.EXPERTS:
            raise CapabilityError(
                Capability.PARTIAL_EXPERTS, "SGLang cannot offload part of a MoE's experts at run time"
            )
        dropping = op.action is Action.DROP or dst is None
        if kind is Kind.KV:
            if dropping and src is not None and src.tier is Tier.GPU:
                return [FLUSH_CACHE]
            if src is None and dst is not None:
                return []  # created by prefill: the engine computes it on the session's next request
            raise CapabilityError(
                Capability.KV_OFFLOAD, "SGLang's HiCache moves KV by itself; no HTTP call moves one session's KV"
            )
        if src is not None and src.tier is Tier.GPU and (dropping or (dst is not None and dst.tier is Tier.NVME)):
            return [RELEASE_WEIGHTS]
        if dst is not None and dst.tier is Tier.GPU and src is not None:
            path = self.model_paths.get(op.object.model, op.object.model)
            return [RESUME_WEIGHTS, EngineRequest("/update_weights_from_disk", json={"model_path": path})]
        raise CapabilityError(
            Capability.WEIGHTS_OFFLOAD,
            f"SGLang's release discards weights (no host copy); it cannot {op.action.value} {op.object.label()} "
            f"from {src.label() if src else 'nothing'} to {dst.label() if dst else 'nothing'}",
        )

    async def execute(self, op: Operation) -> Outcome:
        requests = self.requests_for(op)
        url = self.engine_urls.get(op.object.model)
        if url is None:
            raise PermanentError(
                f"no SGLang engine configured for model {op.object.model!r}; engines: {sorted(self.engine_urls)}"
            )
        return await self._http.run(f"sglang[{op.object.model}]", url, requests, op=op, probe=self.probe)

    def telemetry(self) -> Telemetry:
        return Telemetry(engines={f"sglang-{m}": EngineStatus.CONFIGURED for m in self.engine_urls})

    def engines(self) -> list[dict[str, Any]]:
        return [
            {"name": f"sglang-{m}", "kind": EngineKind.SGLANG, "models": [m], "url": u}
            for m, u in sorted(self.engine_urls.items())
        ]

    async def aclose(self) -> None:
        await self._http.aclose()
