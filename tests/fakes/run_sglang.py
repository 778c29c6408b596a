"""Run the fake SGLang server as its own process, launched as `python -m sglang.launch_server` would be (for the
agent's managed-engine tests, as a launch spec's command).

python tests/fakes/run_sglang.py --model-path PATH [--port 30000] [--tp-size N] [--enable-memory-saver]
    [--enable-weights-cpu-backup] [--mem-fraction-static F] [--max-total-tokens N]
    [--shard-bytes N] [--kv-cell-bytes N] [--context-bytes N] [--driver-dir DIR] [--startup-seconds S]

SGLang's own flags, as python/sglang/srt/server_args.py `ServerArgs` defines them (a field `x_y` is the flag
`--x-y`): `--model-path` (alias `--model`), `--port` (default 30000), `--tp-size` (alias
`--tensor-parallel-size`, default 1), `--enable-memory-saver` (release/resume memory occupation),
`--enable-weights-cpu-backup` (released weights kept in host RAM), `--mem-fraction-static` (the share of each
GPU for weights and KV pool) and `--max-total-tokens` (the KV pool's tokens at most). The fake's model is
given by the rest: `--shard-bytes` of weights on each GPU, `--kv-cell-bytes` of KV per token on each GPU
(SGLang computes it from the model config: model_runner_kv_cache_mixin.py `get_cell_size_per_token`; 1 makes
`--max-total-tokens` a size in bytes) and `--context-bytes` of CUDA context.

The GPUs are the first `--tp-size` of `CUDA_VISIBLE_DEVICES` (SGLang's rank r uses GPU `base_gpu_id + r *
gpu_id_step`, server_args.py; both default to 0 and 1). The KV pool is sized at start as SGLang sizes it
(python/sglang/srt/model_executor/model_runner_kv_cache_mixin.py `profile_max_num_token` and `init_memory`):
after the weights are loaded, the pool gets what each GPU has free beyond the `1 - mem_fraction_static`
share of its total kept back, in whole tokens, capped by `--max-total-tokens`; over a TP group, the least
any GPU has free (python/sglang/srt/utils/common.py `get_available_gpu_memory`: an all-reduce MIN);
no token left is "Not enough memory. Please try to increase --mem-fraction-static." and weights that do not
fit are a CUDA out-of-memory error, either way before the server answers, with exit code 1. (Without
`--mem-fraction-static` SGLang picks a share from the GPU's size, server_args.py; the fake then keeps
nothing back.) Where the devices have no known size (no `STATEBUDGET_FAKE_NVML_TOTALS`) the pool is
`--max-total-tokens`, which is then required.

With `--driver-dir` the process keeps `DIR/<pid>.json` (tests/fakes/gpu_driver.py) up to date with the bytes
it holds on each GPU after every request, for the fake NVML, and removes it when it exits cleanly (SIGTERM);
a killed process leaves it, and the fake NVML counts only living pids. The HTTP API and its rules are those
of tests/fakes/sglang.py; where they end the engine (a release while requests run, a resume of memory not
released: the scheduler's error) the process dies as SGLang's does: the failed scheduler sends SIGQUIT to the
launching process, which kills its process tree and itself with SIGKILL (python/sglang/srt/entrypoints/engine.py
`sigquit_handler`, python/sglang/srt/utils/common.py `kill_process_tree`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import uvicorn
from starlette.requests import Request

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fakes.gpu_driver import driver_lock, free_bytes, totals, write_record  # after the path is set
from fakes.sglang import FakeSglangEngine, create_fake_sglang

NOT_ENOUGH_MEMORY = "Not enough memory. Please try to increase --mem-fraction-static."  # model_runner_kv_cache_mixin.py


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--model-path", "--model", dest="model_path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--max-total-tokens", type=int)
    parser.add_argument("--shard-bytes", type=int, default=1 << 30)
    parser.add_argument("--kv-cell-bytes", type=int, default=1)
    parser.add_argument("--context-bytes", type=int, default=512 * 1024 * 1024)
    parser.add_argument("--driver-dir", type=Path)
    parser.add_argument("--startup-seconds", type=float, default=0.0)
    args = parser.parse_args(argv)
    if args.tp_size < 1:
        parser.error(f"--tp-size {args.tp_size}: at least 1")
    if args.mem_fraction_static is not None and not 0 < args.mem_fraction_static <= 1:
        parser.error(f"--mem-fraction-static {args.mem_fraction_static}: a share in (0, 1]")
    if args.kv_cell_bytes < 1:
        parser.error(f"--kv-cell-bytes {args.kv_cell_bytes}: at least 1")
    return args


def kv_pool_tokens(args: argparse.Namespace, devices: tuple[int, ...], free: list[int] | None) -> int | str:
    """The KV pool's tokens on each GPU of the group, or why the start fails (SGLang's sizing, see above)."""
    if free is None:
        if args.max_total_tokens is None:
            return "--max-total-tokens is required where the devices have no known size"
        tokens = args.max_total_tokens
    else:
        capacity = totals() or []
        loaded = args.context_bytes + args.shard_bytes  # the context, then the weights shard
        for device in devices:
            if loaded > free[device]:
                return (
                    f"torch.OutOfMemoryError: CUDA out of memory on device {device} loading the weights: "
                    f"{loaded} bytes needed, {free[device]} free of {capacity[device]}"
                )
        kept_back = 1.0 - (args.mem_fraction_static if args.mem_fraction_static is not None else 1.0)
        rest = min(free[d] - loaded - int(capacity[d] * kept_back) for d in devices)  # the least over the group
        tokens = max(rest, 0) // args.kv_cell_bytes
        if args.max_total_tokens is not None:
            tokens = min(tokens, args.max_total_tokens)
    return tokens if tokens > 0 else f"RuntimeError: {NOT_ENOUGH_MEMORY}"


def write_holdings(engine: FakeSglangEngine, path: Path) -> None:
    """The engine's record for the fake NVML (what it holds now) and for a test (why, and what it was asked)."""
    record = {
        "pid": engine.pid,
        "model_path": engine.model_path,
        "gpu_bytes": {str(d): b for d, b in engine.gpu_bytes().items()},
        "released": sorted(engine.released),
        "shard_bytes": engine.shard_bytes,
        "kv_pool_bytes": engine.kv_pool_bytes,
        "context_bytes": engine.context_bytes,
        "host_backup_bytes": engine.host_backup_bytes,
        "paused": engine.paused,
        "aborted": engine.aborted,
        "calls": engine.calls,  # every request the server took, in order
        "argv": sys.argv,
    }
    write_record(path, record)


