"""The JSON Schemas in schemas/ are generated from the code and kept current."""

from pathlib import Path

import pytest

from planner_service.schemas import render, schema_builders

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


@pytest.mark.parametrize("name", sorted(schema_builders()))
def test_schema_file_is_current(name: str) -> None:
    path = SCHEMAS / name
    assert path.exists(), f"{path} is missing: run `make schemas`"
    assert path.read_text() == render(schema_builders()[name]()), f"{name} is stale: run `make schemas`"
