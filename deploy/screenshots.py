"""`make screenshots`: the pictures of the status page and of the offline API docs in docs/images.

Serves the demo (`statebudget serve --demo`) on a fresh database on loopback, plays a few minutes of a
working cluster through the SDK so the page is not empty (node agents register and heartbeat, sessions
hand off between models and call tools, agents lease operations and report them done, one fails, one
lease stays open), replans, and takes headless Chromium screenshots of `/` and `/docs` with every
address but loopback unreachable (as on an air-gapped cluster).

    python deploy/screenshots.py [--out docs/images] [--chromium /usr/bin/chromium]

Needs a Chromium binary (Debian: `apt-get install chromium`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from clients.sdk import StateBudgetClient, events
from planner_service.domain.demo import demo_scenario_json
from planner_service.wire.enums import ReportStatus

ROOT = Path(__file__).resolve().parent.parent
DOCS_WINDOW = "1400,1000"
PAGE_WINDOW = (
    "1400,2500"  # the whole status page of the demo (four nodes, their engines), down to its recent operations
)
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# every fetch that is not to loopback goes to a closed port: the pictures show what an offline cluster sees
OFFLINE_FLAGS = ("--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")


def find_chromium(explicit: str | None = None) -> str | None:
    if explicit:
        return explicit if shutil.which(explicit) else None
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def demo_server(workdir: Path) -> Iterator[str]:
    """`statebudget serve --demo` on a fresh database in `workdir`; yields its base URL once it is ready."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STATEBUDGET_")}
    env["STATEBUDGET_REPLAN_DEBOUNCE_SECONDS"] = "0.05"
    command = [sys.executable, "-m", "planner_service.cli", "serve", "--demo", "--db", str(workdir / "state.db")]
    log = workdir / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"serve exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"serve did not become ready in 60 s:\n{log.read_text()}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for_epoch(sb: StateBudgetClient, after: int, timeout_seconds: float = 20.0) -> int:
    """The plan epoch once the planning loop has planned past `after` (events make it replan)."""
    deadline = time.monotonic() + timeout_seconds
    while (epoch := sb.get_plan().epoch) <= after:
        if time.monotonic() > deadline:
            return int(sb.replan().epoch)
        time.sleep(0.1)
    return int(epoch)


def drive(sb: StateBudgetClient) -> None:
    """A few minutes of a working cluster, as agents, routers and node agents would send it."""
    nodes = [n.id for n in sb.get_cluster().nodes]
    declared = {n["id"]: n.get("engines", []) for n in demo_scenario_json()["cluster"]["nodes"]}
    for node in nodes:
        # each node's agent registers the engines the demo runs there (one vLLM per model), as its config lists them
        engines = [
            {"name": f"vllm-{e['model']}", "kind": e["kind"], "models": [e["model"]], "gpus": e.get("gpus", []),
             "features": e["features"]}
            for e in declared[node]
        ]  # fmt: skip
        sb.register_node(node, engines=engines, agent_version="statebudget-agent 0.1.0")
        sb.heartbeat(node)
    epoch = sb.get_plan().epoch
    sb.post_events(
        events.tool_call_start("shot-1", session="s01", tool="pytest"),
        events.request("shot-2", session="s02", model="coder", input_tokens=1800),
        events.request("shot-3", session="s06", model="vision", input_tokens=900),
        events.request("shot-4", session="s07", model="coder", input_tokens=2400),
        events.turn_end("shot-5", session="s05", output_tokens=350),
        events.session_end("shot-6", session="s10"),
    )
    epoch = wait_for_epoch(sb, epoch)
    failed = False
    for node in nodes:
        lease = sb.lease(node, max_operations=3)
        if lease.lease_id is None:
            continue
        for i, op in enumerate(lease.operations):
            if node == nodes[-1] and i == len(lease.operations) - 1:
                continue  # left leased: the node's agent is still working on it
            if not failed and node == nodes[1] and i == 0:
                sb.report(
                    op.id,
                    lease_id=lease.lease_id,
                    status=ReportStatus.FAILED,
                    error="engine vllm-0: CUDA out of memory while waking the KV pool",
                )
                failed = True
                continue
            sb.report(
                op.id,
                lease_id=lease.lease_id,
                status=ReportStatus.DONE,
                measured_seconds=op.estimated_seconds * 1.1,
                measured_bytes=op.bytes,
            )
    sb.post_events(events.request("shot-7", session="s04", model="summarizer", input_tokens=600))
    wait_for_epoch(sb, epoch)


def screenshot(chromium: str, url: str, out: Path, profile: Path, *, window: str, budget_ms: int) -> None:
    """A `window`-sized ("width,height") PNG of `url` after `budget_ms` of virtual time (scripts run, the page settles)."""
    command = [
        chromium,
        "--headless",
        "--no-sandbox",  # root in a container has no user namespace for the sandbox
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        *OFFLINE_FLAGS,
        f"--virtual-time-budget={budget_ms}",
        f"--window-size={window}",
        f"--screenshot={out}",
        url,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"chromium failed ({done.returncode}) on {url}:\n{done.stderr[-3000:]}")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--chromium", default=None, help="the browser binary (default: the first found on PATH)")
    args = parser.parse_args(argv)
    chromium = find_chromium(args.chromium)
    if chromium is None:
        raise SystemExit("no Chromium binary found (Debian: apt-get install chromium)")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="statebudget-shots-") as tmp:
        workdir = Path(tmp)
        with demo_server(workdir) as url, StateBudgetClient(url) as sb:
            drive(sb)
            # the page holds no script and reloads itself after 5 s: shoot it before that
            profile = workdir / "profile"
            page, docs = args.out / "status-page.png", args.out / "swagger-offline.png"
            screenshot(chromium, f"{url}/", page, profile, window=PAGE_WINDOW, budget_ms=1000)
            screenshot(chromium, f"{url}/docs", docs, profile, window=DOCS_WINDOW, budget_ms=15000)


if __name__ == "__main__":
    main()
