"""The `vllm` executor: the engine model's transitions through vLLM's sleep-mode endpoints.

vLLM's source (vllm-project/vllm) that each call rests on:
  * `POST /sleep?level=1|2&mode=wait`: level 1 offloads the weights to pinned host RAM and frees the KV pool,
    level 2 discards both; `mode` defaults to abort (running requests killed), so the agent sends `wait`,
    which drains them first (vllm/entrypoints/serve/sleep/api_router.py, vllm/v1/worker/gpu_worker.py).
  * wake: `POST /wake_up?tags=weights`, then after a level-2 sleep (or one this agent did not see: `/is_sleeping`
    does not tell the level) `POST /collective_rpc {"method": "reload_weights"}` to read the checkpoint again,
    then `POST /wake_up?tags=kv_cache` (vllm/entrypoints/serve/rpc/api_router.py, docs/features/sleep_mode.md).
    The wake frees the host backup (vllm/device_allocator/cumem.py), also when it fails for want of GPU memory
    (the backups copied back before the failure are gone), so after a failed wake the next one reloads.
  * state: `GET /health` (503 once the engine died), `GET /is_sleeping`, `GET /v1/models`.
  * drain before a stop: `GET /metrics`' `vllm:num_requests_running` and `vllm:num_requests_waiting`
    (vllm/v1/metrics/loggers.py), polled until both are 0.
The sleep endpoints exist only with `VLLM_SERVER_DEV_MODE=1` and work only with `--enable-sleep-mode`: an engine
configured without the features `dev_mode` and `sleep_mode` is refused its sleeps by the engine model's
preconditions, saying which flag is missing.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import httpx

from clients.agent.errors import PermanentError, TemporaryError
from clients.agent.executors.engine import EngineExecutor, EngineHandle, Observation
from clients.agent.executors.engine_http import EngineHttp, EngineRequest, json_or_none
from clients.agent.probes import GpuProbe
from planner_service.domain.engines import EngineKind, EngineState

if TYPE_CHECKING:
    from clients.agent.config import AgentConfig

HEALTH = EngineRequest("/health", method="GET")
IS_SLEEPING = EngineRequest("/is_sleeping", method="GET")
MODELS = EngineRequest("/v1/models", method="GET")
METRICS = EngineRequest("/metrics", method="GET")
WAKE_WEIGHTS = EngineRequest("/wake_up", params={"tags": "weights"})
WAKE_KV_CACHE = EngineRequest("/wake_up", params={"tags": "kv_cache"})
RELOAD_WEIGHTS = EngineRequest("/collective_rpc", json={"method": "reload_weights"})
QUEUE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def sleep_request(level: int) -> EngineRequest:
    return EngineRequest("/sleep", params={"level": level, "mode": "wait"})


def _label(request: EngineRequest) -> str:
    query = "&".join(f"{k}={v}" for k, v in request.params.items())
    return f"{request.method} {request.path}" + (f"?{query}" if query else "")


def requests_in_flight(metrics_text: str) -> int:
    """Running + waiting requests from vLLM's Prometheus text (`vllm:num_requests_running{...} 2.0`)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(QUEUE_GAUGES):
            total += float(line.rsplit(" ", 1)[-1])
    return int(total)


class VllmDriver:
    kind = EngineKind.VLLM

    def check(self, engine: EngineHandle) -> list[str]:
        return []  # a missing feature is the engine model's refusal, per transition, with the flag it needs

    async def observe(self, http: EngineHttp, engine: EngineHandle) -> Observation:
        await http.call(engine.name, engine.url, HEALTH)
        note = ""
        served = json_or_none(await http.call(engine.name, engine.url, MODELS)) or {}
        ids = [m.get("id") for m in served.get("data", []) if isinstance(m, dict)]
        if engine.model not in ids:
            note = f"serves {ids}, not {engine.model!r}"
        try:
            body = json_or_none(await http.call(engine.name, engine.url, IS_SLEEPING)) or {}
        except PermanentError:  # 404: no dev mode, so it cannot have been put to sleep
            return Observation(EngineState.RUNNING, note=note or "no /is_sleeping (VLLM_SERVER_DEV_MODE unset)")
        if not body.get("is_sleeping"):
            return Observation(EngineState.RUNNING, note=note)
        if engine.level == 1:
            return Observation(EngineState.ASLEEP_HOST, note=note)
        # the level is not queryable: without this agent's own sleep, assume nothing sits in host RAM
        why = "" if engine.level == 2 else "asleep at an unknown level: its wake reloads the weights"
        return Observation(EngineState.ASLEEP_DISCARDED, note="; ".join(n for n in (note, why) if n))

    async def sleep(self, http: EngineHttp, engine: EngineHandle, level: int) -> list[str]:
        request = sleep_request(level)
        await http.call(engine.name, engine.url, request)
        engine.level = level
        return [_label(request)]

    async def wake(self, http: EngineHttp, engine: EngineHandle, *, reload: bool) -> list[str]:
        # a wake that fails part way (CUDA out of memory) has freed the host backup of each allocation it copied
        # back before failing (cumem.py `wake_up`): until a wake succeeds, the level is not known, and the
        # next wake reloads the weights
        engine.level = None
        requests = [WAKE_WEIGHTS, *([RELOAD_WEIGHTS] if reload else []), WAKE_KV_CACHE]
        for request in requests:
            await http.call(engine.name, engine.url, request)
        return [_label(r) for r in requests]

    async def drain(self, http: EngineHttp, engine: EngineHandle) -> list[str]:
        deadline = time.monotonic() + engine.config.drain_timeout_seconds
        while True:
            response = await http.call(engine.name, engine.url, METRICS)
            if requests_in_flight(response.text) == 0:
                return [_label(METRICS)]
            if time.monotonic() > deadline:
                raise TemporaryError(
                    f"{engine.name}: requests still running after {engine.config.drain_timeout_seconds:g} s of drain"
                )
            await asyncio.sleep(0.2)


class VLLMExecutor(EngineExecutor):
    @classmethod
    def from_config(
        cls, config: AgentConfig, http_client: httpx.AsyncClient | None = None, probe: GpuProbe | None = None
    ) -> EngineExecutor:
        return EngineExecutor.build(VllmDriver(), config, http_client=http_client, probe=probe)
