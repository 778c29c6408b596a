"""Executors behind one Protocol, named by `ExecutorName`: local, vllm, sglang, lmcache."""

from clients.agent.executors.base import (
    Executor,
    ExecutorRegistry,
    GpuUsage,
    Seedable,
    Telemetry,
    UnknownExecutor,
    default_registry,
)
from clients.agent.executors.names import ExecutorName

__all__ = [
    "Executor",
    "ExecutorName",
    "ExecutorRegistry",
    "GpuUsage",
    "Seedable",
    "Telemetry",
    "UnknownExecutor",
    "default_registry",
]