def main() -> None:
    args = arguments()
    visible = tuple(int(d) for d in os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",") if d)
    if len(visible) < args.tp_size:
        sys.exit(f"--tp-size {args.tp_size}: only {len(visible)} GPU(s) visible ({visible})")
    devices = visible[: args.tp_size]
    time.sleep(args.startup_seconds)  # the weights load before the server answers

    def started(tokens: int) -> FakeSglangEngine:
        return FakeSglangEngine(
            model_path=args.model_path,
            gpus=devices,
            shard_bytes=args.shard_bytes,
            kv_pool_bytes=tokens * args.kv_cell_bytes,
            context_bytes=args.context_bytes,
            memory_saver=args.enable_memory_saver,
            cpu_backup=args.enable_weights_cpu_backup,
        )

    holdings: Path | None = None
    if args.driver_dir is None:
        tokens = kv_pool_tokens(args, devices, None)
        if isinstance(tokens, str):
            sys.exit(tokens)
        engine = started(tokens)
    else:
        args.driver_dir.mkdir(parents=True, exist_ok=True)
        with driver_lock(args.driver_dir):  # sized and taken at once: no other process takes the same bytes
            tokens = kv_pool_tokens(args, devices, free_bytes(args.driver_dir, os.getpid()))
            if isinstance(tokens, str):
                print(tokens, file=sys.stderr, flush=True)
                sys.exit(1)
            engine = started(tokens)
            holdings = args.driver_dir / f"{engine.pid}.json"
            write_holdings(engine, holdings)

    app = create_fake_sglang(engine)

    @app.middleware("http")
    async def after_each_request(request: Request, call_next):  # type: ignore[no-untyped-def]  # Starlette types call_next loosely
        response = await call_next(request)
        if holdings is not None:
            write_holdings(engine, holdings)
        if not engine.alive:  # the scheduler failed: the server goes down with it, once this answer is out
            asyncio.get_running_loop().call_later(0.1, os.kill, os.getpid(), signal.SIGKILL)
        return response

    print(f"KV pool: {tokens} tokens, {engine.kv_pool_bytes} bytes per GPU on {list(devices)}", flush=True)
    # uvicorn shuts down on SIGTERM, then raises it again under the handler it found: this one, an exit 0
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(0))
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        if holdings is not None:
            with contextlib.suppress(OSError):
                holdings.unlink()


if __name__ == "__main__":
    main()
