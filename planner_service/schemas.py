"""JSON Schemas of the files and wire formats, generated from the pydantic models.

`schemas/` in the repository holds their output; a test keeps it current.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planner_service.domain.scenario import Scenario
from planner_service.sim.trace import trace_json_schema


def _openapi() -> dict[str, Any]:
    from planner_service.api.app import create_app  # the web layer loads only for this file
    from planner_service.settings import Settings

    return create_app(Settings()).openapi()


def schema_builders() -> dict[str, Callable[[], dict[str, Any]]]:
    """File name -> function building that schema."""
    return {
        "scenario.schema.json": lambda: Scenario.model_json_schema(),
        "trace.schema.json": trace_json_schema,
        "openapi.json": _openapi,
    }


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def write_schemas(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, build in schema_builders().items():
        path = out_dir / name
        path.write_text(render(build()))
        written.append(path)
    return written
