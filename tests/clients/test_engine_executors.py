"""Engine executors against fake vLLM / SGLang / LMCache servers that record every call.

The fakes define only the real endpoints (an unknown path answers 404, which the
executor reports as a permanent failure), so a test also catches a wrong name.
"""

from __future__ import annotations

import asyncio
import subprocess
from typing import Any

import httpx
import pytest
from clients_helpers import async_client, make_app, request_event, served
from fastapi import FastAPI, Request, Response

from clients.agent.config import AgentConfig, LMCacheConfig
from clients.agent.errors import CapabilityError, PermanentError, TemporaryError
from clients.agent.executors.engine_http import EngineHttp
from clients.agent.executors.lmcache import LMCacheExecutor
from clients.agent.executors.sglang import SGLangExecutor
from clients.agent.executors.vllm import VLLMExecutor
from clients.agent.operations import Operation
from clients.agent.probes import NvidiaSmiProbe
from clients.agent.runner import Agent

pytestmark = pytest.mark.anyio

Call = tuple[str, str, dict[str, Any], Any]


class FakeEngine:
    """A FastAPI app with the given routes; each call is recorded as (method, path, query, json)."""

    def __init__(self, routes: list[tuple[str, str]]) -> None:
        self.calls: list[Call] = []
        self.fail: dict[str, Response] = {}
        self.app = FastAPI()
        for method, path in routes:
            self.app.add_api_route(path, self._handler(path), methods=[method])

    def _handler(self, path: str):
        async def handle(request: Request) -> Response:
            body = await request.body()
            query = {
                k: v if len(v) > 1 else v[0] for k in request.query_params for v in [request.query_params.getlist(k)]
            }
            self.calls.append((request.method, path, query, (await request.json()) if body else None))
            return self.fail.get(path) or Response(status_code=200)

        return handle


def vllm_fake() -> FakeEngine:
    return FakeEngine([("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/collective_rpc")])


def sglang_fake() -> FakeEngine:
    routes = ["/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_disk", "/flush_cache"]
    return FakeEngine([("POST", r) for r in routes])


def lmcache_fake() -> FakeEngine:
    return FakeEngine([("POST", "/move"), ("POST", "/pin"), ("POST", "/clear"), ("POST", "/lookup")])


def http_for(**fakes: FakeEngine) -> EngineHttp:
    mounts = {f"http://{name}": httpx.ASGITransport(app=fake.app) for name, fake in fakes.items()}
    return EngineHttp(http_client=httpx.AsyncClient(mounts=mounts))


def op(action: str, obj: dict[str, Any], src: dict | None, dst: dict | None, keep: bool = False) -> Operation:
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
        }
    )


W = {"kind": "weights", "model": "coder", "precision": "bf16"}
KV = {"kind": "kv", "model": "coder", "session": "s7"}
EXPERTS = {"kind": "experts", "model": "coder"}
GPU, HOST, NVME = {"tier": "gpu", "gpu": "n1-g0"}, {"tier": "host", "node": "n1"}, {"tier": "nvme", "node": "n1"}
LMC = LMCacheConfig(url="http://lmcache", instance_id="inst-1")


@pytest.mark.parametrize(
    ("operation", "expected"),
    [
        (op("demote", W, GPU, HOST), [("POST", "/sleep", {"level": "1"}, None)]),
        (op("demote", W, GPU, NVME), [("POST", "/sleep", {"level": "2"}, None)]),
        (op("drop", W, GPU, None), [("POST", "/sleep", {"level": "2"}, None)]),
        (
            op("promote", W, HOST, GPU, keep=False),
            [("POST", "/wake_up", {"tags": "weights"}, None), ("POST", "/wake_up", {"tags": "kv_cache"}, None)],
        ),
        (
            op("promote", W, NVME, GPU, keep=True),
            [
                ("POST", "/wake_up", {"tags": "weights"}, None),
                ("POST", "/collective_rpc", {}, {"method": "reload_weights"}),
                ("POST", "/wake_up", {"tags": "kv_cache"}, None),
            ],
        ),
    ],
    ids=["gpu->host", "gpu->nvme", "drop-gpu", "host->gpu", "nvme->gpu"],
)
async def test_vllm_weights_calls(operation, expected):
    vllm = vllm_fake()
    executor = VLLMExecutor({"coder": "http://vllm-coder"}, http=http_for(**{"vllm-coder": vllm}))
    outcome = await executor.execute(operation)
    assert vllm.calls == expected
    assert outcome.measured_seconds >= 0 and outcome.details["calls"] == [f"POST {c[1]}" for c in expected]


