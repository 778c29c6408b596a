"""A contract fake of the NVML calls the node agent makes through `pynvml` (nvidia-ml-py), whose bytes follow
the fake engines' states.

The functions have pynvml's names and shapes: `nvmlInit`, `nvmlShutdown`, `nvmlDeviceGetCount`,
`nvmlDeviceGetHandleByIndex` (an out-of-range index raises `NVMLError`, NVML_ERROR_INVALID_ARGUMENT),
`nvmlDeviceGetMemoryInfo` (an object with `total`, `free`, `used` in bytes), and
`nvmlDeviceGetComputeRunningProcesses` (objects with `pid` and `usedGpuMemory` in bytes). Calls before
`nvmlInit` raise NVML_ERROR_UNINITIALIZED, as the library does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


class HoldsGpuMemory(Protocol):
    pid: int

    def gpu_bytes(self) -> dict[int, int]: ...


@dataclass(frozen=True)
class Memory:
    total: int
    free: int
    used: int


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    usedGpuMemory: int  # pynvml's field name


class FakeNvml:
    def __init__(self, totals: Sequence[int], engines: Callable[[], Sequence[HoldsGpuMemory]]) -> None:
        self.totals = list(totals)
        self.engines = engines  # read at each call: the bytes follow the engines' states
        self.initialised = False
        self.NVMLError = NVMLError

    def _ready(self) -> None:
        if not self.initialised:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def nvmlInit(self) -> None:
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self._ready()
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        self._ready()
        return len(self.totals)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._ready()
        if not 0 <= index < len(self.totals):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return index

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[ProcessInfo]:
        self._ready()
        out = []
        for engine in self.engines():
            used = engine.gpu_bytes().get(handle, 0)
            if used:
                out.append(ProcessInfo(engine.pid, used))
        return out

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Memory:
        used = sum(p.usedGpuMemory for p in self.nvmlDeviceGetComputeRunningProcesses(handle))
        return Memory(total=self.totals[handle], free=self.totals[handle] - used, used=used)
