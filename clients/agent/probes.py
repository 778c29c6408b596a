"""Read a GPU's memory use from the device, so an engine's promise to free memory is checked, not trusted."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from typing import Protocol

MIB = 1024 * 1024


class GpuProbe(Protocol):
    def used_bytes(self, gpu_id: str) -> int | None:
        """Bytes in use on the GPU now, or None when this probe cannot tell."""
        ...


class NullProbe:
    def used_bytes(self, gpu_id: str) -> int | None:
        return None


class NvidiaSmiProbe:
    """`nvidia-smi --query-gpu=memory.used` for the device index of a cluster GPU id."""

    def __init__(self, devices: dict[str, int], run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run):
        self.devices, self._run = dict(devices), run

    def used_bytes(self, gpu_id: str) -> int | None:
        index = self.devices.get(gpu_id)
        if index is None:
            return None
        out = self._run(
            ["nvidia-smi", f"--id={index}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if out.returncode != 0 or not out.stdout.strip():
            return None
        return int(float(out.stdout.strip().splitlines()[0])) * MIB


def default_probe(devices: dict[str, int]) -> GpuProbe:
    return NvidiaSmiProbe(devices) if devices and shutil.which("nvidia-smi") else NullProbe()
