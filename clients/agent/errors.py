"""What an executor raises when an operation does not succeed (kopf's TemporaryError vs PermanentError).

`TemporaryError`: trying again may work (engine busy, connection refused, 5xx);
the agent retries it with backoff while its lease lasts, then reports `failed`.
`PermanentError`: trying again cannot work (the engine lacks the capability, the
source is gone); the agent reports `failed` at once, and the planner replans.
"""

from __future__ import annotations

from pydantic import ValidationError


class ExecutionError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TemporaryError(ExecutionError):
    def __init__(self, reason: str, *, delay_seconds: float | None = None) -> None:
        super().__init__(reason)
        self.delay_seconds = delay_seconds


class PermanentError(ExecutionError):
    pass


class CapabilityError(PermanentError):
    """The engine cannot carry out this kind of move; `capability` names what it lacks."""

    def __init__(self, capability: str, reason: str) -> None:
        super().__init__(f"capability {capability!r} not available: {reason}")
        self.capability = capability


def invalid_fields(error: ValidationError, *, whole: str = "body") -> str:
    """A validation error in one line per field, as `field: problem (got value)`, without pydantic's links;
    `whole` names what an error without a field is about."""
    parts = []
    for e in error.errors(include_url=False):
        where = ".".join(str(p) for p in e["loc"]) or whole
        given = f" (got {e['input']!r})" if e["type"] != "missing" and not isinstance(e["input"], dict) else ""
        parts.append(f"{where}: {e['msg']}{given}")
    return "; ".join(parts)
