"""The `sglang` executor: the engine model's transitions through SGLang's memory saver.

SGLang's source (sgl-project/sglang) that each call rests on:
  * sleep: drain first. `release_memory_occupation` asserts that no request runs or waits
    (python/sglang/srt/managers/scheduler_update_weights_mixin.py), and a failed assertion takes the server
    down. So the agent polls `GET /get_load` (`num_reqs`, `num_waiting_reqs`; http_server.py) until the
    engine is idle, within the engine's `drain_timeout_seconds` (else a temporary error: the planner may try
    again), then `POST /pause_generation {"mode": "in_place"}` (its default, abort, kills running requests;
    io_struct.py `PauseGenerationReqInput`), reads the load once more (a request that slipped in means
    `continue_generation` and a temporary error), then `POST /release_memory_occupation {"tags": ["weights",
    "kv_cache"]}`. Generation stays paused while the engine sleeps, so new requests wait instead of failing.
  * level: released weights stay in host RAM only with `--enable-weights-cpu-backup` (feature `cpu_backup`:
    level 1); without it they are discarded (level 2) (python/sglang/srt/server_args.py).
  * wake: `POST /resume_memory_occupation` with the same tags; without the CPU backup
    `POST /update_weights_from_disk {"model_path": ...}` reads the checkpoint again (so `model_path` is required
    in the configuration); then `POST /continue_generation`.
  * state: `GET /health`, `GET /get_model_info` (`model_path`). SGLang has no query for "released": the sleep
    this agent sent is what it knows; after its own restart it reads an answering engine as running and says so.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import httpx

from clients.agent.errors import TemporaryError
from clients.agent.executors.engine import EngineExecutor, EngineHandle, Observation
from clients.agent.executors.engine_http import EngineHttp, EngineRequest, json_or_none
from clients.agent.probes import GpuProbe
from planner_service.domain.engines import EngineFeature, EngineKind, EngineState

if TYPE_CHECKING:
    from clients.agent.config import AgentConfig

HEALTH = EngineRequest("/health", method="GET")
MODEL_INFO = EngineRequest("/get_model_info", method="GET")
LOAD = EngineRequest("/get_load", method="GET")
PAUSE_IN_PLACE = EngineRequest("/pause_generation", json={"mode": "in_place"})
CONTINUE = EngineRequest("/continue_generation", json={})
MEMORY_TAGS = ["weights", "kv_cache"]
RELEASE = EngineRequest("/release_memory_occupation", json={"tags": MEMORY_TAGS})
RESUME = EngineRequest("/resume_memory_occupation", json={"tags": MEMORY_TAGS})


def _label(request: EngineRequest) -> str:
    return f"{request.method} {request.path}"


class SglangDriver:
    kind = EngineKind.SGLANG

    def check(self, engine: EngineHandle) -> list[str]:
        return [] if engine.config.model_path else ["model_path: SGLang's reload reads the checkpoint from it"]

    async def _load(self, http: EngineHttp, engine: EngineHandle) -> int:
        ranks = json_or_none(await http.call(engine.name, engine.url, LOAD)) or []
        ranks = ranks if isinstance(ranks, list) else [ranks]
        return sum(int(r.get("num_reqs", 0)) + int(r.get("num_waiting_reqs", 0)) for r in ranks if isinstance(r, dict))

    async def observe(self, http: EngineHttp, engine: EngineHandle) -> Observation:
        await http.call(engine.name, engine.url, HEALTH)
        info = json_or_none(await http.call(engine.name, engine.url, MODEL_INFO)) or {}
        note = ""
        if engine.config.model_path and info.get("model_path") not in (engine.config.model_path, engine.model):
            note = f"serves {info.get('model_path')!r}, not {engine.config.model_path!r}"
        if engine.level in (1, 2):
            state = EngineState.ASLEEP_HOST if engine.level == 1 else EngineState.ASLEEP_DISCARDED
            return Observation(state, note=note)
        if engine.level is None:
            note = "; ".join(n for n in (note, "released or not is not queryable on SGLang: taken as running") if n)
        return Observation(EngineState.RUNNING, in_flight=await self._load(http, engine), note=note)

    async def drain(self, http: EngineHttp, engine: EngineHandle) -> list[str]:
        deadline = time.monotonic() + engine.config.drain_timeout_seconds
        while (busy := await self._load(http, engine)) > 0:
            if time.monotonic() > deadline:
                raise TemporaryError(
                    f"{engine.name}: {busy} request(s) still in flight after {engine.config.drain_timeout_seconds:g} s"
                )
            await asyncio.sleep(0.2)
        return [_label(LOAD)]

    async def sleep(self, http: EngineHttp, engine: EngineHandle, level: int) -> list[str]:
        await http.call(engine.name, engine.url, PAUSE_IN_PLACE)
        busy = await self._load(http, engine)
        if busy:
            await http.call(engine.name, engine.url, CONTINUE)
            raise TemporaryError(f"{engine.name}: {busy} request(s) arrived during the drain; not released")
        await http.call(engine.name, engine.url, RELEASE)
        engine.level = level
        return [_label(PAUSE_IN_PLACE), _label(LOAD), _label(RELEASE)]

    async def wake(self, http: EngineHttp, engine: EngineHandle, *, reload: bool) -> list[str]:
        requests = [RESUME]
        if not engine.has(EngineFeature.CPU_BACKUP):  # the release discarded the weights
            requests.append(EngineRequest("/update_weights_from_disk", json={"model_path": engine.config.model_path}))
        requests.append(CONTINUE)
        for request in requests:
            await http.call(engine.name, engine.url, request)
        return [_label(r) for r in requests]


class SGLangExecutor(EngineExecutor):
    @classmethod
    def from_config(
        cls, config: AgentConfig, http_client: httpx.AsyncClient | None = None, probe: GpuProbe | None = None
    ) -> EngineExecutor:
        return EngineExecutor.build(SglangDriver(), config, http_client=http_client, probe=probe)
