"""Run the fake vLLM as its own process (for the agent's managed-engine tests, as a launch spec's command).

python tests/fakes/run_vllm.py --port 8000 --model m [--shard-bytes N] [--kv-pool-bytes N] [--no-dev-mode]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fakes.vllm import FakeVllmEngine, create_fake_vllm  # after the path is set


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--shard-bytes", type=int, default=1 << 30)
    parser.add_argument("--kv-pool-bytes", type=int, default=1 << 30)
    parser.add_argument("--no-dev-mode", action="store_true")
    args = parser.parse_args()
    devices = tuple(int(d) for d in os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",") if d)
    engine = FakeVllmEngine(
        model=args.model,
        gpus=devices,
        shard_bytes=args.shard_bytes,
        kv_pool_bytes=args.kv_pool_bytes,
        dev_mode=not args.no_dev_mode and os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
    )
    uvicorn.run(create_fake_vllm(engine), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
