"""`statebudget serve` as a real process: SIGKILL it and find every acknowledged write after a restart."""

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(db: Path, log: Path) -> tuple[subprocess.Popen, httpx.Client]:
    port = free_port()
    env = {**os.environ, "STATEBUDGET_REPLAN_INTERVAL_SECONDS": "3600"}
    env.pop("STATEBUDGET_OPERATOR_TOKENS", None)
    env.pop("STATEBUDGET_NODE_TOKENS", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "planner_service.cli",
            "serve",
            "--db",
            str(db),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if client.get("/readyz").status_code == 200:
                return proc, client
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"serve did not become ready:\n{log.read_text()}")


def test_sigkill_loses_no_acknowledged_write(tmp_path: Path) -> None:
    db, log = tmp_path / "state.db", tmp_path / "serve.log"
    proc, client = start(db, log)
    try:
        events = [
            {"id": f"e{i}", "type": "request", "session": f"crash-{i}", "model": model, "input_tokens": 1000 * (i + 1)}
            for i, model in enumerate(["coder", "planner", "reasoner", "vision"])
        ]
        events.append({"id": "e-end", "type": "turn_end", "session": "crash-0", "output_tokens": 77})
        assert client.post("/v1/events", json={"events": events}).json()["applied"] == 5
        assert client.post("/v1/plan").status_code == 200
        confirmed = []
        for node in ("n1", "n2"):
            lease = client.post(f"/v1/nodes/{node}/lease", json={"max_operations": 2}).json()
            for op in lease["operations"]:
                out = client.post(
                    f"/v1/operations/{op['id']}/report",
                    json={"lease_id": lease["lease_id"], "status": "done", "measured_seconds": 1.5},
                )
                assert out.status_code == 200
                confirmed.append(op["id"])
        assert confirmed
        srv = client.get("/v1/srv").json()
        sessions = client.get("/v1/sessions").json()
        assert srv["version"] == 1 + len(confirmed)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        client.close()

    proc, client = start(db, log)
    try:
        assert "already holds a state" in log.read_text() or "restored" in log.read_text()
        assert client.get("/v1/srv").json() == srv
        assert client.get("/v1/sessions").json() == sessions
        again = client.post("/v1/events", json={"events": events}).json()
        assert again == {
            "applied": 0,
            "duplicates": 5,
            "results": [{"id": e["id"], "status": "duplicate"} for e in events],
        }
        done = {o["id"] for o in client.get("/v1/operations", params={"state": "done"}).json()}
        assert set(confirmed) <= done
        assert client.get("/v1/sessions/crash-0").json()["context_tokens"] == 1077
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        client.close()
