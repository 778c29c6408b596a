"""A contract fake of the LMCache controller's HTTP API (lmcache/v1/api_server/__main__.py).

- `/pin {instance_id, location, tokens}`: every field required (`PinRequest`), so a pin without `tokens` is
  FastAPI's 422. Pinning keeps chunks from LRU eviction at that location; it frees nothing on the GPU.
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

from dataclasses import dataclass, field

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

CHUNK_TOKENS = 256


@dataclass
class FakeLMCacheController:
    instances: set[str]
    chunks: dict[tuple[str, str], set[tuple[int, ...]]] = field(default_factory=dict)  # (instance, location) -> chunks
    pinned: dict[tuple[str, str], set[tuple[int, ...]]] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    def store(self, instance: str, location: str, tokens: list[int]) -> None:
        self.chunks.setdefault((instance, location), set()).update(_chunks(tokens))

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
    copy: bool | None = False


class LookupRequest(BaseModel):
    tokens: list[int]


def create_fake_lmcache(controller: FakeLMCacheController) -> FastAPI:
    app = FastAPI(title="fake LMCache controller")

    @app.post("/pin")
    async def pin(req: PinRequest) -> dict[str, object]:
        controller.calls.append("pin")
        controller.known(req.instance_id)
        here = controller.chunks.get((req.instance_id, req.location), set()) & _chunks(req.tokens)
        controller.pinned.setdefault((req.instance_id, req.location), set()).update(here)
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
        if not req.copy:
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
