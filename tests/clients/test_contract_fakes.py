"""The contract fakes reject what the real engines reject (each rule cites its engine file in the fake)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from clients_helpers import driver_nvml
from fakes.lmcache import FakeLMCacheController, create_fake_lmcache
from fakes.nvml import FakeNvml, NVMLError
from fakes.serve import free_port
from fakes.sglang import FakeSglangEngine, create_fake_sglang
from fakes.vllm import FakeVllmEngine, create_fake_vllm
from fakes.vllm_serving import ServingState, serving_app
from fastapi import FastAPI

pytestmark = pytest.mark.anyio
GIB = 1 << 30


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fake")


def vllm(**kw: object) -> FakeVllmEngine:
    return FakeVllmEngine(model="m", gpus=(0, 1), shard_bytes=4 * GIB, kv_pool_bytes=10 * GIB, **kw)  # type: ignore[arg-type]  # kw: any field


async def test_vllm_dev_endpoints_exist_only_in_dev_mode() -> None:
    engine = vllm(dev_mode=False)
    async with client(create_fake_vllm(engine)) as http:
        for method, path in [
            ("POST", "/sleep"),
            ("POST", "/wake_up"),
            ("GET", "/is_sleeping"),
            ("POST", "/collective_rpc"),
            ("POST", "/reset_prefix_cache"),
        ]:
            assert (await http.request(method, path)).status_code == 404, path
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/v1/models")).json()["data"][0]["id"] == "m"


async def test_vllm_sleep_defaults_to_abort_and_wait_lets_requests_finish() -> None:
    engine = vllm()
    async with client(create_fake_vllm(engine)) as http:
        engine.in_flight = 3
        assert (await http.post("/sleep")).status_code == 200
        assert engine.aborted == 3 and engine.level == 1
        await http.post("/wake_up")
        engine.in_flight = 2
        engine_app_wait = http.post("/sleep", params={"level": 2, "mode": "wait"})
        engine.in_flight = 0  # they finish
        assert (await engine_app_wait).status_code == 200
        assert engine.aborted == 3 and engine.level == 2
        assert (await http.post("/sleep", params={"mode": "drain"})).status_code == 500


async def test_vllm_level_1_keeps_a_host_backup_that_wake_frees_and_level_2_needs_a_reload() -> None:
    engine = vllm()
    async with client(create_fake_vllm(engine)) as http:
        awake = engine.gpu_bytes()
        assert awake == {0: engine.context_bytes + 14 * GIB, 1: engine.context_bytes + 14 * GIB}
        await http.post("/sleep", params={"level": 1})
        assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True}
        assert engine.gpu_bytes() == {0: engine.context_bytes, 1: engine.context_bytes}  # the residue
        assert engine.host_backup_bytes == 8 * GIB
        await http.post("/wake_up", params={"tags": "weights"})
        assert engine.host_backup_bytes == 0 and engine.weights_valid and engine.sleeping  # KV not yet back
        await http.post("/wake_up", params={"tags": "kv_cache"})
        assert engine.gpu_bytes() == awake and engine.answers()
        await http.post("/sleep", params={"level": 2})
        assert engine.host_backup_bytes == 0
        assert (await http.post("/collective_rpc", json={"method": "reload_weights"})).status_code == 500
        await http.post("/wake_up")
        assert not engine.answers()  # uninitialised weights
        assert (await http.post("/collective_rpc", json={})).status_code == 400
        assert (await http.post("/collective_rpc", json={"method": "reload_weights"})).status_code == 200
        assert engine.answers()


async def test_vllm_every_sleep_pauses_level_0_only_pauses_and_a_second_sleep_changes_nothing() -> None:
    engine = vllm()
    async with client(create_fake_vllm(engine)) as http:
        awake = engine.gpu_bytes()
        await http.post("/sleep", params={"level": 0})
        assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True}  # core.py: the scheduler is paused
        assert engine.gpu_bytes() == awake
        await http.post("/wake_up", params={"tags": "scheduling"})
        assert (await http.get("/is_sleeping")).json() == {"is_sleeping": False}
        await http.post("/sleep", params={"level": 1})
        await http.post("/sleep", params={"level": 2})  # abstract.py: "Executor is already sleeping."
        assert engine.level == 1 and engine.host_backup_bytes == 8 * GIB
        await http.post("/wake_up", params={"tags": "weights"})
        await http.post("/wake_up", params={"tags": "weights"})  # awake already: nothing is woken
        assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True}  # until every tag is awake
        await http.post("/wake_up", params={"tags": "kv_cache"})
        assert (await http.get("/is_sleeping")).json() == {"is_sleeping": False} and engine.answers()


async def test_vllm_a_wake_without_room_on_the_gpus_fails_stays_asleep_and_needs_a_reload() -> None:
    room: list[str | None] = ["CUDA out of memory on device 1"]
    engine = vllm(reserve=lambda need: room[0])
    async with client(create_fake_vllm(engine)) as http:
        await http.post("/sleep", params={"level": 1})
        asleep = engine.gpu_bytes()
        failed = await http.post("/wake_up", params={"tags": "weights"})
        assert failed.status_code == 500 and "out of memory" in failed.text
        assert (await http.get("/is_sleeping")).json() == {"is_sleeping": True}
        assert engine.gpu_bytes() == asleep and engine.host_backup_bytes == 0  # cumem.py: rolled back, backup gone
        room[0] = None
        await http.post("/wake_up")
        assert not engine.answers()  # the weights' memory is mapped again, but holds nothing
        await http.post("/collective_rpc", json={"method": "reload_weights"})
        assert engine.answers()


async def test_vllm_without_sleep_mode_refuses_to_sleep_and_a_dead_engine_is_unhealthy() -> None:
    engine = vllm(sleep_mode=False)
    async with client(create_fake_vllm(engine)) as http:
        assert (await http.post("/sleep")).status_code == 500
        engine.alive = False
        assert (await http.get("/health")).status_code == 503


def sglang(**kw: object) -> FakeSglangEngine:
    return FakeSglangEngine(model_path="/models/m", gpus=(0,), shard_bytes=4 * GIB, kv_pool_bytes=8 * GIB, **kw)  # type: ignore[arg-type]  # kw: any field


async def test_sglang_release_while_busy_takes_the_server_down() -> None:
    engine = sglang()
    async with client(create_fake_sglang(engine)) as http:
        engine.running = 1
        assert (await http.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
        assert engine.running == 1  # in_place keeps them
        assert (await http.post("/release_memory_occupation", json={"tags": ["weights"]})).status_code == 500
        assert not engine.alive


async def test_sglang_pause_defaults_to_abort_and_flush_is_400_while_running() -> None:
    engine = sglang()
    async with client(create_fake_sglang(engine)) as http:
        engine.running = 2
        assert (await http.post("/flush_cache")).status_code == 400
        assert (await http.post("/pause_generation", json={"mode": "nope"})).status_code == 400
        await http.post("/pause_generation")
        assert engine.aborted == 2
        assert (await http.post("/flush_cache")).status_code == 200


async def test_sglang_release_discards_weights_without_cpu_backup() -> None:
    for backup in (False, True):
        engine = sglang(cpu_backup=backup)
        async with client(create_fake_sglang(engine)) as http:
            assert (await http.post("/release_memory_occupation", json={"tags": ["weights"]})).json()["success"]
            assert engine.gpu_bytes() == {0: engine.context_bytes + 8 * GIB}
            assert (await http.post("/resume_memory_occupation", json={"tags": ["weights"]})).status_code == 200
            assert engine.weights_valid is backup
            bad = await http.post("/update_weights_from_disk", json={"model_path": "m"})
            assert bad.status_code == 400 and not bad.json()["success"]
            await http.post("/update_weights_from_disk", json={"model_path": "/models/m"})
            assert engine.weights_valid


async def test_sglang_without_memory_saver_refuses_release_and_resume_needs_a_release() -> None:
    engine = sglang(memory_saver=False)
    async with client(create_fake_sglang(engine)) as http:
        assert (await http.post("/release_memory_occupation", json={})).status_code == 400
    engine = sglang()
    async with client(create_fake_sglang(engine)) as http:
        assert (await http.post("/resume_memory_occupation", json={"tags": ["weights"]})).status_code == 500


async def test_lmcache_pin_needs_tokens_clear_is_per_location_move_needs_two_instances() -> None:
    ctl = FakeLMCacheController(instances={"a", "b"})
    tokens = list(range(512))
    ctl.store("a", "LocalCPUBackend", tokens)
    ctl.store("a", "LocalCPUBackend", list(range(1000, 1256)))  # another session's chunk
    async with client(create_fake_lmcache(ctl)) as http:
        assert (await http.post("/pin", json={"instance_id": "a", "location": "LocalCPUBackend"})).status_code == 422
        pinned = await http.post("/pin", json={"instance_id": "a", "location": "LocalCPUBackend", "tokens": tokens})
        assert pinned.json()["num_tokens"] == 512
        same = {"old_position": ["a", "LocalCPUBackend"], "new_position": ["a", "LocalDiskBackend"], "tokens": tokens}
        assert (await http.post("/move", json=same)).status_code == 500
        other = {**same, "new_position": ["b", "LocalCPUBackend"]}
        assert (await http.post("/move", json=other)).json()["num_tokens"] == 512
        assert (await http.post("/move", json={**other, "new_position": ["c", "x"]})).status_code == 500
        cleared = await http.post("/clear", json={"instance_id": "a", "location": "LocalCPUBackend"})
        assert cleared.json()["num_tokens"] == 256  # every session's chunks at that location
        assert (await http.post("/clear", json={"instance_id": "a"})).status_code == 422


async def test_lmcache_has_no_unpin_and_a_pin_lapses_after_its_timeout_unless_pinned_again() -> None:
    now = [0.0]
    ctl = FakeLMCacheController(instances={"a"}, clock=lambda: now[0])
    tokens = list(range(300))  # one full chunk and part of another
    ctl.store("a", "LocalCPUBackend", tokens)
    pin = {"instance_id": "a", "location": "LocalCPUBackend", "tokens": tokens}
    async with client(create_fake_lmcache(ctl)) as http:
        assert (await http.post("/pin", json=pin)).json()["num_tokens"] == 256
        assert (await http.post("/unpin", json=pin)).status_code == 404
        assert (await http.post("/pin", json={**pin, "instance_id": "x"})).status_code == 500  # not registered
        now[0] = 200.0
        assert (await http.post("/pin", json=pin)).status_code == 200  # the countdown starts again
        now[0] = 450.0
        assert ctl.pinned_tokens("a", "LocalCPUBackend", tokens) == 256
        now[0] = 501.0
        assert ctl.pinned_tokens("a", "LocalCPUBackend", tokens) == 0  # 301 s after the last pin
    assert ctl.pin_requests == [pin, pin]


async def test_vllm_tokenize_takes_a_prompt_or_messages_and_refuses_the_rest() -> None:
    state = ServingState(models=["m"])
    chat = {"model": "m", "messages": [{"role": "user", "content": "fix the bug"}]}
    async with client(serving_app(state)) as http:
        text = await http.post("/tokenize", json={"model": "m", "prompt": "a b"})
        assert (text.json()["count"], len(text.json()["tokens"])) == (2, 2)
        assert (await http.post("/tokenize", json=chat)).json()["count"] == 3
        assert (await http.post("/tokenize", json={"model": "m"})).status_code == 400
        assert (await http.post("/tokenize", json={"model": "m", "prompt": [1, 2]})).status_code == 400
        both = {**chat, "add_generation_prompt": True, "continue_final_message": True}
        assert (await http.post("/tokenize", json=both)).status_code == 400
        assert (await http.post("/tokenize", json={**chat, "model": "other"})).status_code == 404
    assert state.tokenized == [{"model": "m", "prompt": "a b"}, chat]


def test_fake_nvml_follows_the_engines_and_refuses_what_nvml_refuses() -> None:
    engine = vllm()
    nvml = FakeNvml([80 * GIB, 80 * GIB, 80 * GIB], lambda: [engine])
    with pytest.raises(NVMLError):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    with pytest.raises(NVMLError):
        nvml.nvmlDeviceGetHandleByIndex(3)
    used = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(1)).used
    assert used == engine.context_bytes + 14 * GIB
    engine.sleep(1, "wait")
    memory = nvml.nvmlDeviceGetMemoryInfo(1)
    assert memory.used == engine.context_bytes and memory.free == 80 * GIB - engine.context_bytes
    assert nvml.nvmlDeviceGetMemoryInfo(2).used == 0
    assert [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(0)] == [engine.pid]


FAKES = Path(__file__).resolve().parents[1] / "fakes"


def wait_healthy(process: subprocess.Popen[bytes], url: str, what: str) -> None:
    """Until `url/health` answers 200; fails if the process exits first or 30 s pass."""
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health").status_code == 200:
                return
        assert process.poll() is None and time.monotonic() < deadline, f"{what} did not start"
        time.sleep(0.1)


@contextlib.contextmanager
def vllm_process(driver: Path, totals: str, *, shard_gib: int) -> Iterator[str]:
    """tests/fakes/run_vllm.py on device 0, holding a 1 GiB context, `shard_gib` of weights and a 2 GiB KV pool."""
    port = free_port()
    argv = [sys.executable, str(FAKES / "run_vllm.py"), "--port", str(port), "--model", "m"]
    argv += ["--shard-bytes", str(shard_gib * GIB), "--kv-pool-bytes", str(2 * GIB), "--context-bytes", str(GIB)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "VLLM_SERVER_DEV_MODE": "1"}
    env["STATEBUDGET_FAKE_NVML_TOTALS"] = totals
    process = subprocess.Popen([*argv, "--driver-dir", str(driver)], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, "the fake vLLM")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_fake_vllm_processes_never_take_more_of_a_device_than_it_has(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wake onto a device another engine filled meanwhile fails (CUDA out of memory, cumem.py), so NVML, as
    on a real device, never counts more in use than the device has."""
    totals = str(12 * GIB)
    nvml = driver_nvml(tmp_path, totals, monkeypatch)
    with vllm_process(tmp_path, totals, shard_gib=4) as first:
        httpx.post(f"{first}/sleep", params={"level": 1}).raise_for_status()  # 7 GiB -> its 1 GiB context
        with vllm_process(tmp_path, totals, shard_gib=5):  # 8 GiB: 9 of 12 in use
            woken = httpx.post(f"{first}/wake_up", params={"tags": "weights"})
            memory = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0))
            assert woken.status_code == 500 and "out of memory" in woken.text
            assert (memory.used, memory.free) == (9 * GIB, 3 * GIB)
        assert httpx.post(f"{first}/wake_up").status_code == 200  # the other one has stopped: room again
        assert nvml.nvmlDeviceGetMemoryInfo(0).used == 7 * GIB


