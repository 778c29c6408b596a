"""`statebudget serve` as a child process on a loopback port: start it, wait until ready, stop or kill it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

LOOPBACK = "127.0.0.1"
READY_TIMEOUT_SECONDS = 90.0  # a 50-node seed plans its first epoch before it is ready
STOP_TIMEOUT_SECONDS = 20.0
POLL_SECONDS = 0.05
# settings a test environment may have set that would change what the trials measure
CLEARED_ENV = ("STATEBUDGET_OPERATOR_TOKENS", "STATEBUDGET_NODE_TOKENS", "STATEBUDGET_DB_PATH", "STATEBUDGET_DEMO")


class StartupFailed(RuntimeError):
    """The service exited, or did not become ready in time; the message ends with its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class ServeOptions:
    """How to run one service: its database, its log, its seed (`--demo` or `--scenario FILE`) and settings."""

    db: Path
    log: Path
    seed: list[str] = field(default_factory=lambda: ["--demo"])
    env: dict[str, str] = field(default_factory=dict)  # STATEBUDGET_* settings
    token: str | None = None  # the operator token the harness sends, where the settings ask for one


class Server:
    """One `statebudget serve` process at a time on its database; each start takes a fresh loopback port."""

    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.starts = 0

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.options.token}"} if self.options.token else {}

    def client(self, timeout_seconds: float = 30.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout_seconds, headers=self.headers())

    def start(self) -> float:
        """Start the service and wait until `/readyz` answers 200; the seconds that took."""
        assert self.proc is None or self.proc.poll() is not None, "the service is already running"
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
        env.update(self.options.env)
        command = [sys.executable, "-m", "planner_service.cli", "serve", "--db", str(self.options.db)]
        command += ["--host", LOOPBACK, "--port", str(self.port), *self.options.seed]
        self.options.log.parent.mkdir(parents=True, exist_ok=True)
        began = time.monotonic()
        with self.options.log.open("ab") as log:
            log.write(f"\n=== start {self.starts + 1}: port {self.port}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.starts += 1
        with httpx.Client(base_url=self.base_url, timeout=5.0) as probe:
            while time.monotonic() - began < READY_TIMEOUT_SECONDS:
                if self.proc.poll() is not None:
                    raise StartupFailed(f"serve exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if probe.get("/readyz").status_code == 200:
                        return time.monotonic() - began
                except httpx.TransportError:
                    pass
                time.sleep(POLL_SECONDS)
        self.kill()
        raise StartupFailed(f"serve was not ready within {READY_TIMEOUT_SECONDS:.0f} s:\n{self.log_tail()}")

    def terminate(self) -> tuple[int | None, float]:
        """SIGTERM and wait: the exit code (None: it had to be killed) and the seconds it took."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return (proc.returncode if proc else None), 0.0
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self.kill()
            return None, time.monotonic() - began
        return proc.returncode, time.monotonic() - began

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, whatever was not committed is lost."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=STOP_TIMEOUT_SECONDS)

    def log_text(self) -> str:
        return self.options.log.read_text(errors="replace") if self.options.log.exists() else ""

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_text()[-chars:]
