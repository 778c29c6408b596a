"""The vLLM and SGLang executors against the contract fakes served over real HTTP: the right calls in the
right order, the fakes' end states, and the bytes NVML (the fake, following the engines) saw freed or taken."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from clients_helpers import async_client, driver_nvml, make_app, request_event, served
from fakes.nvml import FakeNvml
from fakes.serve import free_port, serving
from fakes.sglang import FakeSglangEngine, create_fake_sglang
from fakes.vllm import FakeVllmEngine, create_fake_vllm
from pydantic import ValidationError

from clients.agent.config import AgentConfig
from clients.agent.errors import PermanentError, TemporaryError
from clients.agent.executors.engine import EngineExecutor
from clients.agent.executors.sglang import SGLangExecutor
from clients.agent.executors.vllm import VLLMExecutor
from clients.agent.operations import Operation
from clients.agent.probes import NvmlProbe
from clients.agent.runner import Agent
from planner_service.wire.nodes import GpuTelemetryIn

pytestmark = pytest.mark.anyio
GIB = 1 << 30
GPUS = [{"id": "n1-g0", "device": 0}, {"id": "n1-g1", "device": 1}]
VLLM_FEATURES = ["sleep_mode", "dev_mode"]


def op(
    action: str, obj: dict[str, Any], src: dict | None, dst: dict | None, keep: bool = False, **extra: Any
) -> Operation:
    return Operation.model_validate(
        {
            "id": "1.op-1",
            "action": action,
            "object": obj,
            "from": src,
            "to": dst,
            "bytes": 1000,
            "keep_source": keep,
            "node": "n1",
            "priority": "background",
            "depends_on": [],
            "estimated_seconds": 0.0,
            "reason": "",
            **extra,
        }
    )


W = {"kind": "weights", "model": "coder", "precision": "bf16"}
KV = {"kind": "kv", "model": "coder", "session": "s7"}
EXPERTS = {"kind": "experts", "model": "coder"}
GPU, HOST, NVME = {"tier": "gpu", "gpu": "n1-g0"}, {"tier": "host", "node": "n1"}, {"tier": "nvme", "node": "n1"}


def nvml_for(*engines: Any) -> NvmlProbe:
    return NvmlProbe({"n1-g0": 0, "n1-g1": 1}, FakeNvml([80 * GIB, 80 * GIB], lambda: engines))


def vllm_config(
    url: str, *, features: list[str] = VLLM_FEATURES, gpus: list[str] | None = None, **engine: Any
) -> AgentConfig:
    return AgentConfig.model_validate(
        {
            "node_id": "n1",
            "executor": "vllm",
            "gpus": GPUS,
            "engines": {"coder": {"url": url, "features": features, **engine}},
            "engine_gpus": {"coder": gpus or ["n1-g0", "n1-g1"]},
        }
    )


@contextlib.contextmanager
def vllm_engine(**kw: Any) -> Iterator[tuple[FakeVllmEngine, str]]:
    engine = FakeVllmEngine(model="coder", gpus=(0, 1), shard_bytes=4 * GIB, kv_pool_bytes=10 * GIB, **kw)
    with serving(create_fake_vllm(engine)) as url:
        yield engine, url


def control_calls(engine: Any) -> list[str]:
    return [c for c in engine.calls if not c.startswith(("GET /health", "GET /v1/models", "GET /get_model_info"))]


async def test_vllm_sleep_level_1_drains_with_wait_once_per_instance_and_measures_the_freed_bytes() -> None:
    with vllm_engine() as (engine, url):
        executor = VLLMExecutor.from_config(vllm_config(url), probe=nvml_for(engine))
        engine.in_flight = 0
        outcome = await executor.execute(op("demote", W, GPU, HOST))
        assert control_calls(engine) == ["GET /is_sleeping", "POST /sleep?level=1&mode=wait"]  # one call, two GPUs
        assert engine.level == 1 and engine.aborted == 0 and engine.host_backup_bytes == 8 * GIB
        assert outcome.measured_bytes == 2 * 14 * GIB  # both GPUs' shard + KV pool; the context stays
        assert outcome.details["state"] == "asleep_host"
        await executor.aclose()


async def test_vllm_sleep_waits_for_running_requests_instead_of_aborting_them() -> None:
    with vllm_engine() as (engine, url):
        executor = VLLMExecutor.from_config(vllm_config(url))
        engine.in_flight = 2

        async def finish() -> None:
            await asyncio.sleep(0.3)
            engine.in_flight = 0

        finishing = asyncio.create_task(finish())
        await executor.execute(op("drop", W, GPU, None))
        await finishing
        assert engine.level == 2 and engine.aborted == 0
        await executor.aclose()


async def test_an_engine_without_the_configured_dev_mode_is_reported_at_start() -> None:
    with vllm_engine(dev_mode=False) as (_engine, url):
        executor = VLLMExecutor.from_config(vllm_config(url))
        drift = await executor.reconcile()
        assert drift == ["vllm-coder: no /is_sleeping (VLLM_SERVER_DEV_MODE unset)"]
        assert await executor.reconcile() == []  # said once
        await executor.aclose()


async def test_vllm_wake_after_level_1_copies_back_and_after_level_2_reloads() -> None:
    with vllm_engine() as (engine, url):
        executor = VLLMExecutor.from_config(vllm_config(url), probe=nvml_for(engine))
        await executor.execute(op("demote", W, GPU, HOST))
        engine.calls.clear()
        woken = await executor.execute(op("promote", W, HOST, GPU))
        assert control_calls(engine) == [
            "GET /is_sleeping",
            "POST /wake_up?tags=weights",
            "POST /wake_up?tags=kv_cache",
        ]
        assert engine.answers() and engine.host_backup_bytes == 0 and woken.measured_bytes == 2 * 14 * GIB
        engine.calls.clear()
        dropped = await executor.execute(op("drop", W, GPU, None))
        assert control_calls(engine) == ["GET /is_sleeping", "POST /sleep?level=2&mode=wait"]
        assert dropped.details["state"] == "asleep_discarded" and dropped.measured_bytes == 2 * 14 * GIB
        assert engine.level == 2 and engine.host_backup_bytes == 0
        engine.calls.clear()
        await executor.execute(op("promote", W, NVME, GPU))
        assert control_calls(engine) == [
            "GET /is_sleeping",
            "POST /wake_up?tags=weights",
            "POST /collective_rpc",
            "POST /wake_up?tags=kv_cache",
        ]
        assert engine.answers()
        await executor.aclose()


async def test_vllm_a_wake_out_of_gpu_memory_is_temporary_and_the_next_wake_reloads_the_weights() -> None:
    """A failed wake has freed the host backup of what it copied back (cumem.py): the engine still sleeps, but
    not at level 1 any more, so it is not reported with its weights in host RAM and its next wake reloads them."""
    room: list[str | None] = ["no room on device 1"]
    with vllm_engine(reserve=lambda need: room[0]) as (engine, url):
        executor = VLLMExecutor.from_config(vllm_config(url))
        await executor.execute(op("demote", W, GPU, HOST))
        with pytest.raises(TemporaryError, match="out of memory"):
            await executor.execute(op("promote", W, HOST, GPU))
        await executor.reconcile()
        assert executor.telemetry().engines == {"vllm-coder": "asleep_discarded"} and engine.sleeping
        room[0] = None
        engine.calls.clear()
        await executor.execute(op("promote", W, HOST, GPU))
        assert "POST /collective_rpc" in engine.calls and engine.answers()
        await executor.aclose()


async def test_vllm_after_the_agent_restarts_a_sleeping_engine_is_read_not_remembered() -> None:
    with vllm_engine() as (engine, url):
        first = VLLMExecutor.from_config(vllm_config(url))
        await first.execute(op("demote", W, GPU, HOST))
        await first.aclose()
        second = VLLMExecutor.from_config(vllm_config(url))  # a new agent: knows nothing of the level
        assert await second.reconcile() == ["vllm-coder: asleep at an unknown level: its wake reloads the weights"]
        assert second.telemetry().engines == {"vllm-coder": "asleep_discarded"}
        engine.calls.clear()
        again = await second.execute(op("demote", W, GPU, HOST))  # the same operation re-leased: applied once
        assert "nothing_to_do" in again.details and control_calls(engine) == ["GET /is_sleeping"]
        await second.execute(op("promote", W, HOST, GPU))
        assert "POST /collective_rpc" in engine.calls and engine.answers()  # unknown level: reloaded
        await second.aclose()


async def test_vllm_keep_source_promote_then_host_drop_is_nothing_and_experts_move_with_the_weights() -> None:
    with vllm_engine() as (engine, url):
        executor = VLLMExecutor.from_config(vllm_config(url))
        await executor.execute(op("demote", W, GPU, HOST))
        assert "nothing_to_do" in (await executor.execute(op("demote", EXPERTS, GPU, HOST))).details
        await executor.execute(op("promote", W, HOST, GPU, keep=True))
        assert engine.host_backup_bytes == 0
        dropped = await executor.execute(op("drop", W, HOST, None))
        assert "backup" in dropped.details["nothing_to_do"]
        assert "nothing_to_do" in (await executor.execute(op("promote", EXPERTS, HOST, GPU))).details
        await executor.execute(op("drop", W, GPU, None))
        await executor.execute(op("promote", W, NVME, GPU))
        assert engine.answers()  # reloaded, not woken with uninitialised weights
        await executor.aclose()


async def test_vllm_kv_prefill_and_gpu_drop_need_nothing_and_a_session_move_is_refused_saying_why() -> None:
    with vllm_engine() as (engine, url):
        executor = VLLMExecutor.from_config(vllm_config(url))
        assert "prefill" in (await executor.execute(op("promote", KV, None, GPU))).details["nothing_to_do"]
        assert "LRU" in (await executor.execute(op("drop", KV, GPU, None))).details["nothing_to_do"]
        with pytest.raises(PermanentError, match="one request's KV"):
            await executor.execute(op("demote", KV, GPU, HOST))
        lmcache = VLLMExecutor.from_config(vllm_config(url, features=[*VLLM_FEATURES, "lmcache"]))
        assert "LMCache" in (await lmcache.execute(op("demote", KV, GPU, HOST))).details["nothing_to_do"]
        assert not [c for c in engine.calls if c.startswith("POST")]
        await executor.aclose()
        await lmcache.aclose()


async def test_vllm_missing_launch_flags_are_permanent_refusals_naming_the_flag() -> None:
    with vllm_engine(dev_mode=False) as (_engine, url):
        executor = VLLMExecutor.from_config(vllm_config(url, features=["sleep_mode"]))
        with pytest.raises(PermanentError, match="VLLM_SERVER_DEV_MODE"):
            await executor.execute(op("demote", W, GPU, HOST))
        lying = VLLMExecutor.from_config(vllm_config(url))  # configured with dev mode the engine lacks
        with pytest.raises(PermanentError, match="404"):
            await lying.execute(op("demote", W, GPU, HOST))
        with pytest.raises(PermanentError, match="adopted"):
            await lying.execute(op("drop", W, GPU, None, engine=_step("stop", "running")))
        await executor.aclose()
        await lying.aclose()


def _step(transition: str, from_state: str, **instance: Any) -> dict[str, Any]:
    ref = {
        "id": "coder@bf16@n1-g0+n1-g1",
        "node": "n1",
        "kind": "vllm",
        "model": "coder",
        "precision": "bf16",
        "gpus": ["n1-g0", "n1-g1"],
        "kv_pool_bytes_per_gpu": 0,
        **instance,
    }
    return {"transition": transition, "instance": ref, "from_state": from_state}


async def test_an_unreachable_engine_is_a_temporary_error_and_is_reported_stopped() -> None:
    executor = VLLMExecutor.from_config(vllm_config(f"http://127.0.0.1:{free_port()}"))
    with pytest.raises(TemporaryError, match="unreachable"):
        await executor.execute(op("demote", W, GPU, HOST))
    assert executor.telemetry().engines == {"vllm-coder": "stopped"}
    await executor.aclose()


@contextlib.contextmanager
def sglang_engine(**kw: Any) -> Iterator[tuple[FakeSglangEngine, str]]:
    engine = FakeSglangEngine(model_path="/models/coder", gpus=(0,), shard_bytes=4 * GIB, kv_pool_bytes=8 * GIB, **kw)
    with serving(create_fake_sglang(engine)) as url:
        yield engine, url


def sglang_config(url: str, features: list[str], **engine: Any) -> AgentConfig:
    return AgentConfig.model_validate(
        {
            "node_id": "n1",
            "executor": "sglang",
            "gpus": GPUS,
            "engine_gpus": {"coder": ["n1-g0"]},
            "engines": {"coder": {"url": url, "features": features, "model_path": "/models/coder", **engine}},
        }
    )


async def test_sglang_drains_then_pauses_in_place_releases_and_wakes_with_a_reload() -> None:
    with sglang_engine() as (engine, url):
        executor = SGLangExecutor.from_config(sglang_config(url, ["sleep_mode"]), probe=nvml_for(engine))
        engine.running = 1

        async def finish() -> None:
            await asyncio.sleep(0.5)
            engine.running = 0

        finishing = asyncio.create_task(finish())
        slept = await executor.execute(op("drop", W, GPU, None))
        await finishing
        assert engine.alive and engine.aborted == 0 and engine.released == {"weights", "kv_cache"}
        calls = control_calls(engine)
        assert calls.index("POST /pause_generation") < calls.index("POST /release_memory_occupation")
        assert slept.measured_bytes == 12 * GIB and slept.details["state"] == "asleep_discarded"
        engine.calls.clear()
        await executor.execute(op("promote", W, NVME, GPU))
        assert control_calls(engine) == [
            "POST /resume_memory_occupation",
            "POST /update_weights_from_disk",
            "POST /continue_generation",
        ]
        assert engine.answers()
        await executor.aclose()


async def test_sglang_drain_timeout_is_temporary_and_releases_nothing_and_cpu_backup_is_level_1() -> None:
    with sglang_engine(cpu_backup=True) as (engine, url):
        busy = SGLangExecutor.from_config(sglang_config(url, ["sleep_mode", "cpu_backup"], drain_timeout_seconds=0.3))
        engine.running = 2
        with pytest.raises(TemporaryError, match="still in flight"):
            await busy.execute(op("demote", W, GPU, HOST))
        assert engine.alive and not engine.released and engine.aborted == 0
        engine.running = 0
        assert (await busy.execute(op("drop", W, GPU, None))).details["state"] == "asleep_host"
        engine.calls.clear()
        await busy.execute(op("promote", W, HOST, GPU))
        assert "POST /update_weights_from_disk" not in engine.calls and engine.answers()
        await busy.aclose()


def test_sglang_needs_model_paths_in_its_configuration() -> None:
    with pytest.raises(ValidationError, match="engines.coder.model_path"):
        AgentConfig.model_validate({"node_id": "n1", "executor": "sglang", "engines": {"coder": "http://x"}})
    config = AgentConfig.model_validate(
        {"node_id": "n1", "executor": "sglang", "engines": {"coder": "http://x"}, "model_paths": {"coder": "/m"}}
    )
    assert config.engines["coder"].model_path == "/m"


async def test_readahead_reports_the_page_cache_bytes_mincore_measured(tmp_path: Path) -> None:
    checkpoint = tmp_path / "coder"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(os.urandom(4 << 20))
    with vllm_engine() as (_engine, url):
        executor = VLLMExecutor.from_config(vllm_config(url, model_path=str(checkpoint)))
        outcome = await executor.execute(op("promote", W, NVME, HOST, keep=True))
        assert outcome.details["advised_bytes"] == 4 << 20
        assert 0 < outcome.measured_bytes <= 4 << 20 and outcome.details["page_cache_fraction"] > 0
        await executor.aclose()


def managed_config(port: int, tmp_path: Path, **env: str) -> AgentConfig:
    launch = {
        "command": [
            sys.executable,
            str(Path(__file__).parent.parent / "fakes" / "run_vllm.py"),
            "--port",
            "{port}",
            "--model",
            "{model}",
            "--kv-pool-bytes",
            "{kv_pool_bytes_per_gpu}",
            "--driver-dir",  # the bytes it holds, for the fake NVML (its default shard: 1 GiB, context 0.5 GiB)
            str(tmp_path / "driver"),
        ],
        "env": {"VLLM_SERVER_DEV_MODE": "1", **env},
        "port": port,
        "ready_timeout_seconds": 30,
        "stop_timeout_seconds": 5,
    }
    return vllm_config(f"http://127.0.0.1:{port}", management="managed", launch=launch)


async def test_a_managed_engine_is_started_restarted_stopped_and_its_crash_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    nvml = driver_nvml(tmp_path / "driver", f"{80 * GIB},{80 * GIB}", monkeypatch)
    executor = VLLMExecutor.from_config(managed_config(port, tmp_path), probe=NvmlProbe({"n1-g0": 0, "n1-g1": 1}, nvml))
    assert isinstance(executor, EngineExecutor)
    started = await executor.execute(op("promote", W, NVME, GPU))
    assert started.details["state"] == "running" and started.details["calls"][-1].startswith("start")
    assert started.details["taken_bytes"] == 2 * (GIB + GIB // 2)  # weights and context on each GPU, no KV pool
    # each GPU's bytes by process, NVML's compute processes, the engine's own named by its process group
    engine_pid = executor.engines_by_model["coder"].process.launched.pid  # type: ignore[union-attr]
    for usage in executor.telemetry().gpus:
        assert usage.processes == ((engine_pid, GIB + GIB // 2, "vllm-coder"),)
        heartbeat_gpu = {
            "id": usage.id,
            "used_bytes": usage.used_bytes,
            "processes": [{"pid": p, "used_bytes": n, "engine": e} for p, n, e in usage.processes],
        }
        assert GpuTelemetryIn.model_validate(heartbeat_gpu).processes[0].engine == "vllm-coder"
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"http://127.0.0.1:{port}/is_sleeping")).json() == {"is_sleeping": False}
    restart = op("promote", W, NVME, GPU, engine=_step("restart", "running", kv_pool_bytes_per_gpu=2 * GIB))
    restarted = await executor.execute(restart)
    assert [c.split(" ")[0] for c in restarted.details["calls"]] == ["GET", "stop", "start"]
    assert "stop (exit code 0)" in restarted.details["calls"]  # SIGTERM: a clean exit, its NVML record removed
    assert len(list((tmp_path / "driver").glob("*.json"))) == 1
    assert restarted.details["taken_bytes"] == 2 * 2 * GIB  # the new KV pool on each GPU
    process = executor.engines_by_model["coder"].process
    assert (
        process is not None
        and process.popen is not None
        and "2147483648" in process.command()[-1] + str(process.popen.args)
    )
    os.kill(process.popen.pid, signal.SIGKILL)  # the engine crashes
    process.popen.wait()
    drift = await executor.reconcile()
    assert drift and "crashed" in drift[0] and executor.telemetry().engines == {"vllm-coder": "stopped"}
    again = await executor.execute(op("promote", W, HOST, GPU))  # a wake of a crashed engine is a cold start
    assert again.details["calls"][-1].startswith("start")
    stopped = await executor.execute(op("drop", W, GPU, None, engine=_step("stop", "running")))
    assert stopped.details["state"] == "stopped" and process.popen is None
    assert stopped.details["freed_bytes"] == 2 * (GIB + GIB // 2)  # started again with no KV pool
    await executor.aclose()


async def test_a_start_that_failed_is_not_tried_again_by_the_other_moves_of_its_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each GPU of a group gets its own move of one start; the engine runs out of memory at start (each device
    has 1 GiB, it needs 1.5), so the first move's start fails and the second fails with it, without a second
    cold start; the next plan's start of the same instance is tried again."""
    config = managed_config(free_port(), tmp_path, STATEBUDGET_FAKE_NVML_TOTALS=f"{GIB},{GIB}")
    executor = VLLMExecutor.from_config(config)
    step = _step("start", "stopped")
    moves = [
        op("promote", W, NVME, {"tier": "gpu", "gpu": g}, id=f"3.op-{i}", engine=step)
        for i, g in enumerate(["n1-g0", "n1-g1"])
    ]
    with caplog.at_level(logging.INFO, logger="statebudget.agent.engines"):
        with pytest.raises(PermanentError, match="CUDA out of memory"):
            await executor.execute(moves[0])
        with pytest.raises(PermanentError, match="failed for 3.op-0 of the same step: .*CUDA out of memory"):
            await executor.execute(moves[1])
        assert sum(r.getMessage().startswith("started vllm-coder") for r in caplog.records) == 1
        with pytest.raises(PermanentError, match="CUDA out of memory"):
            await executor.execute(op("promote", W, NVME, GPU, id="4.op-1", engine=step))
        assert sum(r.getMessage().startswith("started vllm-coder") for r in caplog.records) == 2
    await executor.aclose()


