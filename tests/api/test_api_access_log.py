"""`statebudget serve` as a real process: a token put in a query string never reaches its log."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

OPERATOR = "op-secret-5c1e"
NODE = "n1-secret-9d0b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tokens_in_query_strings_are_redacted_from_the_access_log(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    env = {
        **os.environ,
        "STATEBUDGET_OPERATOR_TOKENS": f'["{OPERATOR}"]',
        "STATEBUDGET_NODE_TOKENS": f'{{"n1": "{NODE}"}}',
        "STATEBUDGET_BACKGROUND_PLANNING": "false",
    }
    command = [
        sys.executable,
        "-m",
        "planner_service.cli",
        "serve",
        "--db",
        str(tmp_path / "x.db"),
        "--port",
        str(port),
    ]
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, log.read_text()
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            assert client.get("/v1/srv", params={"token": OPERATOR}).status_code == 401
            assert client.get("/v1/srv", params={"access_token": NODE, "x": "1"}).status_code == 401
            assert client.get("/v1/srv", params={"api_key": "a-guess"}).status_code == 401
            assert client.get(f"/v1/nodes/{OPERATOR}/lease").status_code == 405
            headers = {"Authorization": f"Bearer {OPERATOR}"}
            assert client.get("/v1/operations", params={"state": "queued"}, headers=headers).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    text = log.read_text()
    assert "GET /v1/srv?token=[redacted]" in text and "GET /v1/srv?access_token=[redacted]&x=1" in text
    assert "api_key=[redacted]" in text and "GET /v1/operations?state=queued" in text
    for secret in (OPERATOR, NODE, "a-guess"):
        assert secret not in text
