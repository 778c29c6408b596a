"""Executors behind one Protocol, named by `ExecutorName`: local, vllm, sglang."""

from clients.agent.config import ExecutorName
from clients.agent.executors.base import Executor, GpuUsage, Seedable, Telemetry
from clients.agent.executors.registry import ExecutorRegistry, UnknownExecutor, default_registry

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