async def test_a_managed_engine_outlives_the_agent_and_the_next_agent_stops_it(tmp_path: Path) -> None:
    port = free_port()
    first = VLLMExecutor.from_config(managed_config(port, tmp_path))
    await first.execute(op("promote", W, NVME, GPU))
    process = first.engines_by_model["coder"].process
    assert process is not None and process.popen is not None
    second = VLLMExecutor.from_config(managed_config(port, tmp_path))  # the agent restarted: nothing remembered
    assert await second.reconcile() == [] and second.telemetry().engines == {"vllm-coder": "running"}
    again = await second.execute(op("promote", W, NVME, GPU))
    assert "nothing_to_do" in again.details  # not started twice
    stopped = await second.execute(op("drop", W, GPU, None, engine=_step("stop", "running")))
    assert stopped.details["state"] == "stopped"
    assert process.popen.wait(timeout=10) is not None  # the engine the first agent started has ended
    await first.aclose()
    await second.aclose()


async def test_agent_with_the_vllm_executor_end_to_end(tmp_path: Path) -> None:
    """drop alpha on n1's GPU, then wake beta from NVMe and let its KV be prefilled: the service confirms all."""
    alpha = FakeVllmEngine(model="alpha", gpus=(0,), shard_bytes=GIB, kv_pool_bytes=GIB)
    beta = FakeVllmEngine(model="beta", gpus=(0,), shard_bytes=GIB, kv_pool_bytes=GIB)
    beta.sleep(2, "wait")
    with serving(create_fake_vllm(alpha)) as alpha_url, serving(create_fake_vllm(beta)) as beta_url:
        config = AgentConfig.model_validate(
            {
                "node_id": "n1",
                "executor": "vllm",
                "lease_wait_seconds": 0.2,
                "heartbeat_seconds": 0.1,
                "engines": {
                    m: {"url": u, "features": VLLM_FEATURES} for m, u in (("alpha", alpha_url), ("beta", beta_url))
                },
            }
        )
        executor = VLLMExecutor.from_config(config)
        async with served(make_app(tmp_path, tiny=True)) as service:
            sb = async_client(service)
            await sb.post_events(
                request_event("e1", "s1", "beta", slo="blocking", input_tokens=1000),
                request_event("e2", "s2", "alpha", input_tokens=1000),
            )
            await sb.replan()
            before = (await sb.get_srv()).version
            agent = Agent(config, sb, executor)
            stop = asyncio.Event()
            task = asyncio.create_task(agent.run(stop))
            async with asyncio.timeout(15):
                while agent.stats["done"] < 3:
                    await asyncio.sleep(0.05)
            stop.set()
            await task
            assert "POST /sleep?level=2&mode=wait" in alpha.calls and alpha.sleeping
            assert beta.answers() and "POST /collective_rpc" in beta.calls
            assert agent.stats["failed"] == 0
            assert (await sb.get_srv()).version == before + 3
        await executor.aclose()


