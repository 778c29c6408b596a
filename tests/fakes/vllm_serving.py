"""Contract fake of vLLM's OpenAI server: `/v1/chat/completions`, `/v1/completions`, `/v1/models`,
`/tokenize`, `/health`, as an APIRouter the tests mount (beside the control surface of `vllm.py`); `serving_app`
adds `/metrics` with the scheduler's gauges (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
vllm/v1/metrics/loggers.py), running counted from the requests in flight.

Shapes are those of vLLM's protocol models, vllm/entrypoints/openai/protocol.py (vllm-project/vllm at
ec3b890c14b00f6670515d9df8d503b5270e95ca): `ChatCompletionResponse` / `ChatCompletionStreamResponse`
(`object` "chat.completion" / "chat.completion.chunk", `usage: null` on every chunk but the last),
`CompletionResponse` ("text_completion"), `UsageInfo` (prompt_tokens, total_tokens, completion_tokens),
`StreamOptions.include_usage` (one more chunk before `data: [DONE]`, `choices: []`, the usage),
`ToolCall` / `DeltaToolCall` (`id`, `type: "function"`, `function: {name, arguments}`, an `index` when
streamed), `TokenizeResponse` (count, max_model_len, tokens), `ErrorResponse` (`error: {message, type,
param, code}`; an unknown model is a 404 "The model `x` does not exist.", serving_engine.py `_check_model`).
A streamed chat answer opens with a `{"role": "assistant"}` delta (serving_chat.py, first iteration).

The fake's own model of generation, stated so tests can predict it: one token per whitespace-separated word
(the tokenizer), `max_tokens` output tokens (8 where unset) after a fixed latency each; where the request
offers `tools` and the last message is not a tool result, the answer calls the first tool
(`finish_reason: "tool_calls"`), as a model with `tool_choice: auto` that decides to call it.
Closing the connection before the answer is complete aborts the request, streamed or not (vLLM cancels a
handler whose client disconnected: vllm/entrypoints/utils.py `with_cancellation` races each handler with
`listen_for_disconnect`, and a streaming response stops when its client goes); `state.cancelled` counts those.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

DEFAULT_MAX_TOKENS = 8
MAX_MODEL_LEN = 32768


@dataclass
class ServingState:
    """What the fake saw: every request body (by the client's `X-Request-Id`, else a fresh id), finished and
    aborted requests, so tests can count losses and duplicates."""

    models: list[str]
    token_latency_seconds: float = 0.0
    api_key: str | None = None
    received: list[dict[str, Any]] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    finished: int = 0
    cancelled: int = 0
    in_flight: int = 0
    tokenized: list[dict[str, Any]] = field(default_factory=list)  # the bodies of the /tokenize calls answered


def _tokens(text: str) -> list[int]:
    return [sum(w.encode()) % 50000 for w in text.split()]


def _message_text(messages: list[dict[str, Any]]) -> str:
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [p.get("text", "") for p in content if isinstance(p, dict)]
    return " ".join(parts)


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": status}}, status_code=status
    )


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response | None:
    """vLLM's `with_cancellation`: the handler's work races a wait for the client's `http.disconnect`, and the
    loser is cancelled; None where the client left first."""
    handler = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_disconnected(request))
    done, pending = await asyncio.wait({handler, listener}, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    return handler.result() if handler in done else None


def openai_router(state: ServingState) -> APIRouter:
    router = APIRouter()

    def check(request: Request, body: dict[str, Any]) -> JSONResponse | None:
        if state.api_key is not None and request.headers.get("authorization") != f"Bearer {state.api_key}":
            # vLLM's --api-key middleware answers 401 {"error": "Unauthorized"} (api_server.py, authentication)
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        if body.get("model") not in state.models:
            return _error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError", "model")
        return None

    def record(request: Request, body: dict[str, Any]) -> None:
        state.received.append(body)
        state.request_ids.append(request.headers.get("x-request-id") or uuid.uuid4().hex)

    async def generate(n: int) -> AsyncIterator[int]:
        for i in range(n):
            await asyncio.sleep(state.token_latency_seconds)
            yield i

    async def generate_all(n: int) -> Response:
        """A whole answer's generation (the caller builds the answer; the Response says it ended)."""
        state.in_flight += 1
        try:
            async for _ in generate(n):
                pass
        finally:
            state.in_flight -= 1
        state.finished += 1
        return Response()

    @router.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        refused = check(request, body)
        if refused is not None:
            return refused
        record(request, body)
        messages = body["messages"]
        prompt_tokens = len(_tokens(_message_text(messages)))
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or DEFAULT_MAX_TOKENS)
        tools = body.get("tools") or []
        calls_tool = bool(tools) and messages[-1].get("role") != "tool" and body.get("tool_choice") != "none"
        tool_name = tools[0]["function"]["name"] if calls_tool else None
        cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body["model"]
        finish = "tool_calls" if calls_tool else ("length" if body.get("max_tokens") else "stop")
        call_id = f"chatcmpl-tool-{uuid.uuid4().hex}"
        arguments = json.dumps({"q": "x"})
        if not body.get("stream"):
            generated = await _unless_disconnected(request, generate_all(n))
            if generated is None:
                state.cancelled += 1
                return JSONResponse(None)  # what vLLM's handler returns then (nobody reads it)
            message: dict[str, Any] = {
                "role": "assistant",
                "content": None if calls_tool else " ".join(f"w{i}" for i in range(n)),
            }
            message["tool_calls"] = (
                [{"id": call_id, "type": "function", "function": {"name": tool_name, "arguments": arguments}}]
                if calls_tool
                else []
            )
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "stop_reason": None}
            return JSONResponse(
                {
                    "id": cid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": _usage(prompt_tokens, n),
                }
            )
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
            data = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": choices,
            }
            if include_usage:
                data["usage"] = usage
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        async def stream() -> AsyncIterator[bytes]:
            state.in_flight += 1
            try:
                yield chunk(
                    [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
                if calls_tool:
                    delta = {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": call_id,
                                "type": "function",
                                "function": {"name": tool_name, "arguments": arguments},
                            }
                        ]
                    }
                    await asyncio.sleep(state.token_latency_seconds)
                    yield chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])
                    produced = 1
                else:
                    produced = 0
                    async for i in generate(n):
                        produced += 1
                        yield chunk(
                            [{"index": 0, "delta": {"content": f" w{i}"}, "logprobs": None, "finish_reason": None}]
                        )
                yield chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish, "stop_reason": None}])
                if include_usage:
                    yield chunk([], _usage(prompt_tokens, n if not calls_tool else produced))
                yield b"data: [DONE]\n\n"
                state.finished += 1
            except (asyncio.CancelledError, GeneratorExit):
                state.cancelled += 1
                raise
            finally:
                state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        refused = check(request, body)
        if refused is not None:
            return refused
        record(request, body)
        prompt = body["prompt"] if isinstance(body["prompt"], str) else " ".join(body["prompt"])
        n = int(body.get("max_tokens") or 16)  # CompletionRequest.max_tokens defaults to 16 (protocol.py)
        if await _unless_disconnected(request, generate_all(n)) is None:
            state.cancelled += 1
            return JSONResponse(None)
        choice = {"index": 0, "text": " ".join(f"w{i}" for i in range(n)), "logprobs": None, "finish_reason": "length"}
        return JSONResponse(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": body["model"],
                "choices": [choice],
                "usage": _usage(len(_tokens(prompt)), n),
            }
        )

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        cards = [
            {
                "id": m,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "vllm",
                "root": m,
                "parent": None,
                "max_model_len": MAX_MODEL_LEN,
            }
            for m in state.models
        ]
        return {"object": "list", "data": cards}

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await request.json()
        # the body is a `TokenizeCompletionRequest` (`prompt`: a string) or a `TokenizeChatRequest` (`messages`;
        # `add_generation_prompt` and `continue_final_message` not both true, its `check_generation_prompt`),
        # vllm/entrypoints/serve/tokenize/protocol.py; a body that is neither fails FastAPI's validation, which
        # vLLM answers 400 (api_server.py `validation_exception_handler`)
        if isinstance(body.get("prompt"), str):
            text = body["prompt"]
        elif isinstance(body.get("messages"), list):
            if body.get("continue_final_message") and body.get("add_generation_prompt"):
                return _error(
                    400, "Cannot set both `continue_final_message` and `add_generation_prompt`.", "BadRequestError"
                )
            text = _message_text(body["messages"])
        else:
            return _error(400, "a string `prompt` or a list of `messages` is required", "BadRequestError")
        if body.get("model") is not None and body["model"] not in state.models:
            return _error(404, f"The model `{body['model']}` does not exist.", "NotFoundError", "model")
        state.tokenized.append(body)
        tokens = _tokens(text)
        return JSONResponse({"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens})

    @router.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return router


def serving_app(state: ServingState) -> FastAPI:
    """The OpenAI surface alone, for tests and benchmarks that need no sleep or wake."""
    app = FastAPI()
    app.include_router(openai_router(state))

    @app.get("/metrics")
    async def metrics() -> Response:  # the scheduler gauges of vllm/v1/metrics/loggers.py
        running = f'vllm:num_requests_running{{model_name="{state.models[0]}"}} {float(state.in_flight)}\n'
        return Response(running + f'vllm:num_requests_waiting{{model_name="{state.models[0]}"}} 0.0\n')

    app.state.serving = state
    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="Serve the fake vLLM OpenAI surface.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--token-latency", type=float, default=0.0)
    args = parser.parse_args()
    app = serving_app(ServingState(models=args.model, token_latency_seconds=args.token_latency))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
