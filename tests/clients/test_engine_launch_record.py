"""The launch record of a managed engine (clients/agent/lifecycle.py) is written before the engine is spawned:
an agent killed between the spawn and its record would otherwise leave an engine no later run knows of, and
the next start of that engine fails on its port (seen in the demo cluster's SIGKILL test: every later start
"address already in use"). The next run finds the process by the recorded command line, stops it and starts
afresh; a record whose process never started names nothing."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

from clients.agent.config import LaunchSpec
from clients.agent.lifecycle import UNSPAWNED, EngineProcess, Launched, alive


def engine(state_dir: Path) -> EngineProcess:
    # a stand-in engine: it runs until stopped; the port only names it (the record's file and command line)
    spec = LaunchSpec(command=[sys.executable, "-c", "import time; time.sleep(120)", "{port}"], port=18123)
    return EngineProcess("vllm-m", spec, [0], {}, state_dir=state_dir)


def test_a_start_recorded_before_its_spawn_is_found_by_its_command_line_and_stopped(tmp_path: Path) -> None:
    earlier = engine(tmp_path)
    argv = earlier.command()
    earlier.pid_path.write_text(Launched(UNSPAWNED, argv, [0], {}).to_json())
    # the earlier run spawned it and was killed before it could record the pid
    orphan = subprocess.Popen(argv, start_new_session=True)
    try:
        _wait_until_it_runs(orphan.pid, argv)  # a later run looks long after the spawn, not between fork and exec
        later = engine(tmp_path)
        found = later.last_launch()
        assert found is not None and found.pid == orphan.pid
        assert later.recover() == found and later.running
        asyncio.run(later.stop())
        assert orphan.wait(timeout=10) is not None and not alive(orphan.pid)
        assert not later.pid_path.exists()
    finally:
        if orphan.poll() is None:
            orphan.kill()


def _wait_until_it_runs(pid: int, argv: list[str]) -> None:
    cmdline = "\0".join(argv).encode() + b"\0"
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/cmdline").read_bytes() != cmdline:
        assert time.monotonic() < deadline, "the stand-in engine never started"
        time.sleep(0.01)


def test_a_start_recorded_whose_spawn_never_ran_names_no_process(tmp_path: Path) -> None:
    earlier = engine(tmp_path)
    earlier.pid_path.write_text(Launched(UNSPAWNED, earlier.command(), [0], {}).to_json())
    later = engine(tmp_path)
    assert later.recover() is None and not later.running
    launched = later.last_launch()
    assert launched is not None and launched.pid == UNSPAWNED