def sglang_argv(driver: Path, port: int, *flags: str) -> list[str]:
    """tests/fakes/run_sglang.py with a 0.5 GiB context and a 1 GiB weights shard on each GPU, a KV cell of a
    byte (so that `--max-total-tokens` is the pool in bytes)."""
    argv = [sys.executable, str(FAKES / "run_sglang.py"), "--model-path", "/m", "--port", str(port), *flags]
    return [*argv, "--enable-memory-saver", "--driver-dir", str(driver)]


@contextlib.contextmanager
def sglang_process(driver: Path, totals: str, devices: str, *flags: str) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": devices, "STATEBUDGET_FAKE_NVML_TOTALS": totals}
    process = subprocess.Popen(sglang_argv(driver, port, *flags), env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, "the fake SGLang")
        yield url
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0  # SIGTERM: a clean exit


@pytest.mark.slow
def test_fake_sglang_process_sizes_its_kv_pool_at_start_as_sglang_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool is what the TP group's fullest GPU has free after the weights, less the share
    `--mem-fraction-static` keeps back, capped by `--max-total-tokens`, and nothing left is SGLang's "Not enough
    memory" before the server answers (model_runner_kv_cache_mixin.py `profile_max_num_token`, `init_memory`)."""
    totals = f"{8 * GIB},{8 * GIB}"
    nvml = driver_nvml(tmp_path, totals, monkeypatch)
    with sglang_process(tmp_path, totals, "1", "--max-total-tokens", str(2 * GIB)):  # 3.5 GiB on device 1
        with sglang_process(tmp_path, totals, "0,1", "--tp-size", "2", "--mem-fraction-static", "0.9",
                            "--max-total-tokens", str(4 * GIB)):  # fmt: skip
            kept_back = int(8 * GIB * (1 - 0.9))
            pool = 8 * GIB - 7 * GIB // 2 - GIB // 2 - GIB - kept_back  # device 1: its neighbour, context, weights
            assert nvml.nvmlDeviceGetMemoryInfo(0).used == GIB // 2 + GIB + pool < 4 * GIB  # less than asked
            assert nvml.nvmlDeviceGetMemoryInfo(1).used == 7 * GIB // 2 + GIB // 2 + GIB + pool
            for device, flags, why in [
                ("1", [], "CUDA out of memory on device 1 loading the weights"),  # 0.8 GiB free: no room for them
                ("0", ["--mem-fraction-static", "0.5"], "Not enough memory. Please try to increase --mem-fraction"),
            ]:  # 4.3 GiB free on device 0: the weights fit, then 4 GiB are kept back and nothing is left
                env = {**os.environ, "CUDA_VISIBLE_DEVICES": device, "STATEBUDGET_FAKE_NVML_TOTALS": totals}
                argv = sglang_argv(tmp_path, free_port(), *flags)
                refused = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
                assert refused.returncode == 1 and why in refused.stderr
        assert nvml.nvmlDeviceGetMemoryInfo(0).used == 0  # the TP-2 engine has exited: its bytes are freed
    assert list(tmp_path.glob("*.json")) == []  # each clean exit took its record with it


async def test_sglang_tokenize_takes_a_prompt_or_messages_and_refuses_both_or_neither() -> None:
    engine = sglang()
    chat = {"model": "m", "messages": [{"role": "user", "content": "fix the bug"}], "tool_choice": "auto"}
    async with client(create_fake_sglang(engine)) as http:
        text = (await http.post("/tokenize", json={"model": "m", "prompt": "a b"})).json()
        assert (text["count"], len(text["tokens"]), text["max_model_len"]) == (2, 2, 32768)
        assert (await http.post("/v1/tokenize", json=chat)).json()["count"] == 3
        batch = (await http.post("/tokenize", json={"prompt": ["a", "b c"]})).json()
        assert batch["count"] == [1, 2] and len(batch["tokens"]) == 2
        for wrong in ({"model": "m"}, {**chat, "prompt": "a"}):
            answer = await http.post("/tokenize", json=wrong)
            assert answer.status_code == 400
            assert answer.json()["message"] == "Exactly one of 'prompt' or 'messages' must be provided."
    assert engine.tokenized == [{"model": "m", "prompt": "a b"}, chat, {"prompt": ["a", "b c"]}]
