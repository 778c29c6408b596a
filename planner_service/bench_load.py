"""The load benchmark behind `statebudget bench load` (figures, not a test).

It starts `statebudget serve --demo` (or `--scenario`) as a real subprocess on a free loopback port with a
fresh database, with an operator token for the router and one token per node for the agents, and for a
bounded time:

- runs `agents` node agents (asyncio tasks, spread over the cluster's nodes) that drain their node's queue
  with a lease that does not wait, report each operation done after `op_seconds`, and long-poll (as
  `clients/agent` does) when the queue is empty;
- sends session events (requests, tool calls, turn ends, session ends of `sessions` concurrent sessions that
  hand off between the catalog's models) at `events_per_s`, `batch` events per request, open loop over
  `connections` lanes: each lane owns some sessions and sends their events in order, one request at a time;
  a request is handed to its lane at its time whatever the answers before it, and a lane still busy falls
  behind (`max_lag_ms` shows how far);
- forces a replan (`POST /v1/plan`) every `replan_every_seconds`, on top of the replans the planning loop
  makes by itself (requests for models served nowhere, its interval).

It prints p50/p95/p99 of event, lease (the drain poll) and report latency, every answer that was not a
2xx, events per second achieved, the forced replans' wall time, and the server's own replan counters and
durations scraped from `/metrics` at the end, with the CPU time the server process used (`server_cpu_cores`:
1.0 is one core busy the whole time) and its planning worker process beside it (`worker_cpu_cores`). Client and server share the machine: `machine()` says which.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from clients.sdk import KEEPALIVE_EXPIRY_SECONDS
from clients.sdk import events as sdk_events

READY_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 10.0
LOOP_PROBE_SECONDS = 0.01  # the client's event-loop probe: a timer this often
LEASE_BATCH = 8  # operations an agent leases at a time (the agent's default)
TOOL_CALL_SHARE = 0.5  # of a session's steps after a request: a tool call, else the turn ends
HANDOFF_SHARE = 0.3  # of a session's requests: to another model than its last
SESSION_END_SHARE = 0.02  # of turn ends: the session ends, and a new one takes its place
SLOS = ("blocking", "interactive", "background")


@dataclass(frozen=True)
class LoadConfig:
    """One phase of load against a fresh server."""

    agents: int = 50
    events_per_s: float = 1000.0
    batch: int = 20  # events per request
    duration_seconds: float = 30.0
    sessions: int = 200  # concurrent sessions the events belong to
    replan_every_seconds: float = 5.0  # forced replans; 0 for none
    op_seconds: float = 0.05  # how long an agent takes to run one operation
    lease_wait_seconds: float = 5.0  # an agent's long-poll when its queue is empty
    connections: int = 64  # the router's connections: event requests in flight at most
    warmup_seconds: float = 2.0  # latencies of requests sent before this are reported apart (`warmup`)
    seed: int = 0
    scenario: Path | None = None  # default: the demo
    server_log_level: str = "warning"  # "info" adds uvicorn's access log line per request


@dataclass
class Samples:
    """What the client saw: latencies in seconds by kind, answers that were not a 2xx."""

    latency: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in ("events", "lease", "report")})
    # the same, of requests sent in the warm-up: every agent and lane opens its connection then, all at once
    warmup: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in ("events", "lease", "report")})
    measure_from: float = 0.0  # perf_counter() at the warm-up's end

    def record(self, kind: str, began: float, elapsed: float) -> None:
        (self.latency if began >= self.measure_from else self.warmup)[kind].append(elapsed)

    forced_replans: list[float] = field(default_factory=list)
    long_poll_late: list[float] = field(default_factory=list)  # seconds an empty long-poll answered past its wait
    loop_lag: list[float] = field(default_factory=list)  # how late the client's own event loop ran a due timer
    errors: Counter[str] = field(default_factory=Counter)
    events_sent: int = 0
    events_acknowledged: int = 0
    operations_done: int = 0
    max_lag: float = 0.0


class EventStream:
    """Session events as a router sends them: each session requests a model, maybe runs a tool call, ends
    its turn, and now and then hands off to another model or ends (a new session takes its slot)."""

    def __init__(self, rng: np.random.Generator, models: list[str], slots: range, run: str) -> None:
        self._rng = rng
        self._models = models
        self._run = run
        self._count = 0
        self._slots = list(slots)  # session slots of this stream (a slot's session is replaced when it ends)
        self._generation = [0] * len(self._slots)
        self._phase = ["idle"] * len(self._slots)  # idle -> busy (a request) -> tool -> busy -> idle (turn end)
        self._model = [models[int(rng.integers(len(models)))] for _ in self._slots]
        self._slo = [SLOS[int(rng.integers(len(SLOS)))] for _ in self._slots]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        slot = int(self._rng.integers(len(self._phase)))
        self._count += 1
        event_id = f"{self._run}-{self._count}"
        session = f"load-{self._slots[slot]}-{self._generation[slot]}"
        phase = self._phase[slot]
        if phase == "idle":
            if self._rng.random() < HANDOFF_SHARE:
                self._model[slot] = self._models[int(self._rng.integers(len(self._models)))]
            self._phase[slot] = "busy"
            return sdk_events.request(
                event_id,
                session=session,
                model=self._model[slot],
                user=f"user-{self._slots[slot] % 20}",
                slo=self._slo[slot],  # type: ignore[arg-type]  # the wire's Slo is a StrEnum: its values are these
                input_tokens=int(self._rng.integers(100, 2000)),
            )
        if phase == "tool":
            self._phase[slot] = "busy"
            return sdk_events.tool_call_end(event_id, session=session)
        if self._rng.random() < TOOL_CALL_SHARE:
            self._phase[slot] = "tool"
            return sdk_events.tool_call_start(event_id, session=session)
        self._phase[slot] = "idle"
        if self._rng.random() < SESSION_END_SHARE:
            self._generation[slot] += 1
            return sdk_events.session_end(event_id, session=session)
        return sdk_events.turn_end(event_id, session=session, output_tokens=int(self._rng.integers(50, 500)))


def free_port() -> int:
    """A loopback port free right now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A `statebudget serve` subprocess with its own database and tokens."""

    base_url: str
    operator_token: str
    node_tokens: dict[str, str]
    process: subprocess.Popen[bytes]
    log_path: Path

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the server process has used (Linux /proc; 0 elsewhere)."""
        return _cpu_seconds(self.process.pid)

    def children_cpu_seconds(self) -> float:
        """The same for the processes it started and still runs (its planning worker)."""
        return sum(_cpu_seconds(pid) for pid in _children(self.process.pid))


