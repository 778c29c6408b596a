"""Engine processes the agent manages: started from a launch spec, waited for until ready, stopped with a
grace period; an exit the agent did not ask for is a crash, reported with its exit code and last output.

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
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
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
            return None
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
        return popen.returncode

    def _collect(self, stream: IO[bytes]) -> None:
        for line in stream:
            self.output.append(line.decode(errors="replace").rstrip())
