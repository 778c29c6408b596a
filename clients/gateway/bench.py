"""`statebudget bench gateway`: the latency the gateway adds, direct to an engine vs through the gateway.

One backend process plays a fixed-latency engine (SSE chunks, a fixed sleep per token) and the planner's
two endpoints the gateway calls (a static route table naming that engine, events acknowledged); the
gateway runs as its own process, as deployed. For each rate, an open-loop load (requests start on a fixed
schedule, at most `concurrency` streams at once) goes to the engine directly, then through the gateway, in
the same run; the figures are the client-seen time to first token and to the end of the stream, their
difference at p50 and p99, the completed requests per second and the gateway's CPU (user + system).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import uvloop

from clients.gateway.upstream import UpstreamError, UpstreamPool

MODEL = "bench-model"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def backend_app(url: str, tokens: int, token_latency_seconds: float) -> Any:
    """A raw ASGI app: the engine's streaming chat endpoint, and the planner's routes and events."""
    routes = json.dumps(
        {
            "epoch": 1,
            "revision": "bench",
            "models": [
                {
                    "model": MODEL,
                    "instances": [{"id": "bench", "node": "n1", "gpus": ["g0"], "state": "running", "url": url}],
                }
            ],
            "sessions": [],
            "directives": {"decided": False, "pins": [], "warmups": []},
        }
    ).encode()
    chunk = (
        b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"'
        + MODEL.encode()
        + b'","choices":[{"index":0,"delta":{"content":" w"},"finish_reason":null}]}\n\n'
    )
    last = (
        b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"'
        + MODEL.encode()
        + b'","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":'
        + str(tokens).encode()
        + b',"total_tokens":0}}\n\ndata: [DONE]\n\n'
    )

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if path == "/v1/routes":
            if b"after_epoch" in scope.get("query_string", b""):
                # nothing changes: a long-poll holds to its wait, or ends with the gateway's connection (so the
                # backend's shutdown does not wait for it and cancel it)
                try:
                    message = await asyncio.wait_for(receive(), 20)
                except TimeoutError:
                    message = {}
                if message.get("type") == "http.disconnect":
                    return
            await _answer(send, 200, b"application/json", routes)
        elif path == "/v1/events":
            n = len(json.loads(body)["events"])
            await _answer(
                send, 200, b"application/json", json.dumps({"applied": n, "duplicates": 0, "results": []}).encode()
            )
        elif path == "/v1/chat/completions":
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            for _ in range(tokens):
                await asyncio.sleep(token_latency_seconds)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": last, "more_body": False})
        else:
            await _answer(
                send,
                404,
                b"application/json",
                b'{"error":{"message":"not found","type":"NotFoundError","param":null,"code":404}}',
            )

    return app


async def _answer(send: Any, status: int, content_type: bytes, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
    await send({"type": "http.response.body", "body": body})


@dataclass
class Phase:
    target: str
    rate: float
    sent: int
    ok: int
    seconds: float
    ttft: np.ndarray
    total: np.ndarray
    gateway_cpu_seconds: float | None


async def _load(
    url: str, rate: float, seconds: float, concurrency: int
) -> tuple[int, int, float, list[float], list[float]]:
    """Open-loop load through the gateway's own HTTP/1.1 pool (cheaper per request than httpx, whose pool walks
    every connection per request: on a shared machine the load generator's CPU is taken from what it measures)."""
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "bench"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    headers = [(b"content-type", b"application/json")]
    pool = UpstreamPool(connect_timeout_seconds=5.0, read_timeout_seconds=30.0, max_idle=concurrency)
    ttfts: list[float] = []
    totals: list[float] = []
    ok = 0
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        nonlocal ok
        async with gate:
            start = time.perf_counter()
            first = None
            try:
                response = await pool.post(url, b"/v1/chat/completions", headers, body)
                try:
                    await response.head()
                    ended = False
                    while not ended:
                        piece, ended = await response.next_chunk()
                        if first is None and piece:
                            first = time.perf_counter()
                finally:
                    response.release()
            except UpstreamError:
                return
            if response.status == 200 and first is not None:
                ok += 1
                ttfts.append(first - start)
                totals.append(time.perf_counter() - start)

    n = int(rate * seconds)
    began = time.perf_counter()
    tasks = []
    for i in range(n):
        delay = began + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    took = time.perf_counter() - began
    pool.close()
    return n, ok, took, ttfts, totals


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _wait_up(url: str, path: str, timeout_seconds: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def run(rates: list[float], seconds: float, concurrency: int, tokens: int, token_latency_seconds: float) -> list[Phase]:
    backend_port, gateway_port = _free_port(), _free_port()
    backend_url, gateway_url = f"http://127.0.0.1:{backend_port}", f"http://127.0.0.1:{gateway_port}"
    backend = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "clients.gateway.bench",
            "backend",
            "--port",
            str(backend_port),
            "--tokens",
            str(tokens),
            "--token-latency",
            str(token_latency_seconds),
        ]
    )
    env = {**os.environ, "STATEBUDGET_GATEWAY_LOG_LEVEL": "warning"}
    gateway = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "from clients.gateway.cli import serve; import sys; "
                f"serve(planner_url={backend_url!r}, host='127.0.0.1', port={gateway_port})"
            ),
        ],
        env=env,
    )
    phases = []
    try:
        _wait_up(backend_url, "/v1/routes")
        _wait_up(gateway_url, "/readyz")
        for rate in rates:
            for target, url in (("direct", backend_url), ("gateway", gateway_url)):
                cpu_before = _cpu_seconds(gateway.pid)
                with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # as the gateway's uvicorn
                    sent, ok, took, ttft, total = runner.run(_load(url, rate, seconds, concurrency))
                cpu = _cpu_seconds(gateway.pid) - cpu_before if target == "gateway" else None
                phases.append(Phase(target, rate, sent, ok, took, np.array(ttft), np.array(total), cpu))
    finally:
        for process in (gateway, backend):
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
    return phases


