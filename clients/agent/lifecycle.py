"""Engine processes the agent manages: started from a launch spec, waited for until ready, stopped with a
grace period; an exit the agent did not ask for is a crash, reported with its exit code and last output.

A managed engine runs in its own session, so it outlives the agent's SIGKILL; its pid is written to a pid
file (`pid_path`), and an agent that starts again finds the process by it (checked in /proc: alive, and
running the spec's command) instead of trusting what it remembered, so that a stop still reaches it.

The spec's command is a template: `{port}`, `{model}`, `{model_path}`, `{kv_pool_bytes_per_gpu}` and
`{max_context_tokens}` are filled in; `CUDA_VISIBLE_DEVICES` is set to the engine's device indices.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from clients.agent.config import LaunchSpec
from clients.agent.errors import PermanentError, TemporaryError

log = logging.getLogger("statebudget.agent.engines")

OUTPUT_LINES = 40  # the engine's last lines of output kept for a crash report


def spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """The engine in its own process group (so that a stop reaches its workers too), output piped."""
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


@dataclass
class EngineProcess:
    """One managed engine process (none while stopped)."""

    name: str
    spec: LaunchSpec
    devices: list[int]
    values: Mapping[str, object]  # what fills the command template
    popen: subprocess.Popen[bytes] | None = None
    stopping: bool = False
    output: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=OUTPUT_LINES))

    @property
    def pid_path(self) -> Path:
        return Path(tempfile.gettempdir()) / f"statebudget-engine-{self.name}-{self.spec.port}.pid"

    def adopted_pid(self) -> int | None:
        """The pid of this engine's process started by an earlier run of the agent, if it still runs it."""
        try:
            pid = int(self.pid_path.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return None
        program = self.spec.command[0].encode()
        return pid if any(part == program or part.endswith(b"/" + program) for part in cmdline) else None

    def command(self, **overrides: object) -> list[str]:
        values = {**self.values, "port": self.spec.port, **overrides}
        try:
            return [part.format(**values) for part in self.spec.command]
        except KeyError as missing:
            raise PermanentError(f"{self.name}: launch.command names {missing} ({sorted(values)} are known)") from None

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def crashed(self) -> str | None:
        """Why the process ended without being asked to, or None."""
        if self.popen is None or self.stopping:
            return None
        code = self.popen.poll()
        if code is None:
            return None
        tail = " | ".join(list(self.output)[-5:])
        return f"{self.name} exited with code {code}" + (f": {tail}" if tail else "")

    async def start(self, http: httpx.AsyncClient, url: str, **overrides: object) -> float:
        """Start the process and wait until its readiness probe answers 200; the seconds it took."""
        if self.running:
            return 0.0
        env = {**os.environ, **self.spec.env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, self.devices))}
        argv = self.command(**overrides)
        started = time.monotonic()
        try:
            self.popen = await asyncio.to_thread(spawn, argv, env)
        except OSError as error:
            raise PermanentError(f"{self.name}: cannot start {argv[0]!r}: {error}") from error
        self.stopping = False
        self.output.clear()
        self.pid_path.write_text(str(self.popen.pid))
        assert self.popen.stdout is not None
        threading.Thread(target=self._collect, args=(self.popen.stdout,), daemon=True).start()
        log.info("started %s (pid %d): %s", self.name, self.popen.pid, " ".join(argv))
        deadline = started + self.spec.ready_timeout_seconds
        probe = url.rstrip("/") + self.spec.ready_path
        while True:
            crash = self.crashed()
            if crash:
                raise PermanentError(f"{crash} while starting")
            with contextlib.suppress(httpx.TransportError):
                if (await http.get(probe, timeout=5.0)).status_code == 200:
                    return time.monotonic() - started
            if time.monotonic() > deadline:
                await self.stop()
                raise TemporaryError(f"{self.name}: not ready at {probe} within {self.spec.ready_timeout_seconds:g} s")
            await asyncio.sleep(0.2)

    async def stop(self) -> int | None:
        """SIGTERM to the engine's process group, SIGKILL after the grace period; its exit code."""
        popen = self.popen
        if popen is None:
            return await self._stop_adopted()
        self.stopping = True
        if popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.to_thread(popen.wait), self.spec.stop_timeout_seconds)
            except TimeoutError:
                log.warning("%s did not stop within %.0f s: killing it", self.name, self.spec.stop_timeout_seconds)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(popen.pid, signal.SIGKILL)
                await asyncio.to_thread(popen.wait)
        self.popen = None
        self.pid_path.unlink(missing_ok=True)
        return popen.returncode

    async def _stop_adopted(self) -> int | None:
        """Stop the process an earlier run of the agent started (found by its pid file); no exit code to read."""
        pid = self.adopted_pid()
        if pid is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.spec.stop_timeout_seconds
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if Path(f"/proc/{pid}").exists():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        self.pid_path.unlink(missing_ok=True)
        log.info("stopped %s (pid %d, started by an earlier run of the agent)", self.name, pid)
        return None

    def _collect(self, stream: IO[bytes]) -> None:
        for line in stream:
            self.output.append(line.decode(errors="replace").rstrip())
