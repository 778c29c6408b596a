"""Read a checkpoint ahead into the page cache and measure how much of it is there (Linux).

`posix_fadvise(fd, 0, 0, POSIX_FADV_WILLNEED)` asks the kernel to start reading every file of the checkpoint
(fadvise(2)); `mincore(2)` over a shared read-only mapping of each file says which pages are resident, so
the agent reports measured page-cache bytes, not the advice it gave. The engine model prices a later cold
start or level-2 reload from the page cache when these bytes cover the checkpoint.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

_PROT_READ = 0x1
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value


@dataclass(frozen=True, slots=True)
class Residency:
    """A checkpoint's files and how much of them sits in the page cache."""

    files: int
    file_bytes: int
    resident_bytes: int  # pages mincore reports resident, times the page size (capped at each file's size)

    @property
    def fraction(self) -> float:
        return self.resident_bytes / self.file_bytes if self.file_bytes else 1.0


def checkpoint_files(path: Path) -> list[Path]:
    """The regular files of a checkpoint (a file, or a directory read recursively), in a stable order."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    return sorted(p for p in path.rglob("*") if p.is_file())


def advise_willneed(path: Path) -> int:
    """Ask the kernel to read every file of the checkpoint ahead; the bytes advised."""
    total = 0
    for file in checkpoint_files(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def resident_bytes(file: Path, libc: ctypes.CDLL | None = None) -> int:
    """Bytes of `file` in the page cache now: mincore(2) over a read-only shared mapping of it."""
    size = file.stat().st_size
    if size == 0:
        return 0
    libc = libc or _libc()
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    fd = os.open(file, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if address in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {file} failed")
        try:
            vector = (ctypes.c_ubyte * pages)()
            if libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {file} failed")
            resident_pages = sum(v & 1 for v in vector)  # bit 0: the page is resident
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
    return min(resident_pages * page, size)


def residency(path: Path) -> Residency:
    files = checkpoint_files(path)
    libc = _libc()
    sizes = [f.stat().st_size for f in files]
    return Residency(len(files), sum(sizes), sum(resident_bytes(f, libc) for f in files))


def evict(path: Path) -> None:
    """Drop the checkpoint's clean pages from the page cache (POSIX_FADV_DONTNEED): for measurements."""
    for file in checkpoint_files(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
