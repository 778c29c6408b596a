"""A managed SGLang engine driven by the agent's executor against the fake SGLang server process
(tests/fakes/run_sglang.py, launched from the launch template as `python -m sglang.launch_server` would be):
start until ready, the release/resume cycle with generation paused and continued around it, a restart with
another KV pool, a stop, a crash (killed, or taken down by its scheduler's error), a start out of memory; after
each step, the bytes the fake NVML shows."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from clients_helpers import FAKES, driver_nvml
from fakes.gpu_driver import alive
from fakes.serve import free_port

from clients.agent.config import AgentConfig
from clients.agent.errors import PermanentError
from clients.agent.executors.engine import EngineExecutor
from clients.agent.executors.sglang import SGLangExecutor
from clients.agent.operations import Operation
from clients.agent.probes import NvmlProbe

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
GIB = 1 << 30
CONTEXT, SHARD = GIB // 2, GIB  # run_sglang.py's defaults: CUDA context and weights on each GPU
GPUS = [{"id": "n1-g0", "device": 0}, {"id": "n1-g1", "device": 1}]
W = {"kind": "weights", "model": "coder", "precision": "bf16"}
GPU, NVME = {"tier": "gpu", "gpu": "n1-g0"}, {"tier": "nvme", "node": "n1"}
MODEL_PATH = "/models/coder"


def op(action: str, src: dict[str, Any] | None, dst: dict[str, Any] | None, **extra: Any) -> Operation:
    return Operation.model_validate(
        {
            "id": "1.op-1",
            "action": action,
            "object": W,
            "from": src,
            "to": dst,
            "bytes": 1000,
            "keep_source": False,
            "node": "n1",
            "priority": "background",
            "depends_on": [],
            "estimated_seconds": 0.0,
            "reason": "",
            **extra,
        }
    )


def step(transition: str, from_state: str, kv_pool_bytes_per_gpu: int = 4 * GIB) -> dict[str, Any]:
    instance = {
        "id": "coder@bf16@n1-g0+n1-g1",
        "node": "n1",
        "kind": "sglang",
        "model": "coder",
        "precision": "bf16",
        "gpus": ["n1-g0", "n1-g1"],
        "kv_pool_bytes_per_gpu": kv_pool_bytes_per_gpu,
    }
    return {"transition": transition, "instance": instance, "from_state": from_state}


def start(kv_pool_bytes_per_gpu: int = 4 * GIB, op_id: str = "1.op-1") -> Operation:
    return op("promote", NVME, GPU, id=op_id, engine=step("start", "stopped", kv_pool_bytes_per_gpu))


def sglang_config(port: int, driver: Path, state_dir: Path, *, cpu_backup: bool = False) -> AgentConfig:
    """The launch template of clients/README.md, with the fake server in place of `python -m
    sglang.launch_server` (its KV cell one byte, so that `--max-total-tokens` is the pool in bytes)."""
    command = [
        sys.executable,
        str(FAKES / "run_sglang.py"),
        "--model-path",
        "{model_path}",
        "--port",
        "{port}",
        "--tp-size",
        "{tp}",
        "--enable-memory-saver",
        *(["--enable-weights-cpu-backup"] if cpu_backup else []),
        "--mem-fraction-static",
        "0.9",
        "--max-total-tokens",
        "{kv_pool_bytes_per_gpu}",
        "--driver-dir",
        str(driver),
    ]
    engine = {
        "url": f"http://127.0.0.1:{port}",
        "features": ["sleep_mode", *(["cpu_backup"] if cpu_backup else [])],
        "model_path": MODEL_PATH,
        "management": "managed",
        "drain_timeout_seconds": 2,
        "launch": {"command": command, "port": port, "ready_timeout_seconds": 30, "stop_timeout_seconds": 5},
    }
    return AgentConfig.model_validate(
        {
            "node_id": "n1",
            "executor": "sglang",
            "gpus": GPUS,
            "engines": {"coder": engine},
            "engine_gpus": {"coder": ["n1-g0", "n1-g1"]},
            "engine_state_dir": str(state_dir),  # the launch record and the engine's output
        }
    )


def records(driver: Path) -> list[dict[str, Any]]:
    """The living engine processes' records (a killed one leaves its file; the driver freed its memory)."""
    found = [json.loads(p.read_text()) for p in sorted(driver.glob("*.json"))]
    return [r for r in found if alive(int(r["pid"]))]


def the_engine(driver: Path) -> dict[str, Any]:
    (record,) = records(driver)
    return record


def control_calls(record: dict[str, Any]) -> list[str]:
    return [c for c in record["calls"] if c.startswith("POST")]


