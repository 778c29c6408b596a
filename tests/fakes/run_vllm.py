"""Run the fake vLLM as its own process (for the agent's managed-engine tests, as a launch spec's command).

python tests/fakes/run_vllm.py --port 8000 --model m [--shard-bytes N | --weights-bytes bf16=N ... --precision bf16
    [--experts-bytes N --gpu-expert-fraction F]] [--kv-pool-bytes N] [--context-bytes N] [--no-dev-mode]
    [--driver-dir DIR] [--startup-seconds S]

The GPUs are `CUDA_VISIBLE_DEVICES` (device indices, the group). With `--weights-bytes` the shard on each GPU is
what the engine model says an engine allocates (planner_service/domain/engines.py `EngineInstance.shard_bytes`):
the non-expert weights at `--precision` plus the GPU share of the routed experts, split over the group.

With `--driver-dir` the process keeps `DIR/<pid>.json` up to date with the bytes it holds on each GPU (after
every request), the "driver" state that the fake NVML module (tests/fakes/nvml_driver/pynvml.py) reads, and
removes it when it exits cleanly; a killed process leaves it, and the fake NVML counts only living pids, as
the driver frees a dead process's memory. Memory is taken as the driver gives it: the start and each wake
check the devices' free bytes and record what they take under one lock on the directory, so that two
processes never both get the last free bytes (a device never holds more than it has, as NVML never shows).
`--startup-seconds` waits before serving, as a real engine loads its weights and compiles before `/health`
answers.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import time
from pathlib import Path

import uvicorn
from starlette.requests import Request

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fakes.gpu_driver import driver_lock, free_bytes, totals, write_record  # after the path is set
from fakes.vllm import FakeVllmEngine, create_fake_vllm

LMCACHE_INSTANCE_ENV = "LMCACHE_LMCACHE_INSTANCE_ID"  # as the agent sets it (lmcache/v1/config.py `_from_env`)


def shard_bytes(args: argparse.Namespace, tp: int) -> int:
    if not args.weights_bytes:
        return int(args.shard_bytes)
    by_precision = dict(item.split("=", 1) for item in args.weights_bytes)
    if args.precision not in by_precision:
        raise SystemExit(f"--precision {args.precision!r}: no --weights-bytes for it ({sorted(by_precision)})")
    gpu_experts = math.floor(args.experts_bytes * args.gpu_expert_fraction)
    return math.ceil((int(by_precision[args.precision]) + gpu_experts) / max(tp, 1))


def write_holdings(engine: FakeVllmEngine, path: Path, gpu_bytes: dict[int, int] | None = None) -> None:
    """The engine's record for the fake NVML: what it holds now, or `gpu_bytes` while a wake maps them."""
    held = engine.gpu_bytes() if gpu_bytes is None else gpu_bytes
    record = {
        "pid": engine.pid,
        "model": engine.model,
        "gpu_bytes": {str(d): b for d, b in held.items()},
        "level": engine.level,
        "shard_bytes": engine.shard_bytes,
        "kv_pool_bytes": engine.kv_pool_bytes,
        "context_bytes": engine.context_bytes,
        "lmcache_instance_id": os.environ.get(LMCACHE_INSTANCE_ENV),
        "argv": sys.argv,
    }
    write_record(path, record)


def out_of_memory(engine: FakeVllmEngine, driver_dir: Path, need: dict[int, int]) -> str | None:
    """Why the engine cannot hold `need` bytes on its GPUs: more than each device has free beside the other
    living processes. vLLM fails a start the same way (vllm/v1/worker/gpu_worker.py: the free memory at start
    must cover the requested share, else a ValueError, and an allocation past it is a CUDA out-of-memory
    error), and a wake (vllm/device_allocator/cumem.py: `create_and_map` raises, the wake is rolled back)."""
    free = free_bytes(driver_dir, engine.pid)
    if free is None:
        return None
    capacity = totals() or []
    for device, wanted in need.items():
        if wanted > free[device]:
            return (
                f"CUDA out of memory on device {device}: {wanted} bytes needed, {free[device]} free of "
                f"{capacity[device]}"
            )
    return None


def reserve(engine: FakeVllmEngine, driver_dir: Path, holdings: Path, need: dict[int, int]) -> str | None:
    """Take `need` (the engine's bytes per device once a wake has mapped them) if the devices have room."""
    with driver_lock(driver_dir):
        why = out_of_memory(engine, driver_dir, need)
        if why is None:
            write_holdings(engine, holdings, need)
        return why


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--shard-bytes", type=int, default=1 << 30)
    parser.add_argument("--weights-bytes", action="append", default=[], help="PRECISION=BYTES (repeatable)")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--experts-bytes", type=int, default=0)
    parser.add_argument("--gpu-expert-fraction", type=float, default=1.0)
    parser.add_argument("--kv-pool-bytes", type=int, default=1 << 30)
    parser.add_argument("--context-bytes", type=int, default=512 * 1024 * 1024)
    parser.add_argument("--no-dev-mode", action="store_true")
    parser.add_argument("--driver-dir", type=Path)
    parser.add_argument("--startup-seconds", type=float, default=0.0)
    args = parser.parse_args()
    devices = tuple(int(d) for d in os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",") if d)
    engine = FakeVllmEngine(
        model=args.model,
        gpus=devices,
        shard_bytes=shard_bytes(args, len(devices)),
        kv_pool_bytes=args.kv_pool_bytes,
        context_bytes=args.context_bytes,
        dev_mode=not args.no_dev_mode and os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
    )
    time.sleep(args.startup_seconds)
    app = create_fake_vllm(engine)
    if args.driver_dir is not None:
        args.driver_dir.mkdir(parents=True, exist_ok=True)
        holdings = args.driver_dir / f"{engine.pid}.json"
        with driver_lock(args.driver_dir):
            oom = out_of_memory(engine, args.driver_dir, engine.gpu_bytes())
            if oom:
                print(oom, file=sys.stderr, flush=True)
                sys.exit(1)
            write_holdings(engine, holdings)
        driver_dir = args.driver_dir
        engine.reserve = lambda need: reserve(engine, driver_dir, holdings, need)

        @app.middleware("http")
        async def after_each_request(request: Request, call_next):  # type: ignore[no-untyped-def]  # Starlette types call_next loosely
            response = await call_next(request)
            write_holdings(engine, holdings)
            return response

    # uvicorn shuts down on SIGTERM, then raises it again under the handler it found: this one, an exit 0
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(0))
    try:
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    finally:
        if args.driver_dir is not None:
            with contextlib.suppress(OSError):
                holdings.unlink()


if __name__ == "__main__":
    main()
