"""Read GPU memory from the device through NVML (nvidia-ml-py), so that an engine's promise to free memory is
checked, not trusted, and the planner sees memory used outside its plan.

Without a GPU (or without the NVIDIA driver) the probe says so: every reading is None with the reason, never a
guess.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger("statebudget.agent.probes")


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU as NVML reports it: bytes in use, free and in all, and the bytes each process holds."""

    used_bytes: int
    free_bytes: int
    total_bytes: int
    processes: dict[int, int] = field(default_factory=dict)  # pid -> bytes


class GpuProbe(Protocol):
    reason: str  # why readings are None, when they are

    def read(self, gpu_id: str) -> GpuReading | None:
        """The GPU now, or None when this probe cannot tell."""
        ...

    def used_bytes(self, gpu_id: str) -> int | None: ...


class NullProbe:
    """No GPU to read: every answer is None, and `reason` says why."""

    def __init__(self, reason: str = "no GPU probe configured") -> None:
        self.reason = reason

    def read(self, gpu_id: str) -> GpuReading | None:
        return None

    def used_bytes(self, gpu_id: str) -> int | None:
        return None


class NvmlProbe:
    """NVML's memory info and running compute processes for the device index of each cluster GPU id.

    `nvml` is the `pynvml` module (nvidia-ml-py) or an object with its functions (the tests' fake).
    """

    def __init__(self, devices: dict[str, int], nvml: Any) -> None:
        self.devices, self._nvml = dict(devices), nvml
        self.reason = ""
        nvml.nvmlInit()

    def read(self, gpu_id: str) -> GpuReading | None:
        index = self.devices.get(gpu_id)
        if index is None:
            return None
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            processes = {p.pid: int(p.usedGpuMemory or 0) for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        except nvml.NVMLError as error:
            log.warning("NVML cannot read GPU %s (device %d): %s", gpu_id, index, error)
            return None
        return GpuReading(int(memory.used), int(memory.free), int(memory.total), processes)

    def used_bytes(self, gpu_id: str) -> int | None:
        reading = self.read(gpu_id)
        return None if reading is None else reading.used_bytes


def default_probe(devices: dict[str, int]) -> GpuProbe:
    """NVML where the library and a driver are there, else a probe that says why there is none."""
    if not devices:
        return NullProbe("no GPUs configured")
    try:
        import pynvml  # nvidia-ml-py; imported here: only a node with GPUs needs it
    except ImportError:
        return NullProbe("nvidia-ml-py is not installed")
    try:
        return NvmlProbe(devices, pynvml)
    except pynvml.NVMLError as error:
        return NullProbe(f"no GPU: NVML did not start ({error})")
