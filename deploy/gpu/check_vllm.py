"""Drive real vLLM through the node agent's executor on an NVIDIA GPU, and measure each transition.

    python deploy/gpu/check_vllm.py [--out gpu_check_report.json] [--port 8765] [--gpu 0]

Needs an NVIDIA GPU with its driver, `vllm` (with torch and transformers, which it brings) and this
repository installed. Where there is no GPU (NVML does not start or sees no device) or no vllm, it prints
why and exits 0: CI never needs a GPU.

What it does, with nothing downloaded:
  1. builds a tiny random-weight Llama-architecture checkpoint and a word-level tokenizer in a temp dir;
  2. through `VLLMExecutor` (a managed engine whose launch spec is `vllm serve --enable-sleep-mode` with
     `VLLM_SERVER_DEV_MODE=1`): start, sleep level 1, wake, sleep level 2, wake with reload_weights, a restart
     with another KV pool (`--kv-cache-memory-bytes`), stop;
  3. after each wake, start and restart, sends `POST /v1/completions` and checks it answers;
  4. checks the contract rules the fake vLLM (tests/fakes/vllm.py) claims: `/is_sleeping` after each sleep and
     wake, a level-0 sleep only pauses (`/is_sleeping` true until `wake_up?tags=scheduling`), `/collective_rpc`
     without `method` is a 400, the dev endpoints exist;
  5. writes a JSON report: per transition the executor's wall seconds, the GPU bytes NVML saw before and
     after, the calls made, and `constants`: figures for planner_service/domain/engines.py's defaults.

Exit status: 0 when every check passed (or there is nothing to check), 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MODEL = "tiny-llama"
WORDS = [f"w{i}" for i in range(480)] + ["hello", "world", "the", "a", "is", "of"]


def no_gpu_reason() -> str | None:
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as error:
        return f"NVML did not start ({error})"
    if count == 0:
        return "NVML sees no GPU"
    try:
        import vllm  # noqa: F401  # only whether it is installed
    except ImportError:
        return "vllm is not installed"
    return None


def build_checkpoint(directory: Path) -> None:
    """A 2-layer Llama with random weights and a word-level tokenizer, saved as vLLM loads a local model."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=512,  # >= the tokenizer's ids, a multiple of 64
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)


def operation(action: str, src: str | None, dst: str | None, *, engine: dict[str, Any] | None = None) -> Any:
    from clients.agent.operations import Operation

    where = {
        "gpu": {"tier": "gpu", "gpu": "g0"},
        "host": {"tier": "host", "node": "n"},
        "nvme": {"tier": "nvme", "node": "n"},
    }
    return Operation.model_validate(
        {
            "id": f"check.{action}",
            "action": action,
            "object": {"kind": "weights", "model": MODEL, "precision": "bf16"},
            "from": where.get(src or ""),
            "to": where.get(dst or ""),
            "bytes": 1,
            "keep_source": False,
            "node": "n",
            "priority": "background",
            "depends_on": [],
            "estimated_seconds": 0.0,
            "reason": "gpu check",
            "engine": engine,
        }
    )


def restart_step(kv_pool_bytes: int) -> dict[str, Any]:
    ref = {
        "id": f"{MODEL}@bf16@g0",
        "node": "n",
        "kind": "vllm",
        "model": MODEL,
        "precision": "bf16",
        "gpus": ["g0"],
        "kv_pool_bytes_per_gpu": kv_pool_bytes,
        "features": ["sleep_mode", "dev_mode"],
    }
    return {"transition": "restart", "instance": ref, "from_state": "running"}


