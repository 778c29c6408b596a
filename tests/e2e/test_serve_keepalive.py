"""`statebudget serve` keeps an idle connection open longer than its clients keep theirs.

A client that reuses a pooled connection just as the server closes it for
idleness gets a ReadError (the server resets a socket with an unread
request). With uvicorn's default keep-alive (5 s) equal to httpx's pool
expiry (5 s), the client's deadline always fell just after the server's
close, and the load benchmark lost events, leases and reports to it. The
server now keeps idle connections `keep_alive_seconds` (30 s), and the SDK
drops its own after `KEEPALIVE_EXPIRY_SECONDS`.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from clients.sdk import KEEPALIVE_EXPIRY_SECONDS, StateBudgetClient
from planner_service.settings import Settings
from tests.e2e.test_serve_shutdown import start

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def test_the_sdk_drops_idle_connections_before_the_server_does() -> None:
    assert KEEPALIVE_EXPIRY_SECONDS < Settings().keep_alive_seconds
    with StateBudgetClient() as sb:  # the pool the SDK makes for itself
        pool = sb._http._transport._pool  # type: ignore[attr-defined]  # httpcore's pool: where the expiry lives
        assert pool._keepalive_expiry == KEEPALIVE_EXPIRY_SECONDS


def answer(conn: socket.socket, buffer: bytearray) -> int:
    """Read one answer with a Content-Length from a kept-alive connection; its status (0: the server closed)."""
    while b"\r\n\r\n" not in buffer:
        chunk = conn.recv(65536)
        if not chunk:
            return 0
        buffer += chunk
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(rest) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return 0
        rest += chunk
    buffer[:] = rest[length:]
    return int(head.split()[1])


def test_a_connection_idle_past_the_sdks_expiry_still_answers(tmp_path: Path) -> None:
    proc, client, port = start(tmp_path / "state.db", tmp_path / "serve.log")
    request = f"GET /livez HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=20) as conn:
            buffer = bytearray()
            conn.sendall(request)
            assert answer(conn, buffer) == 200
            time.sleep(KEEPALIVE_EXPIRY_SECONDS + 1.5)  # longer than any SDK client keeps it idle
            try:
                conn.sendall(request)
                status = answer(conn, buffer)
            except ConnectionResetError:
                status = 0
            assert status == 200, "the server closed a connection a client may still reuse"
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=15)