def _children(parent: int) -> list[int]:
    """The processes whose parent is `parent` (Linux /proc; none elsewhere)."""
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == parent:
            found.append(int(entry.name))
    return found


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@contextlib.contextmanager
def serve(config: LoadConfig, workdir: Path, node_ids: list[str]) -> Iterator[Server]:
    """Start the server, wait until it is ready, stop it (SIGTERM, then SIGKILL) on the way out."""
    port = free_port()
    operator_token = secrets.token_hex(16)
    node_tokens = {node: secrets.token_hex(16) for node in node_ids}
    env = {
        **os.environ,
        "STATEBUDGET_OPERATOR_TOKENS": f'["{operator_token}"]',
        "STATEBUDGET_NODE_TOKENS": "{" + ", ".join(f'"{n}": "{t}"' for n, t in node_tokens.items()) + "}",
        "STATEBUDGET_LOG_LEVEL": config.server_log_level,
    }
    seed = ["--scenario", str(config.scenario)] if config.scenario is not None else ["--demo"]
    command = [sys.executable, "-c", "from planner_service.cli import app; app()", "serve", *seed]
    command += ["--host", "127.0.0.1", "--port", str(port), "--db", str(workdir / "statebudget.db")]
    log_path = workdir / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", operator_token, node_tokens, process, log_path)
    try:
        _wait_ready(server)
        yield server
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_ready(server: Server) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the server exited with status {server.process.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.base_url}/readyz", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"the server was not ready within {READY_TIMEOUT_SECONDS:.0f} s")


