"""A contract fake of the LMCache controller's HTTP API (lmcache/v1/api_server/__main__.py).

- `/pin {instance_id, location, tokens}`: every field required (`PinRequest`), so a pin without `tokens` is
  FastAPI's 422. Pinning keeps chunks from LRU eviction at that location; it frees nothing on the GPU. The
  controller hands the pin to every worker of the instance (lmcache/v1/cache_controller/executor.py `pin`),
  whose engine pins through a lookup (lmcache/v1/cache_controller/worker.py: `lookup(..., pin=True)`).
- There is no `/unpin`: the HTTP API has no such route (a 404). A pin lapses by itself: LMCache's
  `PinMonitor` (lmcache/v1/pin_monitor.py) forces a pinned object's pin count to 0 once it was pinned longer
  than `pin_timeout_sec` (300 s by default, lmcache/v1/config.py), and pinning an object again restarts its
  countdown (`register_pinned_object` records the time anew).
- `/clear {instance_id, location}`: no tokens field at all; it empties the location for every session.
- `/move {old_position: [instance, location], new_position: [...], tokens, copy}`: a push-based transfer
  from the source instance's workers to the destination's (lmcache/v1/cache_controller/executor.py `move`
  looks the workers of both instances up); a move inside one instance is refused here, as there is no
  second set of workers to push to. An instance the controller does not know fails its assertion: 500.
- `/lookup {tokens}`; `/health {instance_id}`. Failures inside the controller are 500s (every route wraps
  them in `HTTPException(status_code=500)`).

KV is addressed by token ids in chunks of 256 tokens (LMCache's default `chunk_size`, lmcache/v1/config.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

CHUNK_TOKENS = 256
PIN_TIMEOUT_SECONDS = 300.0  # LMCache's `pin_timeout_sec` default (lmcache/v1/config.py)


@dataclass
class FakeLMCacheController:
    instances: set[str]
    chunks: dict[tuple[str, str], set[tuple[int, ...]]] = field(default_factory=dict)  # (instance, location) -> chunks
    # (instance, location) -> chunk -> when it was last pinned (`clock`)
    pinned: dict[tuple[str, str], dict[tuple[int, ...], float]] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    pin_requests: list[dict[str, Any]] = field(default_factory=list)  # the bodies of the /pin calls answered
    pin_timeout_seconds: float = PIN_TIMEOUT_SECONDS
    clock: Callable[[], float] = time.monotonic

    def store(self, instance: str, location: str, tokens: list[int]) -> None:
        self.chunks.setdefault((instance, location), set()).update(_chunks(tokens))

    def pinned_tokens(self, instance: str, location: str, tokens: list[int]) -> int:
        """Tokens of `tokens`' chunks pinned now at the location (the PinMonitor unpins the ones pinned longer
        than `pin_timeout_seconds` ago)."""
        now = self.clock()
        pins = self.pinned.get((instance, location), {})
        live = [c for c in _chunks(tokens) if c in pins and now - pins[c] <= self.pin_timeout_seconds]
        return len(live) * CHUNK_TOKENS

    def known(self, instance: str) -> None:
        if instance not in self.instances:
            raise HTTPException(500, f"instance {instance!r} is not registered")


def _chunks(tokens: list[int]) -> set[tuple[int, ...]]:
    """Prefix chunks: chunk i is the first (i + 1) * 256 tokens (LMCache hashes each chunk with its prefix)."""
    return {tuple(tokens[:end]) for end in range(CHUNK_TOKENS, len(tokens) + 1, CHUNK_TOKENS)}


class PinRequest(BaseModel):
    instance_id: str
    location: str
    tokens: list[int]


class ClearRequest(BaseModel):
    instance_id: str
    location: str


class MoveRequest(BaseModel):
    old_position: tuple[str, str]
    new_position: tuple[str, str]
    tokens: list[int] | None = []
    # the controller's field is `copy`, which would shadow BaseModel.copy as an attribute
    copy_: bool | None = Field(False, alias="copy")


class LookupRequest(BaseModel):
    tokens: list[int]


def create_fake_lmcache(controller: FakeLMCacheController) -> FastAPI:
    app = FastAPI(title="fake LMCache controller")

    @app.post("/pin")
    async def pin(req: PinRequest) -> dict[str, object]:
        controller.calls.append("pin")
        controller.known(req.instance_id)
        controller.pin_requests.append(req.model_dump())
        here = controller.chunks.get((req.instance_id, req.location), set()) & _chunks(req.tokens)
        now = controller.clock()
        controller.pinned.setdefault((req.instance_id, req.location), {}).update(dict.fromkeys(here, now))
        return {"event_id": "Pin-fake", "num_tokens": len(here) * CHUNK_TOKENS}

    @app.post("/clear")
    async def clear(req: ClearRequest) -> dict[str, object]:
        controller.calls.append("clear")
        controller.known(req.instance_id)
        gone = controller.chunks.pop((req.instance_id, req.location), set())
        controller.pinned.pop((req.instance_id, req.location), None)
        return {"event_id": "Clear-fake", "num_tokens": len(gone) * CHUNK_TOKENS}

    @app.post("/move")
    async def move(req: MoveRequest) -> dict[str, object]:
        controller.calls.append("move")
        controller.known(req.old_position[0])
        controller.known(req.new_position[0])
        if req.old_position[0] == req.new_position[0]:
            raise HTTPException(500, "move pushes from one instance's workers to another's: give two instances")
        wanted = _chunks(req.tokens or [])
        source = controller.chunks.get(tuple(req.old_position), set())  # type: ignore[arg-type]  # a 2-item list
        moved = source & wanted if wanted else set(source)
        controller.chunks.setdefault(tuple(req.new_position), set()).update(moved)  # type: ignore[arg-type]  # as above
        if not req.copy_:
            source -= moved
        return {"event_id": "Move-fake", "num_tokens": len(moved) * CHUNK_TOKENS}

    @app.post("/lookup")
    async def lookup(req: LookupRequest) -> dict[str, object]:
        wanted = _chunks(req.tokens)
        layout = {
            inst: (loc, len(have & wanted) * CHUNK_TOKENS)
            for (inst, loc), have in controller.chunks.items()
            if have & wanted
        }
        return {"event_id": "Lookup-fake", "layout_info": layout}

    return app
