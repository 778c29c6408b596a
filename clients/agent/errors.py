"""What an executor raises when an operation does not succeed (kopf's TemporaryError vs PermanentError).

`TemporaryError`: trying again may work (engine busy, connection refused, 5xx);
the agent retries it with backoff while its lease lasts, then reports `failed`.
`PermanentError`: trying again cannot work (the engine lacks the capability, the
source is gone); the agent reports `failed` at once, and the planner replans.
"""

from __future__ import annotations


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
