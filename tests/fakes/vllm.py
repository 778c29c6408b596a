"""A contract fake of a vLLM OpenAI-compatible server launched with `--enable-sleep-mode`.

Rules, each from vLLM's source (vllm-project/vllm, v1 engine):

- `POST /sleep`, `POST /wake_up`, `GET /is_sleeping` (vllm/entrypoints/serve/sleep/api_router.py),
  `POST /collective_rpc` (vllm/entrypoints/serve/rpc/api_router.py) and `POST /reset_prefix_cache`
  (vllm/entrypoints/serve/cache/api_router.py) are attached only when `VLLM_SERVER_DEV_MODE` is set
  (`attach_router` returns early otherwise): without dev mode they are 404.
- `/sleep` reads `level` (default "1") and `mode` (default "abort") from the query; `mode` is vLLM's
  `PauseMode`, one of abort, wait, keep (vllm/v1/engine/core.py): abort ends the running requests, wait
  lets them finish first.
- Level 1 offloads the allocations tagged "weights" to pinned host memory and discards the KV cache; level 2
  discards both (vllm/v1/worker/gpu_worker.py `sleep`: `offload_tags = ("weights",) if level == 1 else ()`).
  The CUDA context stays on every GPU.
- Every sleep first pauses the scheduler (vllm/v1/engine/core.py `sleep` calls `pause_scheduler`); level 0
  only pauses it and changes no GPU memory. A sleep of an executor that sleeps already changes nothing
  ("Executor is already sleeping.", vllm/v1/executor/abstract.py `sleep`): level 2 after level 1 keeps the
  host backup. `GET /is_sleeping` is true while the scheduler is paused or the executor sleeps
  (core.py `is_sleeping`).
- `/wake_up` takes repeatable `tags` (none: every tag; `scheduling` only resumes a level-0 pause). The
  executor wakes nothing when it is not asleep or when one of the tags is awake already (abstract.py
  `wake_up`), and stays asleep until every tag is awake; the scheduler resumes then (core.py `wake_up`).
  Waking an allocation maps GPU memory, copies its CPU backup back and frees the backup
  (vllm/device_allocator/cumem.py `wake_up`); waking weights that a level-2 sleep discarded maps fresh,
  uninitialised memory, so the model answers garbage until `POST /collective_rpc {"method":
  "reload_weights"}` reads the checkpoint again (docs/features/sleep_mode.md).
- A wake the device has no room for fails: `create_and_map` (cuMemCreate) raises CUDA out of memory, cumem.py
  unmaps what it mapped and re-raises, so the executor stays asleep and the route answers 500. The backups
  of the allocations copied back before the failure were freed and their memory unmapped: which ones is not
  known from outside, so the fake takes the case where any were, and the weights need a reload.
  (`reserve`, given by whoever keeps the device's books, says whether the bytes fit.)
- `/collective_rpc` without `method` is a 400 ("Missing 'method' in request body"); an unknown method fails on
  the workers (a 500 here).
- `/reset_prefix_cache` answers 200 without checking the reset (the router's docstring says so).
- Without `--enable-sleep-mode` a sleep fails on the workers, whose allocator is not the sleep-mode one
  (vllm/v1/worker/gpu_worker.py asserts sleep mode is enabled): a 500 here.
- `GET /health` is 200 while the engine lives, 503 once it is dead (vllm/entrypoints/serve/instrumentator/
  health.py); `GET /v1/models` lists the served model (vllm/entrypoints/openai/api_server.py); `GET /metrics`
  carries the scheduler's `vllm:num_requests_running` and `vllm:num_requests_waiting` (vllm/v1/metrics/loggers.py).

The OpenAI serving surface (`/v1/chat/completions` and the rest) is another module's router, included when
given (`serving_router`), so that this fake stays the engine's control plane.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import APIRouter, FastAPI, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse

SLEEP_MODES = ("abort", "wait", "keep")  # vLLM's PauseMode
TAGS = ("weights", "kv_cache")  # the CuMemAllocator tags a sleep frees
SCHEDULING = "scheduling"  # the wake-up tag of a level-0 pause (core.py `wake_up`)


class OutOfMemory(RuntimeError):
    """CUDA out of memory while mapping an allocation (cumem.py `create_and_map`)."""


@dataclass
class FakeVllmEngine:
    """The state of one vLLM instance (one process over its tensor-parallel group)."""

    model: str
    gpus: tuple[int, ...]  # device indices of the group
    shard_bytes: int  # weights per GPU
    kv_pool_bytes: int  # KV pool per GPU
    context_bytes: int = 512 * 1024 * 1024  # the CUDA context each GPU keeps while the process lives
    dev_mode: bool = True
    sleep_mode: bool = True
    pid: int = field(default_factory=os.getpid)
    # asked before a wake maps memory, with the bytes this process would hold on each device after it: why
    # the devices cannot take them (CUDA out of memory), or None once they are reserved; None: always room
    reserve: Callable[[dict[int, int]], str | None] | None = None
    # state
    level: int = 0  # the executor: 0 awake, else the level of the sleep it is in
    paused: bool = False  # the scheduler (every sleep pauses it; the last wake resumes it)
    weights_on_gpu: bool = True
    weights_valid: bool = True  # False after a level-2 sleep until reload_weights
    kv_on_gpu: bool = True
    host_backup_bytes: int = 0
    alive: bool = True
    in_flight: int = 0  # requests running now
    aborted: int = 0  # requests a sleep with mode=abort ended
    completed: int = 0  # requests a sleep with mode=wait let finish
    prefix_cache_resets: int = 0
    calls: list[str] = field(default_factory=list)

    @property
    def sleeping(self) -> bool:
        return self.paused or self.level > 0

    def gpu_bytes(self, *, weights: bool | None = None, kv: bool | None = None) -> dict[int, int]:
        """Bytes this process holds on each GPU of its group, as NVML would count them (with the weights or
        the KV pool on the GPU or not, where given, instead of as they are)."""
        if not self.alive:
            return {}
        weights = self.weights_on_gpu if weights is None else weights
        kv = self.kv_on_gpu if kv is None else kv
        per_gpu = self.context_bytes
        per_gpu += self.shard_bytes if weights else 0
        per_gpu += self.kv_pool_bytes if kv else 0
        return dict.fromkeys(self.gpus, per_gpu)

    def sleep(self, level: int, mode: str) -> None:
        if mode not in SLEEP_MODES:
            raise ValueError(f"mode {mode!r}: one of {SLEEP_MODES}")
        if level not in (0, 1, 2):
            raise ValueError(f"level {level}: 0, 1 or 2")
        if mode == "abort":
            self.aborted += self.in_flight
        else:
            self.completed += self.in_flight
        self.in_flight = 0
        self.paused = True
        if level == 0 or self.level > 0:  # a pause only, or an executor asleep already
            return
        if level == 1 and self.weights_on_gpu:
            self.host_backup_bytes = self.shard_bytes * len(self.gpus)
        if level == 2:
            self.host_backup_bytes = 0
            self.weights_valid = False
        self.weights_on_gpu = False
        self.kv_on_gpu = False
        self.level = level

    def wake_up(self, tags: list[str] | None) -> None:
        memory = [t for t in tags if t != SCHEDULING] if tags is not None else None
        if memory is None or memory:
            self._wake_executor(set(memory or TAGS))
        if self.level == 0:
            self.paused = False

    def _wake_executor(self, wanted: set[str]) -> None:
        asleep = {t for t, on_gpu in (("weights", self.weights_on_gpu), ("kv_cache", self.kv_on_gpu)) if not on_gpu}
        if self.level == 0 or not wanted <= asleep:
            return  # abstract.py: not sleeping, or a tag awake already: nothing is woken
        weights, kv = self.weights_on_gpu or "weights" in wanted, self.kv_on_gpu or "kv_cache" in wanted
        why = self.reserve(self.gpu_bytes(weights=weights, kv=kv)) if self.reserve is not None else None
        if why is not None:
            if "weights" in wanted:
                self.host_backup_bytes = 0  # the backups copied back before the failure are gone
            raise OutOfMemory(why)
        if "weights" in wanted:
            self.weights_on_gpu = True
            self.weights_valid = self.host_backup_bytes > 0
            self.host_backup_bytes = 0  # cumem.py frees the CPU backup once it is copied back
        if "kv_cache" in wanted:
            self.kv_on_gpu = True
        if self.weights_on_gpu and self.kv_on_gpu:
            self.level = 0

    def reload_weights(self) -> None:
        if not self.weights_on_gpu:
            raise RuntimeError("reload_weights: the weights' memory is not mapped (wake tags=weights first)")
        self.weights_valid = True

    def answers(self) -> bool:
        """Whether a request now gets a real answer: awake with weights that hold the model."""
        return self.alive and not self.sleeping and self.weights_on_gpu and self.weights_valid


def create_fake_vllm(
    engine: FakeVllmEngine, *, serving_router: Callable[[FakeVllmEngine], APIRouter] | None = None
) -> FastAPI:
    app = FastAPI(title=f"fake vLLM {engine.model}")

    @app.middleware("http")
    async def record(request: Request, call_next):  # type: ignore[no-untyped-def]  # Starlette's own callable type
        engine.calls.append(
            f"{request.method} {request.url.path}{'?' + request.url.query if request.url.query else ''}"
        )
        if not engine.alive:
            return Response(status_code=503)
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": engine.model, "object": "model", "owned_by": "vllm"}]}

    @app.get("/metrics")
    async def metrics() -> Response:  # the scheduler gauges of vllm/v1/metrics/loggers.py
        text = (
            f'vllm:num_requests_running{{model_name="{engine.model}"}} {float(engine.in_flight)}\n'
            f'vllm:num_requests_waiting{{model_name="{engine.model}"}} 0.0\n'
        )
        return Response(text, media_type="text/plain")

    dev = APIRouter()

    @dev.post("/sleep")
    async def sleep(request: Request) -> Response:
        level = int(request.query_params.get("level", "1"))
        mode = request.query_params.get("mode", "abort")
        if not engine.sleep_mode:
            raise HTTPException(500, "Sleep mode is not enabled (--enable-sleep-mode)")
        if mode == "wait":
            while engine.in_flight:  # the requests finish on their own; a test lowers `in_flight`
                await asyncio.sleep(0.01)
        try:
            engine.sleep(level, mode)
        except ValueError as error:
            raise HTTPException(500, str(error)) from error
        return Response(status_code=200)

    @dev.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        try:
            engine.wake_up(tags)
        except OutOfMemory as error:
            raise HTTPException(500, f"CUDA out of memory: {error}") from error
        return Response(status_code=200)

    @dev.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": engine.sleeping})

    @dev.post("/collective_rpc")
    async def collective_rpc(request: Request) -> Response:
        body = await request.json()
        method = body.get("method")
        if method is None:
            raise HTTPException(400, "Missing 'method' in request body")
        if method != "reload_weights":
            raise HTTPException(500, f"workers have no method {method!r}")
        try:
            engine.reload_weights()
        except RuntimeError as error:
            raise HTTPException(500, str(error)) from error
        return JSONResponse({"results": [None] * len(engine.gpus)})

    @dev.post("/reset_prefix_cache")
    async def reset_prefix_cache(
        reset_running_requests: bool = Query(default=False), reset_external: bool = Query(default=False)
    ) -> Response:
        engine.prefix_cache_resets += 1
        return Response(status_code=200)

    if engine.dev_mode:
        app.include_router(dev)
    if serving_router is not None:
        app.include_router(serving_router(engine))
    return app
