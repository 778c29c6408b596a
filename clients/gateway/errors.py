"""The gateway's own errors, in the OpenAI error shape (`{"error": {"message", "type", "param", "code"}}`).

The shape is vLLM's `ErrorResponse` / `ErrorInfo` (vllm/entrypoints/openai/protocol.py), which the `openai`
client reads into its typed exceptions by status code.
"""

from __future__ import annotations

import json


class GatewayError(Exception):
    def __init__(
        self, status: int, message: str, *, type: str, param: str | None = None, retry_after_seconds: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.retry_after_seconds = retry_after_seconds

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        return json.dumps({"error": error}).encode()

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_seconds is None else {"Retry-After": str(self.retry_after_seconds)}


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, type="invalid_request_error", param=param)


def unavailable(message: str, retry_after_seconds: int) -> GatewayError:
    return GatewayError(503, message, type="service_unavailable", retry_after_seconds=retry_after_seconds)