def report(phases: list[Phase]) -> list[str]:
    lines = [
        f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}, {os.cpu_count()} CPUs",
        "rate/s  target   ok/sent     rps    ttft p50/p99 ms   total p50/p99 ms   added ttft p50/p99 ms   gateway CPU",
    ]
    by_rate: dict[float, dict[str, Phase]] = {}
    for p in phases:
        by_rate.setdefault(p.rate, {})[p.target] = p
    for rate, pair in by_rate.items():
        for target in ("direct", "gateway"):
            p = pair[target]
            if not len(p.ttft):
                lines.append(f"{rate:6.0f}  {target:7s}  {p.ok}/{p.sent}  (no answers)")
                continue
            t50, t99 = np.percentile(p.ttft, [50, 99]) * 1000
            e50, e99 = np.percentile(p.total, [50, 99]) * 1000
            added = ""
            cpu = ""
            if target == "gateway" and len(pair["direct"].ttft):
                d50, d99 = np.percentile(pair["direct"].ttft, [50, 99]) * 1000
                added = f"{t50 - d50:+8.2f} / {t99 - d99:+8.2f}"
                if p.gateway_cpu_seconds:
                    per_request_ms = p.gateway_cpu_seconds / max(p.ok, 1) * 1000
                    cpu = f"{p.gateway_cpu_seconds / p.seconds * 100:5.0f}% of a core, {per_request_ms:.2f} ms/request"
            lines.append(
                f"{rate:6.0f}  {target:7s}  {p.ok:5d}/{p.sent:<5d} {p.ok / p.seconds:7.1f}  {t50:7.2f} / {t99:7.2f}  "
                f"{e50:8.2f} / {e99:8.2f}  {added:>22s}  {cpu}"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description="The gateway benchmark's backend process.")
    parser.add_argument("role", choices=["backend"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--token-latency", type=float, default=0.005)
    args = parser.parse_args()
    import uvicorn

    app = backend_app(f"http://127.0.0.1:{args.port}", args.tokens, args.token_latency)
    uvicorn.run(
        app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False, timeout_graceful_shutdown=1
    )


if __name__ == "__main__":
    main()
