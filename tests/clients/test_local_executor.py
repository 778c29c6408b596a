"""The local executor moves real bytes between real stores and measures what it did."""

from __future__ import annotations

import pytest

from clients.agent.errors import PermanentError
from clients.agent.executors.local import LocalExecutor
from clients.agent.operations import Operation
from clients.agent.stores import DirStore, MemoryStore
from planner_service.wire.state import PlacementEntry

SCALE = 1e-6
GB = 10**9


def executor(tmp_path, **kw) -> LocalExecutor:
    return LocalExecutor(
        "n1",
        nvme=DirStore(tmp_path / "nvme", "nvme"),
        host=DirStore(tmp_path / "host", "host"),
        gpu_store=lambda gpu: MemoryStore(f"gpu:{gpu}"),
        gpu_ids=["n1-g0"],
        gpu_capacity_bytes={"n1-g0": 80 * GB},
        scale=SCALE,
        chunk_bytes=4096,
        **kw,
    )


def op(action, obj, src, dst, nbytes, keep=False, op_id="1.op-1") -> Operation:
    return Operation.model_validate(
        {
            "id": op_id,
            "action": action,
            "object": obj,
            "from": src,
            "to": dst,
            "bytes": nbytes,
            "keep_source": keep,
            "node": "n1",
            "priority": "background",
            "depends_on": [],
            "estimated_seconds": 0.0,
            "reason": "",
        }
    )


def entry(obj: dict, loc: dict, nbytes: int) -> PlacementEntry:
    return PlacementEntry.model_validate({"object": obj, "location": loc, "bytes": nbytes})


WEIGHTS = {"kind": "weights", "model": "coder", "precision": "bf16"}
NVME = {"tier": "nvme", "node": "n1"}
HOST = {"tier": "host", "node": "n1"}
GPU = {"tier": "gpu", "gpu": "n1-g0"}


@pytest.mark.anyio
async def test_promote_demote_drop_move_real_bytes(tmp_path):
    ex = executor(tmp_path)
    ex.seed([entry(WEIGHTS, NVME, 60 * GB)], "n1", {"n1-g0"})
    nvme_file = tmp_path / "nvme" / "weights__coder__bf16.bin"
    assert nvme_file.stat().st_size == 60_000  # 60 GB at 1e-6

    out = await ex.execute(op("promote", WEIGHTS, NVME, HOST, 60 * GB, keep=True))
    assert (tmp_path / "host" / "weights__coder__bf16.bin").read_bytes() == nvme_file.read_bytes()
    assert out.measured_bytes == 60 * GB and out.measured_seconds > 0

    await ex.execute(op("promote", WEIGHTS, HOST, GPU, 60 * GB, keep=True))
    assert ex.gpu("n1-g0").size("weights__coder__bf16") == 60_000
    usage = ex.telemetry().gpus[0]
    assert (usage.id, usage.used_bytes, usage.free_bytes) == ("n1-g0", 60 * GB, 20 * GB)

    out = await ex.execute(op("demote", WEIGHTS, GPU, HOST, 20 * GB))  # partial: a third goes down again
    assert ex.gpu("n1-g0").size("weights__coder__bf16") == 40_000
    assert out.details["reclaimed_bytes"] == 20 * GB

    out = await ex.execute(op("drop", WEIGHTS, GPU, None, 40 * GB))
    assert ex.gpu("n1-g0").keys() == [] and out.measured_bytes == 40 * GB

    assert (tmp_path / "host" / "weights__coder__bf16.bin").stat().st_size == 80_000  # the demote appended
    await ex.execute(op("drop", WEIGHTS, HOST, None, 80 * GB))
    assert not (tmp_path / "host" / "weights__coder__bf16.bin").exists()
    assert nvme_file.stat().st_size == 60_000  # the last complete copy stays


@pytest.mark.anyio
async def test_prefill_creates_kv_and_missing_sources_are_materialized(tmp_path):
    ex = executor(tmp_path)
    kv = {"kind": "kv", "model": "coder", "session": "s/1"}
    await ex.execute(op("promote", kv, None, GPU, 3 * GB))
    assert ex.gpu("n1-g0").size("kv__coder__s/1") == 3000
    await ex.execute(op("demote", kv, GPU, NVME, 3 * GB))
    assert (tmp_path / "nvme" / "kv__coder__s_1.bin").stat().st_size == 3000  # one safe file name per object
    experts = {"kind": "experts", "model": "reasoner"}
    await ex.execute(op("promote", experts, NVME, GPU, 2 * GB, keep=True))  # the NVMe copy was never seeded
    assert (tmp_path / "nvme" / "experts__reasoner.bin").stat().st_size == 2000


@pytest.mark.anyio
async def test_a_store_that_does_not_give_memory_back_fails_the_operation(tmp_path):
    class Leaky(MemoryStore):
        def shrink(self, key: str, nbytes: int) -> None:  # an engine that says it freed memory, but did not
            return None

    ex = LocalExecutor(
        "n1", nvme=DirStore(tmp_path / "nvme"), host=Leaky("host"), gpu_store=lambda g: MemoryStore(), scale=SCALE
    )
    ex.seed([entry(WEIGHTS, HOST, GB)], "n1", set())
    with pytest.raises(PermanentError, match="reclaimed 0 of 1000 bytes"):
        await ex.execute(op("drop", WEIGHTS, HOST, None, GB))


@pytest.mark.anyio
async def test_foreign_locations_are_refused(tmp_path):
    ex = executor(tmp_path)
    with pytest.raises(PermanentError, match="not one of this agent's GPUs"):
        await ex.execute(op("promote", WEIGHTS, NVME, {"tier": "gpu", "gpu": "n2-g0"}, GB))
    with pytest.raises(PermanentError, match="not on this node"):
        await ex.execute(op("promote", WEIGHTS, {"tier": "nvme", "node": "n2"}, GPU, GB))


def test_memory_store_reads_in_chunks():
    store = MemoryStore()
    store.append("k", [b"abc", b"defg"])
    assert list(store.read("k", 1, 5, 2)) == [b"bc", b"de", b"f"]
    store.shrink("k", 3)
    assert store.size("k") == 4 and store.total_bytes() == 4
