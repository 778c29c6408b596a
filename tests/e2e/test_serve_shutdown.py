"""`statebudget serve` as a real process: SIGTERM answers the lease long-polls at once, with nothing leased."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

PROC_NET_TCP = Path("/proc/net/tcp")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(db: Path, log: Path) -> tuple[subprocess.Popen[bytes], httpx.Client, int]:
    port = free_port()
    env = {**os.environ, "STATEBUDGET_REPLAN_INTERVAL_SECONDS": "3600", "STATEBUDGET_MAX_WAIT_SECONDS": "60"}
    env.pop("STATEBUDGET_OPERATOR_TOKENS", None)
    env.pop("STATEBUDGET_NODE_TOKENS", None)
    command = [sys.executable, "-m", "planner_service.cli", "serve", "--db", str(db), "--host", "127.0.0.1"]
    proc = subprocess.Popen([*command, "--port", str(port)], stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if client.get("/readyz").status_code == 200:
                return proc, client, port
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"serve did not become ready:\n{log.read_text()}")


def unread_bytes(server_port: int, client_port: int) -> int | None:
    """Bytes the server has not read yet on the connection from `client_port` (None: no such connection)."""
    for line in PROC_NET_TCP.read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, queues = fields[1], fields[2], fields[4]
        if int(local.rsplit(":", 1)[1], 16) == server_port and int(remote.rsplit(":", 1)[1], 16) == client_port:
            return int(queues.split(":")[1], 16)
    return None


def read_answer(conn: socket.socket) -> tuple[int, bytes]:
    """The status and body of the one answer on a `Connection: close` request."""
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.mark.skipif(not PROC_NET_TCP.exists(), reason="needs /proc/net/tcp to see the server read the request")
def test_sigterm_answers_a_waiting_long_poll_at_once_with_an_empty_lease(tmp_path: Path) -> None:
    proc, client, port = start(tmp_path / "state.db", tmp_path / "serve.log")
    try:
        while client.post("/v1/nodes/n1/lease", json={"max_operations": 1000}).json()["operations"]:
            pass  # lease all that n1 may run now, so the long-poll below has nothing to take and waits
        body = json.dumps({"max_operations": 8, "wait_seconds": 45}).encode()
        request = (
            f"POST /v1/nodes/n1/lease HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode() + body
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(request)
            client_port = conn.getsockname()[1]
            deadline = time.monotonic() + 10
            while unread_bytes(port, client_port) != 0:  # the server has read the whole request: it is waiting
                assert time.monotonic() < deadline, "the server never read the long-poll"
                time.sleep(0.01)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            status, answer = read_answer(conn)
            answered_seconds = time.monotonic() - sent
        assert status == 200, (answered_seconds, answer)
        assert json.loads(answer) == {
            "lease_id": None,
            "expires_at": None,
            "expires_in_seconds": None,
            "operations": [],
        }
        assert answered_seconds < 1.0
        assert proc.wait(timeout=10) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
        log = (tmp_path / "serve.log").read_text()
        assert "timeout graceful shutdown exceeded" not in log and "Traceback" not in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        client.close()