def node_ids_of(config: LoadConfig) -> list[str]:
    """The seed scenario's nodes (their tokens are set before the server starts)."""
    from planner_service.domain.demo import demo_scenario
    from planner_service.domain.scenario import load_scenario

    scenario = load_scenario(config.scenario) if config.scenario is not None else demo_scenario()
    return [node.id for node in scenario.cluster.nodes]


def run_phase(config: LoadConfig) -> dict[str, Any]:
    """One phase against a fresh server and database: the figures as one JSON-able dict."""
    nodes = node_ids_of(config)
    with tempfile.TemporaryDirectory(prefix="statebudget-load-") as tmp, serve(config, Path(tmp), nodes) as server:
        cpu_before, client_before = server.cpu_seconds(), time.process_time()
        worker_before = server.children_cpu_seconds()
        samples, wall = asyncio.run(_drive(config, server))
        cpu = server.cpu_seconds() - cpu_before
        worker_cpu = server.children_cpu_seconds() - worker_before
        client_cpu = time.process_time() - client_before
        scraped = httpx.get(
            f"{server.base_url}/metrics", headers=_auth(server.operator_token), timeout=30.0
        ).raise_for_status()
        counters = server_figures(scraped.text)
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "wall_seconds": round(wall, 2),
        "events": {
            "offered_per_s": config.events_per_s,
            "achieved_per_s": round(samples.events_acknowledged / wall, 1),
            "sent": samples.events_sent,
            "acknowledged": samples.events_acknowledged,
            "requests": len(samples.latency["events"]) + len(samples.warmup["events"]),
            "max_lag_ms": round(samples.max_lag * 1000, 1),
            **percentiles_ms(samples.latency["events"]),
        },
        "lease": {"polls": len(samples.latency["lease"]), **percentiles_ms(samples.latency["lease"])},
        "report": {"reports": len(samples.latency["report"]), **percentiles_ms(samples.latency["report"])},
        "long_poll_late": {"polls": len(samples.long_poll_late), **percentiles_ms(samples.long_poll_late)},
        "warmup": {
            "seconds": config.warmup_seconds,
            **{kind: {"requests": len(v), **percentiles_ms(v)} for kind, v in samples.warmup.items()},
        },
        "client_loop_lag": {"samples": len(samples.loop_lag), **percentiles_ms(samples.loop_lag)},
        "operations_done": samples.operations_done,
        "forced_replans": {"count": len(samples.forced_replans), **percentiles_ms(samples.forced_replans)},
        "errors": dict(sorted(samples.errors.items())),
        "errors_total": sum(samples.errors.values()),
        "server": counters,
        "server_cpu_cores": round(cpu / wall, 2),
        "worker_cpu_cores": round(worker_cpu / wall, 2),
        "client_cpu_cores": round(client_cpu / wall, 2),
    }


