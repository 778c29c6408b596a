"""A contract fake of an SGLang server (`python -m sglang.launch_server`).

Rules, each from SGLang's source (sgl-project/sglang):

- `POST /pause_generation` takes `mode`, one of abort, retract, in_place, default abort
  (python/sglang/srt/managers/io_struct.py `PauseGenerationReqInput`): abort ends the running requests;
  in_place stops the scheduler with the requests kept where they are; retract moves them back to the
  waiting queue. `POST /continue_generation` resumes (python/sglang/srt/entrypoints/http_server.py).
- `POST /release_memory_occupation {"tags": [...]}` (none or empty: every tag) asserts that no request is
  running or waiting (python/sglang/srt/managers/scheduler_update_weights_mixin.py:
  "release_memory_occupation should be called only when no ongoing request."). The assertion fails in the
  scheduler process, which takes the server down: here a 500 and a dead engine.
- It needs `--enable-memory-saver` (python/sglang/srt/server_args.py); released weights stay in host RAM only
  with `--enable-weights-cpu-backup`, else they are discarded and `/update_weights_from_disk
  {"model_path": ...}` must read them again after `resume_memory_occupation`.
- `/flush_cache` answers 400 while requests run or wait ("When there are running or waiting requests, the
  operation will not be performed."; http_server.py).
- `GET /get_load` reports per data-parallel rank `num_reqs` and `num_waiting_reqs` (http_server.py, the
  legacy shape of `/v1/loads`); `GET /health` 200; `GET /get_model_info` the `model_path`.
- `POST /tokenize` and `POST /v1/tokenize` (http_server.py `openai_v1_tokenize`) take a `TokenizeRequest`
  (python/sglang/srt/entrypoints/openai/protocol.py): exactly one of `prompt` (a string, or a list of strings
  tokenized one by one) and `messages` (rendered with the chat template, `to_chat_completion_request`), else
  "Exactly one of 'prompt' or 'messages' must be provided." as a validation error, which SGLang answers 400
  (`validation_exception_handler`, an `ErrorResponse` of `object`, `message`, `type`, `param`, `code`); the
  answer is a `TokenizeResponse` `{tokens, count, max_model_len}`, lists of them for a list of prompts. The
  fake's tokenizer and template: one token per whitespace-separated word of the prompt, or of the messages'
  text; `engine.tokenized` keeps each body answered.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

PAUSE_MODES = ("abort", "retract", "in_place")
TAGS = ("weights", "kv_cache", "cuda_graph")  # GPU_MEMORY_ALL_TYPES
MAX_MODEL_LEN = 32768  # the tokenizer's `model_max_length` the fake reports


@dataclass
class FakeSglangEngine:
    model_path: str
    gpus: tuple[int, ...]
    shard_bytes: int
    kv_pool_bytes: int
    context_bytes: int = 512 * 1024 * 1024
    memory_saver: bool = True
    cpu_backup: bool = False
    pid: int = field(default_factory=os.getpid)
    released: set[str] = field(default_factory=set)
    weights_valid: bool = True
    host_backup_bytes: int = 0
    paused: str | None = None  # the pause mode, while paused
    running: int = 0
    waiting: int = 0
    aborted: int = 0
    alive: bool = True
    flushes: int = 0
    calls: list[str] = field(default_factory=list)
    tokenized: list[dict[str, object]] = field(default_factory=list)  # the bodies of the /tokenize calls answered

    def gpu_bytes(self) -> dict[int, int]:
        if not self.alive:
            return {}
        per_gpu = self.context_bytes
        per_gpu += 0 if "weights" in self.released else self.shard_bytes
        per_gpu += 0 if "kv_cache" in self.released else self.kv_pool_bytes
        return dict.fromkeys(self.gpus, per_gpu)

    def answers(self) -> bool:
        return self.alive and not self.released and self.weights_valid and self.paused is None


def create_fake_sglang(engine: FakeSglangEngine) -> FastAPI:
    app = FastAPI(title=f"fake SGLang {engine.model_path}")

    def result(success: bool, message: str) -> JSONResponse:
        return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)

    @app.middleware("http")
    async def record(request: Request, call_next):  # type: ignore[no-untyped-def]  # Starlette's own callable type
        engine.calls.append(f"{request.method} {request.url.path}")
        if not engine.alive:
            return Response(status_code=503)
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info() -> dict[str, object]:
        return {"model_path": engine.model_path, "is_generation": True}

    @app.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        return [{"dp_rank": 0, "num_reqs": engine.running, "num_waiting_reqs": engine.waiting, "num_tokens": 0}]

    @app.post("/pause_generation")
    async def pause(request: Request) -> Response:
        body = await _body(request)
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return JSONResponse({"error": f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}."}, 400)
        if mode == "abort":
            engine.aborted += engine.running + engine.waiting
            engine.running = engine.waiting = 0
        elif mode == "retract":
            engine.waiting += engine.running
            engine.running = 0
        engine.paused = mode
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def cont() -> Response:
        engine.paused = None
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/release_memory_occupation")
    async def release(request: Request) -> Response:
        if not engine.memory_saver:
            return result(False, "release_memory_occupation needs --enable-memory-saver")
        if engine.running or engine.waiting:
            engine.alive = False  # the scheduler's AssertionError ends the server
            return JSONResponse(
                {"error": "release_memory_occupation should be called only when no ongoing request."}, 500
            )
        tags = (await _body(request)).get("tags") or list(TAGS)
        if "weights" in tags and "weights" not in engine.released:
            if engine.cpu_backup:
                engine.host_backup_bytes = engine.shard_bytes * len(engine.gpus)
            else:
                engine.weights_valid = False
        engine.released |= set(tags)
        return result(True, "")

    @app.post("/resume_memory_occupation")
    async def resume(request: Request) -> Response:
        tags = (await _body(request)).get("tags") or list(TAGS)
        missing = [t for t in tags if t not in engine.released]
        if missing:  # scheduler_update_weights_mixin.py: `self.offload_tags.remove(tag)` raises on a tag not released
            engine.alive = False
            return JSONResponse({"error": f"KeyError: {missing[0]!r}"}, 500)
        if "weights" in tags and engine.host_backup_bytes:
            engine.host_backup_bytes = 0
            engine.weights_valid = True
        engine.released -= set(tags)
        return result(True, "")

    @app.post("/update_weights_from_disk")
    async def update_weights(request: Request) -> Response:
        body = await _body(request)
        if body.get("model_path") != engine.model_path:
            return result(False, f"Failed to get weights iterator: {body.get('model_path')!r} is no checkpoint")
        if "weights" in engine.released:
            return result(False, "the weights' memory is released: resume it first")
        engine.weights_valid = True
        return result(True, "Succeeded to update model weights.")

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await _body(request)
        prompt, messages = body.get("prompt"), body.get("messages")
        given = prompt if messages is None else messages
        if (prompt is None) == (messages is None) or not isinstance(given, (str, list)):
            message = "Exactly one of 'prompt' or 'messages' must be provided."
            error = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
            return JSONResponse(error, status_code=400)
        engine.tokenized.append(body)
        if isinstance(prompt, list):
            ids = [_tokens(str(p)) for p in prompt]
            return JSONResponse({"tokens": ids, "count": [len(i) for i in ids], "max_model_len": MAX_MODEL_LEN})
        text = prompt if isinstance(prompt, str) else " ".join(_message_text(m) for m in messages or [])
        tokens = _tokens(text)
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": MAX_MODEL_LEN})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush() -> Response:
        if engine.running or engine.waiting:
            return Response(
                "Cache flushed.\n(When there are running or waiting requests, the operation will not be performed.)\n",
                status_code=400,
            )
        engine.flushes += 1
        return Response("Cache flushed.\n", status_code=200)

    return app


def _tokens(text: str) -> list[int]:
    return [sum(w.encode()) % 50000 for w in text.split()]


def _message_text(message: object) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


async def _body(request: Request) -> dict[str, object]:
    raw = await request.body()
    if not raw:
        return {}
    data = await request.json()
    return data if isinstance(data, dict) else {}
