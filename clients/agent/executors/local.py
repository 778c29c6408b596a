"""The `local` executor: moves real bytes between real stores and measures it.

Tiers: NVMe = a directory of files (one per object); host = a directory (put it
on a tmpfs) or an in-memory store; GPU = CUDA tensors when torch sees a GPU, else
an in-memory store standing in for it.

`scale` shrinks what is materialized: with `scale=1e-6` a 60 GB model is a 60 KB
file. Reported numbers are scaled back: bytes / scale, and seconds / scale (the
time the full object would take at the rate measured), so the rate the planner
calibrates from is the rate this machine really achieved.

State the service says already exists (the confirmed placement) is materialized
at start (`seed`) or, failing that, on first use; that is set-up, not timed.
After a demote or a drop the source's size is measured again and the operation
fails if fewer bytes were reclaimed than it promised.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clients.agent.errors import PermanentError
from clients.agent.executors.base import GpuUsage, Telemetry
from clients.agent.operations import Action, Capability, Location, Operation, Outcome, Tier
from clients.agent.stores import ByteStore, CudaStore, DirStore, MemoryStore, cuda_available
from planner_service.wire.enums import EngineKind, EngineStatus
from planner_service.wire.state import PlacementEntry

if TYPE_CHECKING:
    from clients.agent.config import AgentConfig

log = logging.getLogger(__name__)

_PATTERN = bytes(range(256)) * 4096  # 1 MiB of filler for state created by prefill


def _filler(nbytes: int, chunk_bytes: int) -> Iterator[bytes]:
    step = min(chunk_bytes, len(_PATTERN))
    while nbytes > 0:
        n = min(step, nbytes)
        yield _PATTERN[:n]
        nbytes -= n


class LocalExecutor:
    capabilities = frozenset(Capability)  # bytes can go anywhere, in any amount

    def __init__(
        self,
        node_id: str,
        *,
        nvme: ByteStore,
        host: ByteStore,
        gpu_store: Callable[[str], ByteStore],
        gpu_ids: list[str] | None = None,
        gpu_capacity_bytes: dict[str, int | None] | None = None,
        scale: float = 1.0,
        chunk_bytes: int = 4 * 1024 * 1024,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.node_id = node_id
        self.nvme, self.host = nvme, host
        self._gpu_store = gpu_store
        self._allowed_gpus = set(gpu_ids or [])
        self._gpus: dict[str, ByteStore] = {}
        self._capacity = dict(gpu_capacity_bytes or {})
        self.scale, self.chunk_bytes, self._clock = scale, chunk_bytes, clock
        for gpu in sorted(self._allowed_gpus):
            self.gpu(gpu)

    @classmethod
    def from_config(cls, config: AgentConfig) -> LocalExecutor:
        nvme_dir = config.nvme_dir or Path(f"statebudget-{config.node_id}") / "nvme"
        host: ByteStore = DirStore(config.host_dir, "host") if config.host_dir else MemoryStore("host")
        devices = config.gpu_devices()
        use_cuda = cuda_available()

        def gpu_store(gpu_id: str) -> ByteStore:
            if use_cuda:
                return CudaStore(devices.get(gpu_id, 0), f"cuda:{gpu_id}")
            return MemoryStore(f"gpu:{gpu_id}")

        return cls(
            config.node_id,
            nvme=DirStore(nvme_dir, "nvme"),
            host=host,
            gpu_store=gpu_store,
            gpu_ids=[g.id for g in config.gpus],
            gpu_capacity_bytes={g.id: g.hbm_bytes for g in config.gpus},
            scale=config.scale,
            chunk_bytes=config.chunk_bytes,
        )

    # -- stores ------------------------------------------------------------------

    def gpu(self, gpu_id: str) -> ByteStore:
        if gpu_id not in self._gpus:
            if self._allowed_gpus and gpu_id not in self._allowed_gpus:
                raise PermanentError(f"GPU {gpu_id!r} is not one of this agent's GPUs {sorted(self._allowed_gpus)}")
            self._gpus[gpu_id] = self._gpu_store(gpu_id)
        return self._gpus[gpu_id]

    def store(self, loc: Location) -> ByteStore:
        if loc.tier is Tier.GPU:
            return self.gpu(loc.id)
        if loc.id != self.node_id:
            raise PermanentError(f"{loc.label()} is not on this node ({self.node_id})")
        return self.host if loc.tier is Tier.HOST else self.nvme

    def scaled(self, nbytes: int) -> int:
        """Bytes to materialize for `nbytes` planned bytes (at least 1 for any non-empty object)."""
        return 0 if nbytes <= 0 else max(1, round(nbytes * self.scale))

    def unscaled(self, nbytes: int) -> int:
        return round(nbytes / self.scale)

    def _ensure(self, store: ByteStore, key: str, nbytes: int) -> None:
        """Materialize state that exists per the service but not yet here (set-up, not a move)."""
        have = store.size(key)
        if have < nbytes:
            store.append(key, _filler(nbytes - have, self.chunk_bytes))

    def seed(self, placement: list[PlacementEntry], node_id: str, gpu_ids: set[str]) -> int:
        """Materialize this node's share of a confirmed placement (`GET /v1/srv`'s `placement`)."""
        count = 0
        for entry in placement:
            loc = entry.location
            if loc.id not in (gpu_ids if loc.tier is Tier.GPU else {node_id}):
                continue
            self._ensure(self.store(loc), entry.object.key(), self.scaled(entry.bytes))
            count += 1
        return count

    # -- execution ---------------------------------------------------------------

    async def execute(self, op: Operation) -> Outcome:
        return await asyncio.to_thread(self._execute, op)

    def _execute(self, op: Operation) -> Outcome:
        if op.node and op.node != self.node_id:
            raise PermanentError(f"operation {op.id} is for node {op.node!r}, this agent is {self.node_id!r}")
        key, n = op.object.key(), self.scaled(op.bytes)
        src = self.store(op.source) if op.source else None
        dst = self.store(op.dest) if op.dest else None
        if op.action is Action.DROP or dst is None:
            if src is None:
                raise PermanentError(f"operation {op.id} names neither a source nor a destination")
            self._ensure(src, key, n)
            started = self._clock()
            dropped = self._free(src, key, n, op)
            return self._outcome(started, dropped, reclaimed=dropped)
        if src is not None:
            self._ensure(src, key, n)
        started = self._clock()
        before = dst.size(key)
        if src is None:  # KV created by prefill
            written = dst.append(key, _filler(n, self.chunk_bytes))
        else:
            have = src.size(key)
            offset = before if before + n <= have else 0  # the next bytes of the object, as far as the source goes
            written = dst.append(key, src.read(key, offset, n, self.chunk_bytes))
        grown = dst.size(key) - before
        if grown != n or written != n:
            raise PermanentError(f"{op.label()}: wrote {written} bytes, destination grew {grown}, expected {n}")
        reclaimed = self._free(src, key, n, op) if src is not None and not op.keep_source else None
        return self._outcome(started, grown, reclaimed=reclaimed)

    def _free(self, store: ByteStore, key: str, n: int, op: Operation) -> int:
        """Remove `n` bytes and measure what the store really gave back."""
        before = store.size(key)
        store.shrink(key, n)
        reclaimed = before - store.size(key)
        expected = min(n, before)
        if reclaimed < expected:
            raise PermanentError(f"{op.label()}: reclaimed {reclaimed} of {expected} bytes at {store.name}")
        return reclaimed

    def _outcome(self, started: float, moved: int, *, reclaimed: int | None) -> Outcome:
        wall = max(self._clock() - started, 0.0)
        details: dict[str, Any] = {"materialized_bytes": moved, "wall_seconds": wall}
        if reclaimed is not None:
            details["reclaimed_bytes"] = self.unscaled(reclaimed)
        return Outcome(measured_seconds=wall / self.scale, measured_bytes=self.unscaled(moved), details=details)

    # -- reporting ---------------------------------------------------------------

    def telemetry(self) -> Telemetry:
        gpus = []
        for gpu_id, store in sorted(self._gpus.items()):
            if isinstance(store, CudaStore):
                free, total = store.device_memory()
                gpus.append(GpuUsage(gpu_id, total - free, free))
                continue
            used = self.unscaled(store.total_bytes())
            capacity = self._capacity.get(gpu_id)
            gpus.append(GpuUsage(gpu_id, used, max(capacity - used, 0) if capacity is not None else None))
        return Telemetry(gpus=gpus, engines={"local": EngineStatus.READY})

    def engines(self) -> list[dict[str, Any]]:
        return [{"name": "local", "kind": EngineKind.LOCAL}]

    async def aclose(self) -> None:
        return None