def percentiles_ms(seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {"p50_ms": None, "p95_ms": None, "p99_ms": None, "max_ms": None}
    p50, p95, p99 = np.percentile(seconds, [50, 95, 99])
    return {
        "p50_ms": round(float(p50) * 1000, 1),
        "p95_ms": round(float(p95) * 1000, 1),
        "p99_ms": round(float(p99) * 1000, 1),
        "max_ms": round(max(seconds) * 1000, 1),
    }


def server_figures(exposition: str) -> dict[str, Any]:
    """Replans by outcome, the plan epoch, and the count and mean of the planning and replan histograms."""
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(exposition)
        for s in family.samples
    }

    def histogram(name: str) -> dict[str, Any]:
        count = sum(v for (n, _), v in samples.items() if n == f"{name}_count")
        total = sum(v for (n, _), v in samples.items() if n == f"{name}_sum")
        by_outcome = {
            dict(labels).get("outcome", ""): int(v)
            for (n, labels), v in samples.items()
            if n == f"{name}_count" and "outcome" in dict(labels)
        }
        figures: dict[str, Any] = {"count": int(count), "mean_ms": round(total / count * 1000, 1) if count else None}
        if by_outcome:
            figures["by_outcome"] = by_outcome
        return figures

    return {
        "replans": {
            dict(labels)["outcome"]: int(v) for (n, labels), v in samples.items() if n == "statebudget_replans_total"
        },
        "plan_epoch": int(samples.get(("statebudget_plan_epoch", ()), 0)),
        "plan_duration": histogram("statebudget_plan_duration_seconds"),
        "replan_duration": histogram("statebudget_replan_duration_seconds"),
    }


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@contextlib.asynccontextmanager
async def _client(server: Server, token: str, connections: int) -> AsyncIterator[httpx.AsyncClient]:
    # idle connections are dropped before the server closes them (`keep_alive_seconds`), as the SDK's are
    limits = httpx.Limits(
        max_connections=connections, max_keepalive_connections=connections, keepalive_expiry=KEEPALIVE_EXPIRY_SECONDS
    )
    async with httpx.AsyncClient(
        base_url=server.base_url, headers=_auth(token), limits=limits, timeout=httpx.Timeout(60.0)
    ) as client:
        yield client


async def _drive(config: LoadConfig, server: Server) -> tuple[Samples, float]:
    samples = Samples()
    rng = np.random.default_rng(config.seed)
    loop = asyncio.get_running_loop()
    async with _client(server, server.operator_token, config.connections + 2) as router:
        models = [m["id"] for m in (await router.get("/v1/models")).raise_for_status().json()]
        run = secrets.token_hex(4)
        lanes = min(config.connections, config.sessions)
        streams = [
            EventStream(rng, models, range(lane, config.sessions, lanes), run=f"{run}-{lane}") for lane in range(lanes)
        ]
        node_ids = list(server.node_tokens)
        started = loop.time()
        stop_at = started + config.duration_seconds
        samples.measure_from = time.perf_counter() + config.warmup_seconds
        async with contextlib.AsyncExitStack() as stack:
            nodes = {
                node: await stack.enter_async_context(
                    _client(server, server.node_tokens[node], config.agents // len(node_ids) + 2)
                )
                for node in node_ids
            }
            tasks = [
                _agent(nodes[node_ids[i % len(node_ids)]], node_ids[i % len(node_ids)], config, stop_at, samples)
                for i in range(config.agents)
            ]
            tasks.append(_send_events(router, streams, config, stop_at, samples))
            if config.replan_every_seconds > 0:
                tasks.append(_force_replans(router, config, stop_at, samples))
            tasks.append(_watch_loop(stop_at, samples))
            await asyncio.gather(*tasks)
        return samples, loop.time() - started


async def _timed(
    samples: Samples,
    kind: str,
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any] | None = None,
    *,
    measured: bool = False,
) -> tuple[httpx.Response | None, float]:
    """POST `body` to `path`; an answer that is not a 2xx (or no answer) is counted as an error of `kind`, a
    2xx's latency is recorded as one of `kind` when `measured`."""
    began = time.perf_counter()
    try:
        response = await client.post(path, json=body)
    except httpx.HTTPError as error:
        samples.errors[f"{kind}: {type(error).__name__}"] += 1
        return None, time.perf_counter() - began
    elapsed = time.perf_counter() - began
    if not response.is_success:
        samples.errors[f"{kind}: {response.status_code}"] += 1
        return None, elapsed
    if measured:
        samples.record(kind, began, elapsed)
    return response, elapsed


