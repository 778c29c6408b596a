"""The status page and the API docs in a real browser: headless Chromium against `statebudget serve --demo`
on loopback, with every other address unreachable (an air-gapped cluster), reads the DOM after scripts ran.

Needs Debian's `chromium` package (`apt-get install chromium`); skipped, saying so, without it.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

CHROMIUM = next(
    (p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))),
    None,
)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (Debian: apt-get install chromium)"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STATEBUDGET_")}  # a fresh demo, no tokens
    command = [sys.executable, "-m", "planner_service.cli", "serve", "--demo", "--db", str(tmp / "state.db")]
    log = tmp / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{log.read_text()}"
            try:
                if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"serve did not become ready:\n{log.read_text()}"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def dump_dom(url: str, profile: Path, *, budget_ms: int) -> str:
    """The DOM Chromium holds after `budget_ms` of virtual time, with the network off but for loopback."""
    assert CHROMIUM is not None
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",  # root in a container has no user namespace for the sandbox
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        # every fetch that is not to loopback goes to a closed port, and no name resolves
        "--proxy-server=127.0.0.1:9",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        f"--virtual-time-budget={budget_ms}",
        "--dump-dom",
        url,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_status_page_shows_the_demos_nodes_gpus_and_models(server: str, tmp_path: Path) -> None:
    dom = dump_dom(f"{server}/", tmp_path / "profile", budget_ms=1000)  # under the page's 5 s refresh
    cluster = httpx.get(f"{server}/v1/cluster").json()
    models = [m["id"] for m in httpx.get(f"{server}/v1/models").json()]
    assert len(cluster["nodes"]) == 4 and len(models) == 7
    for node in cluster["nodes"]:
        assert f'id="node-{node["id"]}"' in dom
        for gpu in node["gpus"]:
            assert f'id="gpu-{gpu["id"]}"' in dom
    legend = dom[dom.index('<ul class="legend"') :]
    legend = legend[: legend.index("</ul>")]
    for model in models:
        assert re.search(rf"</svg>{re.escape(model)}[ <]", legend), model
    assert "P95 switch latency" in dom and "Recent operations" in dom


def test_swagger_ui_renders_offline(server: str, tmp_path: Path) -> None:
    dom = dump_dom(f"{server}/docs", tmp_path / "profile", budget_ms=15000)
    assert 'class="swagger-ui"' in dom  # made by the bundle's script, not in the served HTML
    assert 'data-path="/v1/cluster"' in dom and 'data-path="/v1/plan"' in dom  # it loaded /openapi.json
    assert "Failed to load API definition" not in dom


def test_redoc_renders_offline(server: str, tmp_path: Path) -> None:
    dom = dump_dom(f"{server}/redoc", tmp_path / "profile", budget_ms=15000)
    assert "api-content" in dom and "operation/get_cluster" in dom
