"""Engine processes the agent manages: started from a launch spec, waited for until ready, stopped with a
grace period; an exit the agent did not ask for is a crash, reported with its exit code and last output.

A managed engine runs in its own session, so it outlives the agent's SIGKILL. Its launch is recorded in a
pid file (`pid_path`: the pid, the command line, the devices and the values that filled the template), and
an agent that starts again finds the process by it, checked in /proc (alive, and running exactly that
command line), instead of trusting what it remembered: a stop still reaches it, a start that an earlier run
began is waited for instead of started twice, and the instance it runs is known again.

The spec's command is a template: `{port}`, `{model}`, `{model_path}`, `{precision}`, `{tp}`,
`{kv_pool_bytes_per_gpu}`, `{kv_pool_tokens}`, `{gpu_expert_fraction}`, `{max_context_tokens}` and
`{lmcache_instance_id}` are filled in; `CUDA_VISIBLE_DEVICES` is set to the engine's device indices.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from clients.agent.config import LaunchSpec
from clients.agent.errors import PermanentError, TemporaryError

log = logging.getLogger("statebudget.agent.engines")

OUTPUT_LINES = 40  # the engine's last lines of output kept for a crash report
UNSPAWNED = 0  # the pid of a launch recorded before its spawn returned


def spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """The engine in its own process group (so that a stop reaches its workers too), its output written to
    `log_path` (afresh at each start): a file, not a pipe, so that the engine's next log line after the
    agent's death does not end it (SIGPIPE)."""
    with log_path.open("wb") as log:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def tail(path: Path, lines: int) -> list[str]:
    """The last `lines` lines of a file (its last 64 KiB at most); none where there is no file."""
    try:
        with path.open("rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - 65536, 0))
            return [line.decode(errors="replace").rstrip() for line in f.read().splitlines()[-lines:]]
    except OSError:
        return []


@dataclass(frozen=True, slots=True)
class Launched:
    """One start of a managed engine, as its pid file records it."""

    pid: int
    argv: list[str]
    devices: list[int]
    values: dict[str, Any]  # what filled the command template

    def to_json(self) -> str:
        return json.dumps({"pid": self.pid, "argv": self.argv, "devices": self.devices, "values": self.values})


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _runs(pid: int, argv: list[str]) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return alive(pid) and cmdline.rstrip(b"\0").split(b"\0") == [a.encode() for a in argv]


def running_exactly(argv: list[str]) -> int | None:
    """The pid of a process that runs exactly `argv` (the lowest, where several do), or None."""
    for entry in sorted((e for e in Path("/proc").iterdir() if e.name.isdigit()), key=lambda e: int(e.name)):
        if _runs(int(entry.name), argv):
            return int(entry.name)
    return None


@dataclass
class EngineProcess:
    """One managed engine process (none while stopped)."""

    name: str
    spec: LaunchSpec
    devices: list[int]  # the default group's device indices; a start may name others
    values: Mapping[str, object]  # what fills the command template, before a start's own values
    env: Mapping[str, str] = field(default_factory=dict)  # set by the agent, beside the spec's own
    state_dir: Path | None = None  # where the launch record lives; None: the temp directory
    popen: subprocess.Popen[bytes] | None = None
    launched: Launched | None = None  # the running process's launch (this run's or an earlier run's)
    stopping: bool = False

    @property
    def pid_path(self) -> Path:
        return self._directory / f"statebudget-engine-{self.name}-{self.spec.port}.pid"

    @property
    def log_path(self) -> Path:
        """The engine's output since its last start."""
        return self._directory / f"statebudget-engine-{self.name}-{self.spec.port}.log"

    @property
    def _directory(self) -> Path:
        return self.state_dir if self.state_dir is not None else Path(tempfile.gettempdir())

    @property
    def output(self) -> list[str]:
        """The engine's last lines of output."""
        return tail(self.log_path, OUTPUT_LINES)

    def last_launch(self) -> Launched | None:
        """The latest start's record, whether or not its process still runs (a crashed engine's is kept). A
        record without a pid is a start whose agent ended between writing it and the spawn's return: its
        process, if one was spawned, is the one running exactly the recorded command line."""
        try:
            record = json.loads(self.pid_path.read_text())
            launched = Launched(int(record["pid"]), list(record["argv"]), list(record["devices"]), record["values"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if launched.pid == UNSPAWNED and (pid := running_exactly(launched.argv)) is not None:
            return dataclasses.replace(launched, pid=pid)
        return launched

    def recover(self) -> Launched | None:
        """The launch of this engine's process that an earlier run of the agent started, if it still runs
        exactly that command; it becomes this process's own."""
        launched = self.last_launch()
        if launched is None or not _runs(launched.pid, launched.argv):
            return None
        self.launched, self.stopping = launched, False
        return launched

    def command(self, **overrides: object) -> list[str]:
        values = {**self.values, "port": self.spec.port, **overrides}
        try:
            return [part.format(**values) for part in self.spec.command]
        except KeyError as missing:
            raise PermanentError(f"{self.name}: launch.command names {missing} ({sorted(values)} are known)") from None

    @property
    def running(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return self.launched is not None and alive(self.launched.pid)

    def crashed(self) -> str | None:
        """Why the process ended without being asked to, or None."""
        if self.stopping or self.launched is None:
            return None
        if self.popen is None:  # started by an earlier run of the agent: no exit code to read
            if alive(self.launched.pid):
                return None
            return f"{self.name} (pid {self.launched.pid}, started by an earlier run of the agent) exited"
        code = self.popen.poll()
        if code is None:
            return None
        last = " | ".join(self.output[-5:])
        return f"{self.name} exited with code {code}" + (f": {last}" if last else "")

    def forget(self) -> None:
        """The process ended (a crash seen): nothing of it is kept."""
        self.popen, self.launched = None, None
        self.pid_path.unlink(missing_ok=True)

    async def start(
        self, http: httpx.AsyncClient, url: str, *, devices: list[int] | None = None, **overrides: object
    ) -> float:
        """Start the process and wait until its readiness probe answers 200; the seconds it took. A process
        that runs already (one an earlier run of the agent started, perhaps not ready yet) is waited for."""
        started = time.monotonic()
        if not self.running:
            await self._spawn(self.devices if devices is None else devices, overrides)
        await self._ready(http, url, started)
        return time.monotonic() - started

    async def _spawn(self, devices: list[int], overrides: Mapping[str, object]) -> None:
        env = {**os.environ, **self.spec.env, **self.env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))}
        argv = self.command(**overrides)
        values = {k: v for k, v in {**self.values, **overrides}.items() if isinstance(v, str | int | float)}
        # recorded before the spawn: the engine outlives an agent killed before the spawn returns, and the next
        # run finds it by its command line (`last_launch`) instead of starting a second one on its port
        self.pid_path.write_text(Launched(UNSPAWNED, argv, list(devices), values).to_json())
        try:
            self.popen = await asyncio.to_thread(spawn, argv, env, self.log_path)
        except OSError as error:
            self.pid_path.unlink(missing_ok=True)
            raise PermanentError(f"{self.name}: cannot start {argv[0]!r}: {error}") from error
        self.stopping = False
        self.launched = Launched(self.popen.pid, argv, list(devices), values)
        self.pid_path.write_text(self.launched.to_json())
        log.info("started %s (pid %d): %s", self.name, self.popen.pid, " ".join(argv))

    async def _ready(self, http: httpx.AsyncClient, url: str, started: float) -> None:
        deadline = started + self.spec.ready_timeout_seconds
        probe = url.rstrip("/") + self.spec.ready_path
        while True:
            crash = self.crashed()
            if crash:
                raise PermanentError(f"{crash} while starting")
            with contextlib.suppress(httpx.TransportError):
                if (await http.get(probe, timeout=5.0)).status_code == 200:
                    return
            if time.monotonic() > deadline:
                await self.stop()
                raise TemporaryError(f"{self.name}: not ready at {probe} within {self.spec.ready_timeout_seconds:g} s")
            await asyncio.sleep(0.2)

    async def stop(self) -> int | None:
        """SIGTERM to the engine's process group, SIGKILL after the grace period; its exit code (None for a
        process an earlier run of the agent started: only its parent can read that)."""
        popen, launched = self.popen, self.launched
        if popen is None and launched is None:
            launched = self.recover()  # not seen by this run: an earlier run may have left it running
        self.stopping = True
        if popen is not None:
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
        elif launched is not None:
            await self._stop_adopted(launched.pid)
        self.popen, self.launched = None, None
        self.pid_path.unlink(missing_ok=True)
        return None if popen is None else popen.returncode

    async def _stop_adopted(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.spec.stop_timeout_seconds
        while alive(pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        log.info("stopped %s (pid %d, started by an earlier run of the agent)", self.name, pid)
