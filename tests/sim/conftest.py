"""Synthetic public traces, generated once per test session (tests/fixtures/make_traces.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.make_traces import Truth, write_traces


@pytest.fixture(scope="session")
def synthetic_traces(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Truth]:
    """The folder holding azure_llm_2023/, mooncake_fast25/ and alibaba_genai_2026/, and their sessions."""
    out = tmp_path_factory.mktemp("traces")
    return out, write_traces(out)