async def test_vllm_kv_goes_through_lmcache_and_what_it_cannot_do_names_the_capability():
    vllm, lmcache = vllm_fake(), lmcache_fake()
    http = http_for(**{"vllm-coder": vllm, "lmcache": lmcache})
    executor = VLLMExecutor({"coder": "http://vllm-coder"}, http=http, lmcache=LMCacheExecutor(LMC, http=http))
    assert {c.value for c in executor.capabilities} == {"weights_offload", "kv_offload"}
    await executor.execute(op("demote", KV, HOST, NVME))
    assert lmcache.calls == [
        (
            "POST",
            "/move",
            {},
            {
                "old_position": ["inst-1", "LocalCPUBackend"],
                "new_position": ["inst-1", "LocalDiskBackend"],
                "copy": False,
            },
        )
    ]
    with pytest.raises(CapabilityError, match="partial_experts") as info:
        await executor.execute(op("promote", EXPERTS, NVME, GPU, keep=True))
    assert info.value.capability == "partial_experts"
    with pytest.raises(CapabilityError, match="weights_offload"):
        await executor.execute(op("demote", W, HOST, NVME))
    without_lmcache = VLLMExecutor({"coder": "http://vllm-coder"}, http=http)
    with pytest.raises(CapabilityError, match="kv_offload"):
        await without_lmcache.execute(op("drop", KV, GPU, None))
    with pytest.raises(PermanentError, match="no vLLM engine configured for model 'other'"):
        await executor.execute(op("drop", {**W, "model": "other"}, GPU, None))
    assert vllm.calls == []  # nothing was sent for what could not be done


async def test_engine_failures_are_sorted_into_temporary_and_permanent():
    vllm = vllm_fake()
    executor = VLLMExecutor(
        {"coder": "http://vllm-coder", "gone": "http://nowhere"}, http=http_for(**{"vllm-coder": vllm})
    )
    vllm.fail["/sleep"] = Response("overloaded", status_code=503)
    with pytest.raises(TemporaryError, match="503"):
        await executor.execute(op("drop", W, GPU, None))
    vllm.fail["/sleep"] = Response("bad level", status_code=400)
    with pytest.raises(PermanentError, match="400") as info:
        await executor.execute(op("drop", W, GPU, None))
    assert not isinstance(info.value, TemporaryError)

    refused = VLLMExecutor({"coder": "http://127.0.0.1:9"}, http=EngineHttp(timeout_seconds=2))  # nothing listens
    with pytest.raises(TemporaryError, match="unreachable"):
        await refused.execute(op("drop", W, GPU, None))
    await refused.aclose()


@pytest.mark.parametrize(
    ("operation", "expected"),
    [
        (op("drop", W, GPU, None), [("POST", "/release_memory_occupation", {}, {"tags": ["weights"]})]),
        (op("demote", W, GPU, NVME), [("POST", "/release_memory_occupation", {}, {"tags": ["weights"]})]),
        (
            op("promote", W, NVME, GPU, keep=True),
            [
                ("POST", "/resume_memory_occupation", {}, {"tags": ["weights"]}),
                ("POST", "/update_weights_from_disk", {}, {"model_path": "/models/coder"}),
            ],
        ),
        (op("drop", KV, GPU, None), [("POST", "/flush_cache", {}, None)]),
        (op("promote", KV, None, GPU), []),
    ],
    ids=["drop-gpu", "gpu->nvme", "nvme->gpu", "kv-drop", "kv-prefill"],
)
async def test_sglang_calls(operation, expected):
    sglang = sglang_fake()
    executor = SGLangExecutor(
        {"coder": "http://sglang-coder"},
        model_paths={"coder": "/models/coder"},
        http=http_for(**{"sglang-coder": sglang}),
    )
    await executor.execute(operation)
    assert sglang.calls == expected


async def test_sglang_cannot_keep_weights_in_host_memory_nor_move_kv():
    sglang = sglang_fake()
    executor = SGLangExecutor({"coder": "http://sglang-coder"}, http=http_for(**{"sglang-coder": sglang}))
    with pytest.raises(CapabilityError, match="weights_offload"):
        await executor.execute(op("demote", W, GPU, HOST))
    with pytest.raises(CapabilityError, match="kv_offload"):
        await executor.execute(op("promote", KV, HOST, GPU, keep=True))
    with pytest.raises(CapabilityError, match="partial_experts"):
        await executor.execute(op("demote", EXPERTS, GPU, NVME))
    assert sglang.calls == []
    sglang.fail["/flush_cache"] = Response('{"success": false, "message": "not idle"}', media_type="application/json")
    with pytest.raises(PermanentError, match="not idle"):
        await executor.execute(op("drop", KV, GPU, None))


