"""A stand-in `pynvml` module for agent processes on a machine without GPUs: put this directory first on
PYTHONPATH and `import pynvml` finds it instead of nvidia-ml-py, so the agent's real probe
(clients/agent/probes.py `default_probe`) reads the fake engines' memory.

The device totals come from `STATEBUDGET_FAKE_NVML_TOTALS` (bytes per device index, comma-separated), the
processes from `STATEBUDGET_FAKE_NVML_DIR`: each fake engine process (tests/fakes/run_vllm.py and
run_sglang.py `--driver-dir`, on the books of tests/fakes/gpu_driver.py) keeps `<pid>.json` there with the
bytes it holds per device. A file whose pid no longer runs counts for nothing: the driver frees a dead
process's memory. The calls and errors are those of tests/fakes/nvml.py.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fakes.gpu_driver import alive  # after the path is set
from fakes.nvml import FakeNvml, NVMLError

__all__ = [
    "NVMLError",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetMemoryInfo",
    "nvmlInit",
    "nvmlShutdown",
]


@dataclass(frozen=True)
class _Process:
    pid: int
    held: dict[int, int]

    def gpu_bytes(self) -> dict[int, int]:
        return self.held


def _processes() -> list[_Process]:
    out = []
    for path in sorted(Path(os.environ["STATEBUDGET_FAKE_NVML_DIR"]).glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # removed while listed
        if alive(int(record["pid"])):
            out.append(_Process(int(record["pid"]), {int(d): int(b) for d, b in record["gpu_bytes"].items()}))
    return out


_nvml = FakeNvml([int(t) for t in os.environ["STATEBUDGET_FAKE_NVML_TOTALS"].split(",")], _processes)
nvmlInit = _nvml.nvmlInit
nvmlShutdown = _nvml.nvmlShutdown
nvmlDeviceGetCount = _nvml.nvmlDeviceGetCount
nvmlDeviceGetHandleByIndex = _nvml.nvmlDeviceGetHandleByIndex
nvmlDeviceGetMemoryInfo = _nvml.nvmlDeviceGetMemoryInfo
nvmlDeviceGetComputeRunningProcesses = _nvml.nvmlDeviceGetComputeRunningProcesses