def used(nvml: ModuleType) -> list[int]:
    """Each device's used bytes as the fake NVML reports them."""
    return [nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(d)).used for d in (0, 1)]


Node = Callable[..., tuple[EngineExecutor, ModuleType, Path]]


@pytest.fixture
def sglang_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    """`node(totals_gib=16, cpu_backup=False)`: an SGLang executor with a managed engine on two GPUs of
    `totals_gib` each, and the fake NVML that reads the engine's bytes. Any engine process left (a test that
    failed midway) is killed at the end."""
    driver = tmp_path / "driver"

    def make(totals_gib: float = 16, *, cpu_backup: bool = False) -> tuple[EngineExecutor, ModuleType, Path]:
        total = int(totals_gib * GIB)
        nvml = driver_nvml(driver, f"{total},{total}", monkeypatch)
        config = sglang_config(free_port(), driver, tmp_path, cpu_backup=cpu_backup)
        executor = SGLangExecutor.from_config(config, probe=NvmlProbe({"n1-g0": 0, "n1-g1": 1}, nvml))
        assert isinstance(executor, EngineExecutor)
        return executor, nvml, driver

    yield make
    for record in records(driver):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(record["pid"]), signal.SIGKILL)


async def test_a_managed_sglang_engine_starts_until_ready_holding_its_weights_and_kv_pool(sglang_node: Node) -> None:
    executor, nvml, driver = sglang_node()
    assert used(nvml) == [0, 0]
    started = await executor.execute(start())
    assert started.details["state"] == "running" and started.details["calls"][-1].startswith("start")
    engine = the_engine(driver)
    assert engine["calls"][-1] == "GET /health"  # ready: the probe answered
    assert engine["model_path"] == MODEL_PATH and engine["kv_pool_bytes"] == 4 * GIB
    assert used(nvml) == [CONTEXT + SHARD + 4 * GIB] * 2  # tp 2: a shard and a pool on each GPU
    assert started.details["taken_bytes"] == 2 * (CONTEXT + SHARD + 4 * GIB)
    await executor.aclose()


async def test_release_and_resume_pause_and_continue_generation_around_them(sglang_node: Node) -> None:
    executor, nvml, driver = sglang_node()
    await executor.execute(start())
    pid = the_engine(driver)["pid"]
    slept = await executor.execute(op("drop", GPU, None))
    engine = the_engine(driver)
    assert control_calls(engine) == ["POST /pause_generation", "POST /release_memory_occupation"]
    assert engine["paused"] == "in_place" and engine["aborted"] == 0
    assert engine["released"] == ["kv_cache", "weights"] and engine["host_backup_bytes"] == 0  # discarded
    assert slept.details["state"] == "asleep_discarded"
    assert used(nvml) == [CONTEXT] * 2 and slept.details["freed_bytes"] == 2 * (SHARD + 4 * GIB)
    woken = await executor.execute(op("promote", NVME, GPU))
    engine = the_engine(driver)
    assert control_calls(engine)[2:] == [
        "POST /resume_memory_occupation",
        "POST /update_weights_from_disk",  # the weights were discarded: read again from model_path
        "POST /continue_generation",
    ]
    assert engine["pid"] == pid and engine["paused"] is None and engine["released"] == []  # the same process
    assert woken.details["state"] == "running" and woken.details["taken_bytes"] == 2 * (SHARD + 4 * GIB)
    assert used(nvml) == [CONTEXT + SHARD + 4 * GIB] * 2
    await executor.aclose()


async def test_with_the_cpu_backup_the_release_keeps_the_weights_in_host_ram_and_the_wake_reads_nothing(
    sglang_node: Node,
) -> None:
    executor, nvml, driver = sglang_node(cpu_backup=True)
    await executor.execute(start())
    slept = await executor.execute(op("drop", GPU, None))
    assert slept.details["state"] == "asleep_host"
    assert the_engine(driver)["host_backup_bytes"] == 2 * SHARD and used(nvml) == [CONTEXT] * 2
    await executor.execute(op("promote", NVME, GPU))
    engine = the_engine(driver)
    assert "POST /update_weights_from_disk" not in engine["calls"] and engine["host_backup_bytes"] == 0
    assert used(nvml) == [CONTEXT + SHARD + 4 * GIB] * 2
    await executor.aclose()


