"""A type checker sees every SDK method return its wire type: `T` on the sync client, a coroutine of `T` on the
async one (mypy, with the project's configuration, on a file that reveals each method's type)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import pytest
from mypy import api as mypy_api

from clients.sdk._core import Endpoint
from clients.sdk.client import Endpoints

ROOT = Path(__file__).resolve().parents[2]
ENDPOINTS = sorted(name for name, value in vars(Endpoints).items() if isinstance(value, Endpoint))
REVEALED = re.compile(r':(\d+): note: Revealed type is "(.*)"$')


def mypy_name(answer: Any) -> str:
    """How mypy writes a builder's answer type: `planner_service.wire.x.Model`, `list[...]`, `str`, `None`."""
    if answer is type(None):
        return "None"
    if answer is str:
        return "str"
    if get_origin(answer) is list:
        return f"list[{mypy_name(get_args(answer)[0])}]"
    return f"{answer.__module__}.{answer.__qualname__}"


@pytest.fixture(scope="module")
def revealed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """'sync name' / 'async name' -> the return type mypy infers for that method."""
    lines = [
        "from clients.sdk import AsyncStateBudgetClient, StateBudgetClient",
        "def check(sync: StateBudgetClient, asynchronous: AsyncStateBudgetClient) -> None:",
    ]
    where: dict[int, str] = {}
    for name in ENDPOINTS:
        for kind, var in (("sync", "sync"), ("async", "asynchronous")):
            lines.append(f"    reveal_type({var}.{name})")
            where[len(lines)] = f"{kind} {name}"
    source = tmp_path_factory.mktemp("sdk_types") / "reveal.py"
    source.write_text("\n".join(lines) + "\n")
    stdout, stderr, _ = mypy_api.run(["--config-file", str(ROOT / "pyproject.toml"), str(source)])
    found = {}
    for line in stdout.splitlines():
        match = REVEALED.search(line)
        if match:
            found[where[int(match.group(1))]] = match.group(2)
    assert len(found) == 2 * len(ENDPOINTS), stdout + stderr
    return found


@pytest.mark.slow  # one mypy run over the SDK and the wire package
@pytest.mark.parametrize("name", ENDPOINTS)
def test_each_method_is_typed_with_its_answer(name: str, revealed: dict[str, str]) -> None:
    (answer,) = get_args(get_type_hints(getattr(Endpoints, name).build)["return"])
    returned = mypy_name(answer)
    sync_end = ")" if returned == "None" else f") -> {returned}"  # mypy leaves out a `-> None`
    assert revealed[f"sync {name}"].endswith(sync_end), revealed[f"sync {name}"]
    assert revealed[f"async {name}"].endswith(f") -> typing.Coroutine[Any, Any, {returned}]"), revealed[f"async {name}"]
    assert "Any" not in returned
