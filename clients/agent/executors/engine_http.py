"""HTTP calls to inference engines, with their failures sorted into temporary and permanent once."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from clients.agent.errors import PermanentError, TemporaryError
from clients.agent.operations import Operation, Outcome, Tier
from clients.agent.probes import GpuProbe, NullProbe

_TEMPORARY_STATUS = {408, 425, 429}  # and every 5xx: the engine is busy, starting or overloaded


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One call to an engine: `POST {base}{path}?{params}` with an optional JSON body."""

    path: str
    params: dict[str, Any] = field(default_factory=dict)
    json: Any = None
    method: str = "POST"


class EngineHttp:
    def __init__(self, *, timeout_seconds: float = 120.0, http_client: httpx.AsyncClient | None = None) -> None:
        self._owned = http_client is None
        self._http = http_client if http_client is not None else httpx.AsyncClient(timeout=timeout_seconds)

    async def call(self, engine: str, base_url: str, request: EngineRequest) -> httpx.Response:
        url = base_url.rstrip("/") + request.path
        try:
            response = await self._http.request(request.method, url, params=request.params or None, json=request.json)
        except httpx.TransportError as error:
            raise TemporaryError(f"{engine} at {base_url} unreachable: {type(error).__name__}: {error}") from error
        what = f"{engine} {request.method} {request.path}"
        if response.status_code >= 500 or response.status_code in _TEMPORARY_STATUS:
            raise TemporaryError(f"{what} answered {response.status_code}: {response.text[:300]}")
        if response.status_code >= 400:
            raise PermanentError(f"{what} answered {response.status_code}: {response.text[:300]}")
        body = _json_or_none(response)
        if isinstance(body, dict) and body.get("success") is False:  # SGLang reports refusals in the body
            raise PermanentError(f"{what} refused: {body.get('message', body)}")
        return response

    async def run(
        self,
        engine: str,
        base_url: str,
        requests: Sequence[EngineRequest],
        *,
        op: Operation | None = None,
        probe: GpuProbe | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> Outcome:
        """The calls in order; seconds are their wall time, bytes the change the probe saw on the op's GPU.

        Engines return before memory is really released, or keep some of it: the
        bytes reported are what the device shows, not what the operation promised.
        """
        probe = probe or NullProbe()
        gpu = _gpu_of(op)
        before = probe.used_bytes(gpu) if gpu else None
        started = clock()
        for request in requests:
            await self.call(engine, base_url, request)
        seconds = max(clock() - started, 0.0)
        after = probe.used_bytes(gpu) if gpu else None
        details: dict[str, Any] = {"calls": [f"{r.method} {r.path}" for r in requests]}
        measured = None
        if before is not None and after is not None and op is not None:
            frees = op.source is not None and op.source.tier is Tier.GPU and op.frees is not None
            measured = max(before - after, 0) if frees else max(after - before, 0)
            details.update({"gpu": gpu, "used_bytes_before": before, "used_bytes_after": after})
            if frees and measured < op.bytes:
                details["shortfall_bytes"] = op.bytes - measured
        return Outcome(measured_seconds=seconds, measured_bytes=measured, details=details)

    async def aclose(self) -> None:
        if self._owned:
            await self._http.aclose()


def _gpu_of(op: Operation | None) -> str | None:
    """The GPU whose memory the operation changes (its source or its destination)."""
    if op is None:
        return None
    for loc in (op.source, op.dest):
        if loc is not None and loc.tier is Tier.GPU:
            return loc.id
    return None


def _json_or_none(response: httpx.Response) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        return None