async def test_a_restart_relaunches_with_the_new_kv_pool_and_the_old_process_exits_cleanly(sglang_node: Node) -> None:
    executor, nvml, driver = sglang_node()
    await executor.execute(start())
    old = the_engine(driver)["pid"]
    restarted = await executor.execute(op("promote", NVME, GPU, engine=step("restart", "running", 2 * GIB)))
    assert [c.split(" (")[0] for c in restarted.details["calls"]] == ["GET /get_load", "stop", "start"]
    assert "stop (exit code 0)" in restarted.details["calls"]  # SIGTERM: a clean exit
    assert not (driver / f"{old}.json").exists()  # and its record removed on the way out
    engine = the_engine(driver)
    assert engine["pid"] != old and engine["kv_pool_bytes"] == 2 * GIB
    assert engine["argv"][engine["argv"].index("--max-total-tokens") + 1] == str(2 * GIB)
    assert used(nvml) == [CONTEXT + SHARD + 2 * GIB] * 2
    await executor.aclose()


async def test_a_stop_drains_and_ends_the_process_leaving_the_gpus_empty(sglang_node: Node) -> None:
    executor, nvml, driver = sglang_node()
    await executor.execute(start())
    pid = the_engine(driver)["pid"]
    stopped = await executor.execute(op("drop", GPU, None, engine=step("stop", "running")))
    assert stopped.details["calls"] == ["GET /get_load", "stop (exit code 0)"]
    assert stopped.details["state"] == "stopped" and executor.telemetry().engines == {"sglang-coder": "stopped"}
    assert not alive(pid) and list(driver.glob("*.json")) == []
    assert used(nvml) == [0, 0] and stopped.details["freed_bytes"] == 2 * (CONTEXT + SHARD + 4 * GIB)
    await executor.aclose()


async def test_a_crashed_engine_is_reported_stopped_and_its_next_wake_is_a_cold_start(sglang_node: Node) -> None:
    executor, nvml, driver = sglang_node()
    await executor.execute(start())
    process = executor.engines_by_model["coder"].process
    assert process is not None and process.popen is not None
    os.kill(process.popen.pid, signal.SIGKILL)  # the engine crashes
    process.popen.wait()
    assert len(list(driver.glob("*.json"))) == 1 and used(nvml) == [0, 0]  # its record left, its memory freed
    drift = await executor.reconcile()
    assert len(drift) == 1 and "crashed: sglang-coder exited with code -9" in drift[0]
    assert executor.telemetry().engines == {"sglang-coder": "stopped"}
    wake = op("promote", NVME, GPU, engine=step("wake", "asleep_discarded"))  # the plan saw no crash
    again = await executor.execute(wake)
    assert again.details["calls"][-1].startswith("start") and again.details["state"] == "running"  # a cold start
    assert used(nvml) == [CONTEXT + SHARD + 4 * GIB] * 2  # launched as the step's instance
    await executor.aclose()


@pytest.mark.parametrize(
    ("totals_gib", "why"),
    [
        # the weights fit, and nothing is left for the pool beyond the 10 % kept back
        (1.6, "Not enough memory. Please try to increase --mem-fraction-static."),
        (1, "CUDA out of memory on device 0 loading the weights"),  # 1.5 GiB of context and weights
    ],
)
async def test_a_start_the_gpus_cannot_hold_is_a_permanent_error_saying_why(
    sglang_node: Node, totals_gib: float, why: str
) -> None:
    executor, nvml, driver = sglang_node(totals_gib)
    with pytest.raises(PermanentError, match="sglang-coder exited with code 1: .*" + why.replace(".", r"\.")):
        await executor.execute(start())
    assert records(driver) == [] and used(nvml) == [0, 0]
    assert executor.telemetry().engines == {"sglang-coder": "stopped"}
    await executor.aclose()


async def test_an_engine_its_own_scheduler_error_takes_down_is_reported_crashed(sglang_node: Node) -> None:
    """A resume of memory that was not released fails in SGLang's scheduler, which takes the server down
    (fakes/sglang.py, run_sglang.py): the agent did not ask for that exit, so it is a crash."""
    executor, nvml, _driver = sglang_node()
    await executor.execute(start())
    process = executor.engines_by_model["coder"].process
    assert process is not None and process.popen is not None
    async with httpx.AsyncClient() as http:
        url = executor.engines_by_model["coder"].url
        answer = await http.post(f"{url}/resume_memory_occupation", json={"tags": ["weights"]})
    assert answer.status_code == 500
    assert process.popen.wait(timeout=10) == -signal.SIGKILL and used(nvml) == [0, 0]
    drift = await executor.reconcile()
    assert len(drift) == 1 and f"exited with code {-signal.SIGKILL}" in drift[0]
    assert executor.telemetry().engines == {"sglang-coder": "stopped"}
    await executor.aclose()