async def test_the_shards_of_one_instance_are_one_call_even_when_their_operations_run_at_once() -> None:
    """The plan gives each GPU of a tensor-parallel instance its own operation with the same step; the
    runner starts the operations of a lease together, so the executor must not call the engine twice."""
    with vllm_engine() as (engine, url):
        executor = VLLMExecutor.from_config(vllm_config(url), probe=nvml_for(engine))
        engine.in_flight = 0
        step = _step("sleep_level_1", "running")
        shards = [
            op("demote", W, {"tier": "gpu", "gpu": g}, HOST, id=f"1.op-{i}", engine=step)
            for i, g in enumerate(["n1-g0", "n1-g1"])
        ]
        outcomes = await asyncio.gather(*(executor.execute(o) for o in shards))
        sleeps = [c for c in control_calls(engine) if c.startswith("POST /sleep")]
        assert sleeps == ["POST /sleep?level=1&mode=wait"] and engine.level == 1
        assert [("nothing_to_do" in o.details) for o in outcomes] == [False, True]
        await executor.aclose()


async def test_heartbeats_carry_each_instance_its_state_and_the_gpus_nvml_total(tmp_path: Path) -> None:
    with vllm_engine() as (engine, url):
        config = vllm_config(url, features=[*VLLM_FEATURES, "lmcache"])
        executor = VLLMExecutor.from_config(config, probe=nvml_for(engine))
        async with served(make_app(tmp_path, tiny=True)) as service:
            agent = Agent(config, async_client(service), executor)
            await executor.reconcile()
            body = agent.heartbeat_body()
            assert [(g["id"], g["used_bytes"], g["total_bytes"]) for g in body["gpus"]] == [
                ("n1-g0", 4 * GIB + 10 * GIB + GIB // 2, 80 * GIB),
                ("n1-g1", 4 * GIB + 10 * GIB + GIB // 2, 80 * GIB),
            ]
            # the engine's process by its bytes; adopted (the agent did not start it), so named by no engine
            for g in body["gpus"]:
                assert g["processes"] == [{"pid": engine.pid, "used_bytes": g["used_bytes"], "engine": None}]
            (reported,) = body["instances"]
            assert reported["state"] == "running"
            assert reported["instance"]["id"] == "coder@bf16@n1-g0+n1-g1"
            assert reported["instance"]["features"] == ["dev_mode", "lmcache", "sleep_mode"]
            registered = executor.engines()[0]
            assert registered["features"] == ["dev_mode", "lmcache", "sleep_mode"]
            assert executor.engines_by_model["coder"].lmcache_instance_id == "n1-coder"  # one per engine
        await executor.aclose()


async def test_a_start_that_finds_the_engine_running_otherwise_relaunches_it_as_the_step_says(tmp_path: Path) -> None:
    """The plan thinks the engine stopped (its stop was superseded, say) and starts it with a 2 GiB KV pool; the
    engine runs with none. Running is not enough: the start relaunches it, once for the step's moves."""
    executor = VLLMExecutor.from_config(managed_config(free_port(), tmp_path))
    await executor.execute(op("promote", W, NVME, GPU, engine=_step("start", "stopped")))
    step = _step("start", "stopped", kv_pool_bytes_per_gpu=2 * GIB)
    moves = [
        op("promote", W, NVME, {"tier": "gpu", "gpu": g}, id=f"5.op-{i}", engine=step)
        for i, g in enumerate(["n1-g0", "n1-g1"])
    ]
    relaunched = await executor.execute(moves[0])
    assert [c.split(" ")[0] for c in relaunched.details["calls"]] == ["GET", "stop", "start"]
    assert executor.engines_by_model["coder"].launched["kv_pool_bytes_per_gpu"] == 2 * GIB
    assert "nothing_to_do" in (await executor.execute(moves[1])).details
    process = executor.engines_by_model["coder"].process
    assert process is not None
    await process.stop()  # the agent leaves its engines running when it closes: the test does not
    await executor.aclose()


async def test_a_host_drop_that_finds_the_engine_asleep_at_level_1_stops_it(tmp_path: Path) -> None:
    """The plan drops the host copy of a model whose engine it took for stopped (it planned before the heartbeat
    that reported the level-1 sleep): no call frees that backup alone, so a managed engine is stopped; an
    adopted one refuses, saying why."""
    executor = VLLMExecutor.from_config(managed_config(free_port(), tmp_path))
    await executor.execute(op("promote", W, NVME, GPU, engine=_step("start", "stopped")))
    await executor.execute(op("demote", W, GPU, HOST))  # a level-1 sleep
    assert executor.telemetry().engines == {"vllm-coder": "asleep_host"}
    dropped = await executor.execute(op("drop", W, HOST, None))
    assert dropped.details["state"] == "stopped" and executor.engines_by_model["coder"].process is not None
    assert executor.engines_by_model["coder"].process.popen is None  # the process that held the backup ended
    await executor.aclose()
    with vllm_engine() as (_, url):
        adopted = VLLMExecutor.from_config(vllm_config(url))
        await adopted.execute(op("demote", W, GPU, HOST))
        with pytest.raises(PermanentError, match="stop refused"):
            await adopted.execute(op("drop", W, HOST, None))
        await adopted.aclose()


def test_a_start_fills_the_template_with_the_instance_s_pool_in_bytes_and_tokens(tmp_path: Path) -> None:
    """`{kv_pool_tokens}` (SGLang's --max-total-tokens) is the planner's pool in tokens, `{kv_pool_bytes_per_gpu}`
    the same pool in bytes (vLLM's --kv-cache-memory-bytes), from the start's instance."""
    from clients.agent.executors.engine import _launch_values

    config = managed_config(free_port(), tmp_path)
    assert config.engines["coder"].launch is not None
    config.engines["coder"].launch.command.append("{kv_pool_tokens}")
    executor = VLLMExecutor.from_config(config)
    process = executor.engines_by_model["coder"].process
    assert process is not None
    start = op(
        "promote", W, NVME, GPU, engine=_step("start", "stopped", kv_pool_bytes_per_gpu=GIB, kv_pool_tokens=8192)
    )
    argv = process.command(**_launch_values(start))
    assert argv[-1] == "8192" and str(GIB) in argv
    assert process.command()[-1] == "0"  # a start that names no instance: the pool is the template's to fix
