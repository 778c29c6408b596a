from __future__ import annotations

from enum import StrEnum


class ExecutorName(StrEnum):
    LOCAL = "local"
    VLLM = "vllm"
    SGLANG = "sglang"
    LMCACHE = "lmcache"