async def _agent(client: httpx.AsyncClient, node: str, config: LoadConfig, stop_at: float, samples: Samples) -> None:
    loop = asyncio.get_running_loop()
    lease_path = f"/v1/nodes/{node}/lease"
    while loop.time() < stop_at:
        response, elapsed = await _timed(
            samples, "lease", client, lease_path, {"max_operations": LEASE_BATCH}, measured=True
        )
        if response is None:
            await asyncio.sleep(0.1)
            continue
        lease = response.json()
        if not lease["operations"]:  # nothing ready: wait for the queue to change, as the agent does
            wait = min(config.lease_wait_seconds, stop_at - loop.time())
            if wait <= 0:
                return
            body = {"max_operations": LEASE_BATCH, "wait_seconds": wait}
            response, elapsed = await _timed(samples, "lease", client, lease_path, body)
            if response is None:
                await asyncio.sleep(0.1)
                continue
            lease = response.json()
            if not lease["operations"]:
                samples.long_poll_late.append(max(0.0, elapsed - wait))
                continue
        await asyncio.sleep(config.op_seconds * len(lease["operations"]))
        for op in lease["operations"]:
            report = {"lease_id": lease["lease_id"], "status": "done"}
            response, elapsed = await _timed(
                samples, "report", client, f"/v1/operations/{op['id']}/report", report, measured=True
            )
            if response is not None:
                samples.operations_done += 1


async def _send_events(
    client: httpx.AsyncClient, streams: list[EventStream], config: LoadConfig, stop_at: float, samples: Samples
) -> None:
    """Open loop over `connections` lanes, as a router sends: each lane owns its sessions and sends their
    events in order, one request at a time (a session's events never overtake each other); the schedule
    hands the requests to the lanes in turn, and a lane still busy with its last one falls behind."""
    loop = asyncio.get_running_loop()
    interval = config.batch / config.events_per_s
    lanes: list[asyncio.Queue[float | None]] = [asyncio.Queue() for _ in streams]

    async def lane(stream: EventStream, due_times: asyncio.Queue[float | None]) -> None:
        while (due := await due_times.get()) is not None:
            if loop.time() >= stop_at:  # what a lane fell behind by at the end is not sent (nor counted)
                continue
            samples.max_lag = max(samples.max_lag, loop.time() - due)
            events = [next(stream) for _ in range(config.batch)]
            samples.events_sent += len(events)
            response, _ = await _timed(samples, "events", client, "/v1/events", {"events": events}, measured=True)
            if response is not None:
                samples.events_acknowledged += len(events)

    workers = [asyncio.create_task(lane(stream, due_times)) for stream, due_times in zip(streams, lanes, strict=True)]
    due, turn = loop.time(), 0
    while due < stop_at:
        if (ahead := due - loop.time()) > 0:
            await asyncio.sleep(ahead)
        lanes[turn % len(lanes)].put_nowait(due)
        turn += 1
        due += interval
    for due_times in lanes:
        due_times.put_nowait(None)
    await asyncio.gather(*workers)


async def _watch_loop(stop_at: float, samples: Samples) -> None:
    """How late the client's event loop wakes a timer: every latency it measures includes such a delay, so a
    latency much above the server's own comes from a client too busy to read its answers in time."""
    loop = asyncio.get_running_loop()
    while loop.time() < stop_at:
        due = loop.time() + LOOP_PROBE_SECONDS
        await asyncio.sleep(LOOP_PROBE_SECONDS)
        samples.loop_lag.append(max(0.0, loop.time() - due))


async def _force_replans(client: httpx.AsyncClient, config: LoadConfig, stop_at: float, samples: Samples) -> None:
    loop = asyncio.get_running_loop()
    while loop.time() + config.replan_every_seconds < stop_at:
        await asyncio.sleep(config.replan_every_seconds)
        response, elapsed = await _timed(samples, "replan", client, "/v1/plan")
        if response is not None:
            samples.forced_replans.append(elapsed)
