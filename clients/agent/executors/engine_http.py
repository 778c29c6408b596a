"""HTTP calls to inference engines, with their failures sorted into temporary and permanent once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from clients.agent.errors import PermanentError, TemporaryError

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

    @property
    def client(self) -> httpx.AsyncClient:
        return self._http

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
        body = json_or_none(response)
        if isinstance(body, dict) and body.get("success") is False:  # SGLang reports refusals in the body
            raise PermanentError(f"{what} refused: {body.get('message', body)}")
        return response

    async def aclose(self) -> None:
        if self._owned:
            await self._http.aclose()


def json_or_none(response: httpx.Response) -> Any:
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        return None