@pytest.mark.parametrize(
    ("operation", "expected"),
    [
        (op("demote", KV, GPU, HOST), [("POST", "/pin", {}, {"instance_id": "inst-1", "location": "LocalCPUBackend"})]),
        (
            op("promote", KV, NVME, HOST, keep=True),
            [
                (
                    "POST",
                    "/move",
                    {},
                    {
                        "old_position": ["inst-1", "LocalDiskBackend"],
                        "new_position": ["inst-1", "LocalCPUBackend"],
                        "copy": True,
                    },
                )
            ],
        ),
        (
            op("promote", KV, HOST, GPU, keep=True),
            [("POST", "/pin", {}, {"instance_id": "inst-1", "location": "LocalCPUBackend"})],
        ),
        (
            op("drop", KV, NVME, None),
            [("POST", "/clear", {}, {"instance_id": "inst-1", "location": "LocalDiskBackend"})],
        ),
        (op("promote", KV, None, GPU), []),
    ],
    ids=["gpu->host", "nvme->host", "host->gpu", "drop-disk", "prefill"],
)
async def test_lmcache_calls(operation, expected):
    lmcache = lmcache_fake()
    executor = LMCacheExecutor(LMC, http=http_for(lmcache=lmcache))
    await executor.execute(operation)
    assert lmcache.calls == expected


async def test_lmcache_sends_token_ids_when_it_knows_them_and_moves_only_kv():
    lmcache = lmcache_fake()
    executor = LMCacheExecutor(
        LMC, http=http_for(lmcache=lmcache), tokens_for=lambda obj: [1, 2, 3] if obj.session == "s7" else None
    )
    await executor.execute(op("drop", KV, HOST, None))
    assert lmcache.calls == [
        ("POST", "/clear", {}, {"instance_id": "inst-1", "location": "LocalCPUBackend", "tokens": [1, 2, 3]})
    ]
    with pytest.raises(CapabilityError, match="weights_offload"):
        await executor.execute(op("drop", W, HOST, None))
    with pytest.raises(CapabilityError, match="kv_offload"):
        await executor.execute(op("drop", KV, GPU, None))


async def test_agent_with_the_vllm_executor_end_to_end(tmp_path):
    """drop alpha on n1's GPU, then wake beta from NVMe and let its KV be prefilled: the service confirms all."""
    alpha, beta, lmcache = vllm_fake(), vllm_fake(), lmcache_fake()
    http = http_for(**{"vllm-alpha": alpha, "vllm-beta": beta, "lmcache": lmcache})
    executor = VLLMExecutor(
        {"alpha": "http://vllm-alpha", "beta": "http://vllm-beta"}, http=http, lmcache=LMCacheExecutor(LMC, http=http)
    )
    config = AgentConfig(node_id="n1", executor="vllm", lease_wait_seconds=0.2, heartbeat_seconds=0.1)
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
        async with asyncio.timeout(10):
            while agent.stats["done"] < 3:
                await asyncio.sleep(0.05)
        stop.set()
        await task
        assert alpha.calls == [("POST", "/sleep", {"level": "2"}, None)]
        assert [c[1] for c in beta.calls] == ["/wake_up", "/collective_rpc", "/wake_up"]
        assert lmcache.calls == []  # the KV is prefilled by the engine on the next request
        assert (await sb.get_srv()).version == before + 3
        cluster = await sb.get_cluster()
        assert next(n for n in cluster.nodes if n.id == "n1").capabilities == ["kv_offload", "weights_offload"]


class ScriptedProbe:
    """Device memory as a list of readings (bytes in use), one per look."""

    def __init__(self, *readings: int) -> None:
        self.readings = list(readings)

    def used_bytes(self, gpu_id: str) -> int | None:
        return self.readings.pop(0)


async def test_reclaimed_bytes_are_measured_on_the_device_not_promised():
    vllm = vllm_fake()
    probe = ScriptedProbe(30_000, 29_400)  # the engine said it slept; the device freed 600 of 1000 bytes
    executor = VLLMExecutor({"coder": "http://vllm-coder"}, http=http_for(**{"vllm-coder": vllm}), probe=probe)
    outcome = await executor.execute(op("drop", W, GPU, None))
    assert outcome.measured_bytes == 600 and outcome.details["shortfall_bytes"] == 400
    sglang = sglang_fake()
    executor = SGLangExecutor(
        {"coder": "http://sglang-coder"}, http=http_for(**{"sglang-coder": sglang}), probe=ScriptedProbe(0, 1000)
    )
    outcome = await executor.execute(op("promote", W, NVME, GPU, keep=True))
    assert outcome.measured_bytes == 1000 and "shortfall_bytes" not in outcome.details


def test_nvidia_smi_probe_reads_the_device_of_a_gpu_id():
    seen = []

    def run(cmd, **kw):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="1234\n", stderr="")

    probe = NvidiaSmiProbe({"n1-g1": 1}, run=run)
    assert probe.used_bytes("n1-g1") == 1234 * 1024 * 1024 and probe.used_bytes("n9-g0") is None
    assert seen == [["nvidia-smi", "--id=1", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]]
