"""Importers of public traces into the StateBudget trace format, registered by format name.

Each importer streams records in time order (the sources may be large) and documents, in its
module docstring, how it derives what the source lacks: sessions, models, token counts.
"""

from __future__ import annotations

from enum import StrEnum

from planner_service.sim.importers.alibaba import AlibabaImporter
from planner_service.sim.importers.azure import AzureImporter
from planner_service.sim.importers.common import ImportOptions, TraceImporter
from planner_service.sim.importers.mooncake import MooncakeImporter

__all__ = ["ImportOptions", "ImporterRegistry", "TraceFormat", "TraceImporter", "default_registry"]


class TraceFormat(StrEnum):
    AZURE = "azure"  # Azure LLM inference trace 2023, code + conv services
    MOONCAKE = "mooncake"  # Mooncake FAST'25 conversation trace
    ALIBABA = "alibaba"  # Alibaba GenAI 2026 request trace


class ImporterRegistry:
    def __init__(self) -> None:
        self._importers: dict[str, TraceImporter] = {}

    def register(self, name: str, importer: TraceImporter) -> None:
        if name in self._importers:
            raise ValueError(f"trace importer {name!r} is registered already")
        self._importers[name] = importer

    def get(self, name: str) -> TraceImporter:
        try:
            return self._importers[name]
        except KeyError:
            raise ValueError(f"unknown trace format {name!r}; choose one of: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._importers)


def default_registry() -> ImporterRegistry:
    registry = ImporterRegistry()
    registry.register(TraceFormat.AZURE, AzureImporter())
    registry.register(TraceFormat.MOONCAKE, MooncakeImporter())
    registry.register(TraceFormat.ALIBABA, AlibabaImporter())
    return registry
