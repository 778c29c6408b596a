"""Byte stores the local executor moves state between: a directory, host memory, a CUDA device.

One entry per state object (`weights__coder__bf16`); an entry grows by appending
chunks and shrinks from its end, so partial residency (some experts, some KV
chunks) is a prefix of the object. Sizes are always measured from the store
itself (file sizes, buffer lengths, tensor sizes), never remembered.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_key(key: str) -> str:
    return _SAFE.sub("_", key)


class ByteStore(Protocol):
    name: str

    def size(self, key: str) -> int: ...

    def total_bytes(self) -> int: ...

    def keys(self) -> list[str]: ...

    def append(self, key: str, chunks: Iterable[bytes]) -> int: ...

    def read(self, key: str, offset: int, length: int, chunk_bytes: int) -> Iterator[bytes]: ...

    def shrink(self, key: str, nbytes: int) -> None: ...


class DirStore:
    """A directory, one file per object (`<key>.bin`): the NVMe tier, or host memory on a tmpfs."""

    def __init__(self, root: Path, name: str = "dir") -> None:
        self.root, self.name = Path(root), name
        self._lock = threading.Lock()

    def _path(self, key: str) -> Path:
        return self.root / f"{safe_key(key)}.bin"

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return 0

    def keys(self) -> list[str]:
        if not self.root.exists():
            return []
        return sorted(p.stem for p in self.root.glob("*.bin"))

    def total_bytes(self) -> int:
        return sum(self.size(k) for k in self.keys())

    def append(self, key: str, chunks: Iterable[bytes]) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        written = 0
        with self._path(key).open("ab") as f:
            for chunk in chunks:
                f.write(chunk)
                written += len(chunk)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on the device before the move counts as done
        return written

    def read(self, key: str, offset: int, length: int, chunk_bytes: int) -> Iterator[bytes]:
        with self._path(key).open("rb") as f:
            f.seek(offset)
            left = length
            while left > 0:
                chunk = f.read(min(chunk_bytes, left))
                if not chunk:
                    return
                left -= len(chunk)
                yield chunk

    def shrink(self, key: str, nbytes: int) -> None:
        with self._lock:
            path = self._path(key)
            keep = self.size(key) - nbytes
            if keep <= 0:
                path.unlink(missing_ok=True)
            else:
                os.truncate(path, keep)


class MemoryStore:
    """Host memory (or a stand-in for a GPU without CUDA): one bytearray per object."""

    def __init__(self, name: str = "memory") -> None:
        self.name = name
        self._data: dict[str, bytearray] = {}
        self._lock = threading.Lock()

    def size(self, key: str) -> int:
        return len(self._data.get(key, b""))

    def keys(self) -> list[str]:
        return sorted(self._data)

    def total_bytes(self) -> int:
        return sum(len(b) for b in list(self._data.values()))

    def append(self, key: str, chunks: Iterable[bytes]) -> int:
        written = 0
        for chunk in chunks:
            with self._lock:
                self._data.setdefault(key, bytearray()).extend(chunk)
            written += len(chunk)
        return written

    def read(self, key: str, offset: int, length: int, chunk_bytes: int) -> Iterator[bytes]:
        data = self._data.get(key, bytearray())
        end = min(len(data), offset + length)
        for start in range(offset, end, chunk_bytes):
            yield bytes(data[start : min(start + chunk_bytes, end)])

    def shrink(self, key: str, nbytes: int) -> None:
        with self._lock:
            data = self._data.get(key)
            if data is None:
                return
            if nbytes >= len(data):
                del self._data[key]
            else:
                self._data[key] = data[: len(data) - nbytes]  # a new, smaller buffer: the memory is returned


class CudaStore:
    """GPU memory on one CUDA device: one list of uint8 tensors (one per chunk) per object.

    torch is imported when the store is built, never at module import.
    """

    def __init__(self, device: int, name: str = "cuda") -> None:
        import torch  # optional dependency: only the local executor on a CUDA machine needs it

        self._torch: Any = torch
        self.device = torch.device("cuda", device)
        self.name = name
        self._data: dict[str, list[Any]] = {}
        self._lock = threading.Lock()

    def size(self, key: str) -> int:
        return sum(int(t.numel()) for t in self._data.get(key, []))

    def keys(self) -> list[str]:
        return sorted(self._data)

    def total_bytes(self) -> int:
        return sum(self.size(k) for k in list(self._data))

    def append(self, key: str, chunks: Iterable[bytes]) -> int:
        torch = self._torch
        written = 0
        for chunk in chunks:
            host = torch.frombuffer(bytearray(chunk), dtype=torch.uint8)
            tensor = host.pin_memory().to(self.device, non_blocking=True)
            with self._lock:
                self._data.setdefault(key, []).append(tensor)
            written += len(chunk)
        torch.cuda.synchronize(self.device)
        return written

    def read(self, key: str, offset: int, length: int, chunk_bytes: int) -> Iterator[bytes]:
        position, end = 0, offset + length
        for tensor in list(self._data.get(key, [])):
            n = int(tensor.numel())
            lo, hi = max(offset, position), min(end, position + n)
            if lo < hi:
                for start in range(lo, hi, chunk_bytes):
                    stop = min(start + chunk_bytes, hi)
                    yield tensor[start - position : stop - position].cpu().numpy().tobytes()
            position += n
            if position >= end:
                return

    def shrink(self, key: str, nbytes: int) -> None:
        with self._lock:
            tensors = self._data.get(key, [])
            while nbytes > 0 and tensors:
                last = tensors[-1]
                n = int(last.numel())
                if n <= nbytes:
                    tensors.pop()
                    nbytes -= n
                else:
                    tensors[-1] = last[: n - nbytes].clone()  # a copy, so the old allocation is freed
                    nbytes = 0
            if not tensors:
                self._data.pop(key, None)
        self._torch.cuda.empty_cache()

    def device_memory(self) -> tuple[int, int]:
        """(free, total) bytes of the device, as the driver reports them."""
        free, total = self._torch.cuda.mem_get_info(self.device)
        return int(free), int(total)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
