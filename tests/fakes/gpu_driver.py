"""The books of GPU memory that the fake engine processes of one node keep between them, in the directory the
fake NVML reads (tests/fakes/nvml_driver/pynvml.py, `STATEBUDGET_FAKE_NVML_DIR`).

Each process keeps `<pid>.json` there with the bytes it holds per device index (`gpu_bytes`) and whatever
else its engine reports. A file whose pid no longer runs counts for nothing (the driver frees a dead
process's memory). The devices' totals are `STATEBUDGET_FAKE_NVML_TOTALS` (bytes per device index,
comma-separated); without it the devices have no known size and every allocation fits. Allocations are
decided under one lock on the directory, so that two processes never both get the last free bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TOTALS_ENV = "STATEBUDGET_FAKE_NVML_TOTALS"


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def totals() -> list[int] | None:
    """Each device's total bytes, or None where the devices have no known size."""
    raw = os.environ.get(TOTALS_ENV)
    return [int(t) for t in raw.split(",")] if raw else None


def free_bytes(driver_dir: Path, pid: int) -> list[int] | None:
    """Each device's bytes free beside the other living processes' (not `pid`'s own); None without totals."""
    capacity = totals()
    if capacity is None:
        return None
    used = [0] * len(capacity)
    for path in driver_dir.glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(path.read_text())
            if int(record["pid"]) != pid and alive(int(record["pid"])):
                for device, n in record["gpu_bytes"].items():
                    used[int(device)] += int(n)
    return [c - u for c, u in zip(capacity, used, strict=True)]


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Replace a process's record at once: the reader never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


@contextlib.contextmanager
def driver_lock(driver_dir: Path) -> Iterator[None]:
    """The devices' allocator, one at a time across the fake engine processes of a node."""
    with (driver_dir / ".lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
