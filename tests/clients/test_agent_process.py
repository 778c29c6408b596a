"""`statebudget serve` and `statebudget-agent run` as real processes; SIGTERM ends the agent cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from clients_helpers import FAST_RETRY

from clients.sdk import ConnectionError, ServerError, StateBudgetClient

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (ConnectionError, ServerError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_agent_process_runs_the_plan_and_stops_on_sigterm(tmp_path):
    port = _free_port()
    env = {**os.environ, "STATEBUDGET_LOG_LEVEL": "warning"}
    server = subprocess.Popen(
        [str(BIN / "statebudget"), "serve", "--demo", "--port", str(port), "--db", str(tmp_path / "sb.db")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    agent = None
    try:
        sb = StateBudgetClient(f"http://127.0.0.1:{port}", retry=FAST_RETRY, timeout_seconds=5)
        _wait(lambda: sb.readyz().status == "ok", 30, "the service")
        assert any(o.node == "n3" for o in sb.get_plan().operations)
        agent = subprocess.Popen(
            [
                str(BIN / "statebudget-agent"),
                "run",
                "--server",
                f"http://127.0.0.1:{port}",
                "--node",
                "n3",
                "--executor",
                "local",
                "--scale",
                "1e-6",
                "--nvme-dir",
                str(tmp_path / "nvme"),
                "--lease-wait",
                "0.5",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

        def drained() -> bool:  # whatever the plan in force (the agent's registration replans): done, none open
            return bool(sb.list_operations(node="n3", state="done")) and not sb.list_operations(node="n3")

        _wait(drained, 60, "n3's operations")
        agent.send_signal(signal.SIGTERM)
        output, _ = agent.communicate(timeout=20)
        assert agent.returncode == 0, output
        assert "registered node n3" in output and "agent n3 stopped" in output and "Traceback" not in output
        assert "HTTP Request" not in output  # quiet at INFO: no line per long-poll or heartbeat
        assert any(p.name.endswith(".bin") for p in (tmp_path / "nvme").iterdir())
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
