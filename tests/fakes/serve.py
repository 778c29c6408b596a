"""Serve an ASGI app on a free local port in a thread (uvicorn), for tests that need a real HTTP server."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(app: FastAPI, *, port: int | None = None, timeout_seconds: float = 10.0) -> Iterator[str]:
    """`app` served at the yielded base URL until the block ends."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name=f"fake-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_seconds
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"the fake on port {port} did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_seconds)