async def drive(checkpoint: Path, port: int, gpu: int, kv_pool_bytes: int) -> dict[str, Any]:
    import httpx

    from clients.agent.config import AgentConfig
    from clients.agent.executors.vllm import VLLMExecutor

    url = f"http://127.0.0.1:{port}"
    launch = {
        "command": [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            "{model_path}",
            "--served-model-name",
            "{model}",
            "--port",
            "{port}",
            "--enable-sleep-mode",
            "--enforce-eager",
            "--max-model-len",
            "512",
            "--kv-cache-memory-bytes",
            "{kv_pool_bytes_per_gpu}",
        ],
        "env": {"VLLM_SERVER_DEV_MODE": "1"},
        "port": port,
        "ready_timeout_seconds": 600,
    }
    config = AgentConfig.model_validate(
        {
            "node_id": "n",
            "executor": "vllm",
            "gpus": [{"id": "g0", "device": gpu}],
            "engine_gpus": {MODEL: ["g0"]},
            "engines": {
                MODEL: {
                    "url": url,
                    "features": ["sleep_mode", "dev_mode"],
                    "management": "managed",
                    "model_path": str(checkpoint),
                    "launch": launch,
                }
            },
        }
    )
    executor = VLLMExecutor.from_config(config)
    executor.engines_by_model[MODEL].process.values = {  # type: ignore[union-attr]  # a managed engine has one
        **executor.engines_by_model[MODEL].process.values,  # type: ignore[union-attr]  # as above
        "kv_pool_bytes_per_gpu": kv_pool_bytes,
    }
    checks: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=120) as http:

        async def check(name: str, passed: bool, detail: Any = None) -> None:
            checks.append({"check": name, "passed": bool(passed), "detail": detail})

        async def answers(after: str) -> None:
            r = await http.post(
                f"{url}/v1/completions", json={"model": MODEL, "prompt": "hello world", "max_tokens": 4}
            )
            await check(
                f"a request answers after {after}", r.status_code == 200 and r.json().get("choices"), r.status_code
            )

        async def sleeping(expected: bool, after: str) -> None:
            body = (await http.get(f"{url}/is_sleeping")).json()
            await check(f"/is_sleeping is {expected} after {after}", body.get("is_sleeping") is expected, body)

        plan = [
            ("start", operation("promote", "nvme", "gpu"), None),
            ("sleep_level_1", operation("demote", "gpu", "host"), True),
            ("wake_from_host", operation("promote", "host", "gpu"), False),
            ("sleep_level_2", operation("drop", "gpu", None), True),
            ("wake_with_reload", operation("promote", "nvme", "gpu"), False),
            (
                "restart_other_kv_pool",
                operation("promote", "nvme", "gpu", engine=restart_step(2 * kv_pool_bytes)),
                None,
            ),
            (
                "stop",
                operation("drop", "gpu", None, engine={**restart_step(2 * kv_pool_bytes), "transition": "stop"}),
                None,
            ),
        ]
        for name, op, asleep in plan:
            started = time.perf_counter()
            try:
                outcome = await executor.execute(op)
            except Exception as error:  # noqa: BLE001  # the report says what failed, then the run goes on
                steps.append({"transition": name, "error": f"{type(error).__name__}: {error}"})
                await check(f"{name} succeeds", False, str(error))
                continue
            steps.append(
                {
                    "transition": name,
                    "seconds": round(time.perf_counter() - started, 4),
                    "measured_bytes": outcome.measured_bytes,
                    **outcome.details,
                }
            )
            await check(f"{name} succeeds", True)
            if asleep is not None:
                await sleeping(asleep, name)
            if name in ("start", "wake_from_host", "wake_with_reload", "restart_other_kv_pool"):
                await answers(name)
            if name == "start":
                r = await http.post(f"{url}/collective_rpc", json={})
                await check("/collective_rpc without method is a 400", r.status_code == 400, r.status_code)
            if name == "wake_with_reload":  # level 0 pauses the scheduler and moves no memory (vllm/v1/engine/core.py)
                await http.post(f"{url}/sleep", params={"level": 0, "mode": "wait"})
                await sleeping(True, "sleep level 0")
                await http.post(f"{url}/wake_up", params={"tags": "scheduling"})
                await sleeping(False, "wake_up tags=scheduling")
    await executor.aclose()
    return {"steps": steps, "checks": checks, "constants": constants(steps)}


def constants(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures for EngineConstants from the measured steps (the tiny model's copies are negligible, so each
    transition's time is its fixed part)."""
    by = {s["transition"]: s for s in steps if "seconds" in s}
    out: dict[str, Any] = {}
    if "wake_from_host" in by:
        out["wake_fixed_seconds"] = by["wake_from_host"]["seconds"]
    if "wake_with_reload" in by and "wake_from_host" in by:
        out["reload_fixed_seconds"] = round(by["wake_with_reload"]["seconds"] - by["wake_from_host"]["seconds"], 4)
    if "sleep_level_2" in by:
        out["sleep_fixed_seconds"] = by["sleep_level_2"]["seconds"]
    if "start" in by:
        out["cold_start_fixed_seconds"] = by["start"]["seconds"]
    if "stop" in by:
        out["stop_fixed_seconds"] = by["stop"]["seconds"]
    start, slept = by.get("start", {}), by.get("sleep_level_1", {})
    if "gpu_used_bytes_before" in start and "gpu_used_bytes_after" in slept:
        out["context_bytes_per_gpu"] = slept["gpu_used_bytes_after"] - start["gpu_used_bytes_before"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check_report.json"))
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--gpu", type=int, default=0, help="CUDA device index")
    parser.add_argument("--kv-pool-bytes", type=int, default=256 * 1024 * 1024)
    args = parser.parse_args()
    reason = no_gpu_reason()
    if reason is not None:
        print(f"no GPU check: {reason}")
        return 0
    import vllm

    with tempfile.TemporaryDirectory(prefix="statebudget-gpu-check-") as tmp:
        checkpoint = Path(tmp) / MODEL
        build_checkpoint(checkpoint)
        report = asyncio.run(drive(checkpoint, args.port, args.gpu, args.kv_pool_bytes))
    report["machine"] = {"host": platform.node(), "python": platform.python_version(), "vllm": vllm.__version__}
    args.out.write_text(json.dumps(report, indent=2))
    failed = [c["check"] for c in report["checks"] if not c["passed"]]
    for c in report["checks"]:
        print(("ok    " if c["passed"] else "FAIL  ") + c["check"])
    print(f"report: {args.out}; constants: {json.dumps(report['constants'])}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
