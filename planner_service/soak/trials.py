"""The trials: steady load with agents and a restart at the end, and SIGKILL under mixed load."""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from pydantic import TypeAdapter

from planner_service.domain.generate import random_scenario
from planner_service.soak.checks import Limits, Placement, replay
from planner_service.soak.server import ServeOptions, Server, StartupFailed
from planner_service.soak.tally import Tally
from planner_service.soak.traffic import (
    Agent,
    AgentOptions,
    EventLedger,
    EventSender,
    ReportLedger,
    Watcher,
    read_snapshot,
)
from planner_service.wire.cluster import ClusterOut, ModelOut
from planner_service.wire.enums import OperationState, ReportStatus
from planner_service.wire.operations import OperationRecord, ReportOut
from planner_service.wire.sessions import EventsOut
from planner_service.wire.state import SrvOut

MODELS = TypeAdapter(list[ModelOut])
OPERATIONS = TypeAdapter(list[OperationRecord])
JOIN_SECONDS = 60.0  # a load thread stops within its request timeout (30 s) and one operation's run
RESEND_CHUNK = 1000  # events per request when acknowledged events are sent again
FIRST_ACK_SECONDS = 60.0  # the longest a kill trial waits for its first acknowledged event and report
# what a healthy service never logs; each is counted in the trial's figures
LOG_ALARMS = {
    "unplannable": re.compile(r"cannot be planned"),
    "tracebacks": re.compile(r"^Traceback", re.MULTILINE),
    "startup failed": re.compile(r"Application startup failed"),
    "conflicts": re.compile(r"reported done but not applied"),
    "quarantined": re.compile(r"quarantined"),
}


class SoakError(RuntimeError):
    """The service answered a read the trial needs with something other than 200."""


def get(client: httpx.Client, path: str, **params: Any) -> bytes:
    response = client.get(path, params=params or None)
    if response.status_code != 200:
        raise SoakError(f"GET {path}: {response.status_code} {response.text[:300]}")
    return response.content


def read_operations(client: httpx.Client, state: OperationState) -> dict[str, OperationRecord]:
    return {r.id: r for r in OPERATIONS.validate_json(get(client, "/v1/operations", state=state.value))}


def log_alarms(text: str) -> dict[str, int]:
    return {name: len(pattern.findall(text)) for name, pattern in LOG_ALARMS.items()}


def write_large_scenario(path: Path, nodes: int, seed: int) -> Path:
    """A generated cluster of `nodes` nodes with four GPUs each, seven models and a few sessions."""
    scenario = random_scenario(np.random.default_rng(seed), gpus=4 * nodes, models=7, sessions=40)
    path.write_text(json.dumps(scenario.model_dump(mode="json", by_alias=True, exclude_none=True)))
    return path


# -- steady load ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadConfig:
    name: str
    seed: tuple[str, ...] = ("--demo",)  # `serve`'s seed: --demo, or --scenario FILE
    duration_seconds: float = 600.0
    agents_per_node: int = 3
    events_per_second: float = 50.0
    sessions: int = 200
    senders: int = 10  # threads sending events: enough that one slow answer does not hold back the rate
    batch: int = 1  # events per request: one, as a router that does not batch sends them
    watch_every_seconds: float = 1.0
    rng_seed: int = 0
    agent: AgentOptions = field(default_factory=AgentOptions)


@dataclass
class LoadResult:
    config: LoadConfig
    nodes: int = 0
    gpus: int = 0
    agents: int = 0
    seconds: float = 0.0
    startup_seconds: float | None = None
    tally: Tally = field(default_factory=Tally)
    events_sent: int = 0
    events_acked: int = 0
    events_lost: int = 0  # sent in a request no 200 came back for
    reports_done: int = 0
    reports_failed: int = 0
    conflicts: list[str] = field(default_factory=list)
    resent_not_duplicate: list[str] = field(default_factory=list)
    unanswered_reports: list[str] = field(default_factory=list)
    watch_rounds: int = 0
    watch_violations: list[str] = field(default_factory=list)
    watch_violation_rounds: int = 0
    replay_applied: int = 0
    replay_violations: list[str] = field(default_factory=list)
    double_applied: list[str] = field(default_factory=list)
    source_short: list[str] = field(default_factory=list)
    placement_differences: list[str] = field(default_factory=list)
    epochs: tuple[int, int] | None = None
    not_ready_rounds: int = 0
    sigterm_exit: int | None = None
    sigterm_seconds: float | None = None
    restart_seconds: float | None = None
    restart_error: str | None = None
    restored_version: tuple[int, int] | None = None  # (before, after)
    restored_placement: bool = False
    quarantine: int = 0
    alarms: dict[str, int] = field(default_factory=dict)
    error: str | None = None

    @property
    def capacity_violations(self) -> int:
        return len(self.watch_violations) + len(self.replay_violations)

    @property
    def restart_ok(self) -> bool:
        return (
            self.restart_error is None
            and self.restored_placement
            and self.restored_version is not None
            and self.restored_version[0] == self.restored_version[1]
        )

    @property
    def ok(self) -> bool:
        expected = {("report", "409"), ("resend", "409")}  # a lease that expired or a superseded operation
        return (
            self.error is None
            and self.capacity_violations == 0
            and not self.double_applied
            and not self.resent_not_duplicate
            and not self.source_short
            and not self.placement_differences
            and self.tally.status_5xx() == 0
            and self.tally.unexpected_4xx(expected) == 0
            and self.events_lost == 0
            and self.restart_ok
        )


def run_load(config: LoadConfig, workdir: Path) -> LoadResult:
    """Start a fresh service, load it for the configured time while watching its confirmed state, replay
    the reported operations, then SIGTERM it and start it again on its database."""
    result = LoadResult(config)
    options = ServeOptions(workdir / f"{config.name}.db", workdir / f"{config.name}.log", list(config.seed))
    server = Server(options)
    try:
        result.startup_seconds = server.start()
        _load(server, config, result)
        _restart(server, result)
    except (StartupFailed, SoakError, httpx.HTTPError) as error:
        result.error = f"{type(error).__name__}: {error}"
    finally:
        server.kill()
        result.alarms = log_alarms(server.log_text())
    return result


def _load(server: Server, config: LoadConfig, result: LoadResult) -> None:
    rng = np.random.default_rng(config.rng_seed)
    with server.client() as client:
        models = MODELS.validate_json(get(client, "/v1/models"))
        cluster = ClusterOut.model_validate_json(get(client, "/v1/cluster"))
        seed = Placement.of(SrvOut.model_validate_json(get(client, "/v1/srv")).placement)
    result.nodes, result.gpus = len(cluster.nodes), sum(len(n.gpus) for n in cluster.nodes)
    tally, events, reports = result.tally, EventLedger(), ReportLedger()
    stop_events, stop_agents, stop_watch = threading.Event(), threading.Event(), threading.Event()
    began = time.monotonic()
    deadline = began + config.duration_seconds
    model_ids = [m.id for m in models]
    headers = server.headers()
    senders = [
        EventSender(
            f"{config.name}-w{i}",
            server.base_url,
            headers,
            model_ids,
            max(1, config.sessions // config.senders),
            config.events_per_second / config.senders,
            config.batch,
            np.random.default_rng(rng.integers(2**32)),
            tally,
            events,
            stop_events,
            deadline,
        )
        for i in range(config.senders)
    ]
    agents = [
        Agent(
            f"{node.id}-{k}",
            node.id,
            server.base_url,
            headers,
            config.agent,
            np.random.default_rng(rng.integers(2**32)),
            tally,
            reports,
            stop_agents,
            deadline + JOIN_SECONDS,
        )
        for node in cluster.nodes
        for k in range(config.agents_per_node)
    ]
    watcher = Watcher(
        server.base_url, headers, models, config.watch_every_seconds, tally, stop_watch, deadline + JOIN_SECONDS
    )
    result.agents = len(agents)
    threads = [*senders, *agents, watcher]
    for t in threads:
        t.start()
    for t in senders:
        t.join(config.duration_seconds + JOIN_SECONDS)
    stop_events.set()
    stop_agents.set()
    for t in agents:
        t.join(JOIN_SECONDS)
    stop_watch.set()
    watcher.join(JOIN_SECONDS)
    result.seconds = time.monotonic() - began
    if any(t.is_alive() for t in threads):
        raise SoakError(f"load threads still running: {[t.name for t in threads if t.is_alive()]}")

    result.events_sent, result.events_acked = events.sent, len(events.acked)
    result.events_lost = tally.of("events", "unacknowledged")
    done = reports.done_in_order()
    result.reports_done, result.reports_failed = reports.count(ReportStatus.DONE), reports.count(ReportStatus.FAILED)
    result.conflicts, result.resent_not_duplicate = reports.conflicts, reports.resent_not_duplicate
    result.unanswered_reports = reports.unanswered
    f = watcher.findings
    result.watch_rounds, result.watch_violations, result.watch_violation_rounds = (
        f.rounds,
        f.violations,
        f.violation_rounds,
    )
    result.not_ready_rounds = f.not_ready
    result.epochs = (f.epochs[0], f.epochs[-1]) if f.epochs else None

    with server.client() as client:
        final = read_snapshot(client, tally)
        if final is None:
            raise SoakError("the final state could not be read")
    replayed = replay(seed, done, final.limits(models))
    result.replay_applied = replayed.applied
    result.replay_violations = replayed.violations[:10]
    result.double_applied, result.source_short = replayed.double_applied, replayed.source_short
    result.placement_differences = replayed.placement.differences(Placement.of(final.srv.placement))


def _restart(server: Server, result: LoadResult) -> None:
    with server.client() as client:
        before = SrvOut.model_validate_json(get(client, "/v1/srv"))
    result.sigterm_exit, result.sigterm_seconds = server.terminate()
    try:
        result.restart_seconds = server.start()
    except StartupFailed as error:
        result.restart_error = str(error)[-2000:]
        return
    with server.client() as client:
        after = SrvOut.model_validate_json(get(client, "/v1/srv"))
        cluster = ClusterOut.model_validate_json(get(client, "/v1/cluster"))
    result.restored_version = (before.version, after.version)
    result.restored_placement = not Placement.of(before.placement).differences(Placement.of(after.placement))
    result.quarantine = len(cluster.quarantine)
    server.terminate()


# -- SIGKILL trials ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KillConfig:
    trials: int = 50
    min_load_seconds: float = 0.3
    max_load_seconds: float = 3.0
    events_per_second: float = 100.0
    sessions: int = 40
    senders: int = 2
    batch: int = 8  # events per request: a router's batch
    rng_seed: int = 1
    agent: AgentOptions = field(
        default_factory=lambda: AgentOptions(
            max_operations=4, wait_seconds=0.5, fail_fraction=0.05, resend_fraction=0.1
        )
    )
    replan_interval_seconds: float = 2.0


@dataclass
class KillTrial:
    trial: int
    load_seconds: float
    events_acked: int = 0
    events_lost: int = 0
    reports_acked: int = 0
    reports_lost: int = 0
    double_applied: int = 0
    version_regressed: bool = False
    integrity: str = ""
    startup_seconds: float | None = None
    placement_differences: list[str] = field(default_factory=list)
    errors_5xx: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return (
            self.error is None
            and self.events_lost == 0
            and self.reports_lost == 0
            and self.double_applied == 0
            and not self.version_regressed
            and self.integrity == "ok"
            and self.startup_seconds is not None
            and not self.placement_differences
            and self.errors_5xx == 0
        )


@dataclass
class KillResult:
    config: KillConfig
    trials: list[KillTrial] = field(default_factory=list)
    first_startup_seconds: float | None = None
    alarms: dict[str, int] = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and len(self.trials) == self.config.trials and all(t.ok for t in self.trials)

    def total(self, name: str) -> int:
        return sum(int(getattr(t, name)) for t in self.trials)


def integrity_check(db: Path) -> str:
    """`PRAGMA integrity_check` on a database no process has open (`ok`, or what is wrong)."""
    with sqlite3.connect(db, timeout=10.0) as connection:
        rows = connection.execute("PRAGMA integrity_check").fetchall()
    connection.close()
    return "; ".join(str(r[0]) for r in rows)


def run_kill_trials(config: KillConfig, workdir: Path) -> KillResult:
    """One database, `trials` times: mixed load, SIGKILL at a random moment, integrity check, restart, and a
    check that everything acknowledged before the kill is still there and is not applied again."""
    result = KillResult(config)
    options = ServeOptions(
        workdir / "kill.db",
        workdir / "kill.log",
        ["--demo"],
        {"STATEBUDGET_REPLAN_INTERVAL_SECONDS": str(config.replan_interval_seconds)},
    )
    server = Server(options)
    rng = np.random.default_rng(config.rng_seed)
    try:
        result.first_startup_seconds = server.start()
        with server.client() as client:
            model_ids = [m.id for m in MODELS.validate_json(get(client, "/v1/models"))]
            nodes = [n.id for n in ClusterOut.model_validate_json(get(client, "/v1/cluster")).nodes]
        for i in range(config.trials):
            trial = KillTrial(i + 1, float(rng.uniform(config.min_load_seconds, config.max_load_seconds)))
            result.trials.append(trial)
            _kill_trial(server, config, trial, model_ids, nodes, np.random.default_rng(rng.integers(2**32)))
            if trial.startup_seconds is None:
                break  # the service no longer starts on this database: nothing further can be measured
    except (StartupFailed, SoakError, httpx.HTTPError) as error:
        result.error = f"{type(error).__name__}: {error}"
    finally:
        server.kill()
        result.alarms = log_alarms(server.log_text())
    return result


def _kill_trial(
    server: Server,
    config: KillConfig,
    trial: KillTrial,
    model_ids: list[str],
    nodes: list[str],
    rng: np.random.Generator,
) -> None:
    with server.client() as client:
        before = Placement.of(SrvOut.model_validate_json(get(client, "/v1/srv")).placement)
        done_before = set(read_operations(client, OperationState.DONE))
    tally, events, reports = Tally(), EventLedger(), ReportLedger()
    stop = threading.Event()
    deadline = time.monotonic() + FIRST_ACK_SECONDS + trial.load_seconds + JOIN_SECONDS
    headers = server.headers()
    threads: list[threading.Thread] = [
        EventSender(
            f"k{trial.trial}-w{i}",
            server.base_url,
            headers,
            model_ids,
            max(1, config.sessions // config.senders),
            config.events_per_second / config.senders,
            config.batch,
            np.random.default_rng(rng.integers(2**32)),
            tally,
            events,
            stop,
            deadline,
        )
        for i in range(config.senders)
    ]
    threads += [
        Agent(
            f"k{trial.trial}-{node}",
            node,
            server.base_url,
            headers,
            config.agent,
            np.random.default_rng(rng.integers(2**32)),
            tally,
            reports,
            stop,
            deadline,
        )
        for node in nodes
    ]
    for t in threads:
        t.start()
    _wait_for_first_acks(events, reports, time.monotonic() + FIRST_ACK_SECONDS)
    time.sleep(trial.load_seconds)
    server.kill()  # at a random moment of the load: requests in flight get no answer
    stop.set()
    for t in threads:
        t.join(JOIN_SECONDS)
    if any(t.is_alive() for t in threads):
        trial.error = "load threads did not stop"
        return
    trial.errors_5xx = tally.status_5xx()
    trial.integrity = integrity_check(server.options.db)
    try:
        trial.startup_seconds = server.start()
    except StartupFailed as error:
        trial.error = str(error)[-2000:]
        return
    trial.events_acked, trial.reports_acked = len(events.acked), len(reports.acked)
    with server.client() as client:
        trial.events_lost = _resend_events(client, events.acked)
        _check_reports(client, reports, before, done_before, trial)


def _wait_for_first_acks(events: EventLedger, reports: ReportLedger, deadline: float) -> None:
    """Until the service acknowledged an event and a report (or `deadline`): the random moment of the kill is
    counted from there, so that a slow machine's trial still kills a service with acknowledged work to lose."""
    while time.monotonic() < deadline and not (events.acked and reports.acked):
        time.sleep(0.05)


def _resend_events(client: httpx.Client, acked: list[dict[str, Any]]) -> int:
    """Send acknowledged events again: each must answer `duplicate`. The number that did not."""
    lost = 0
    for start in range(0, len(acked), RESEND_CHUNK):
        chunk = acked[start : start + RESEND_CHUNK]
        response = client.post("/v1/events", json={"events": chunk})
        if response.status_code == 200:
            lost += sum(1 for r in EventsOut.model_validate_json(response.content).results if r.status != "duplicate")
            continue
        for event in chunk:  # refused as a whole (a session the service does not know): find which, one by one
            one = client.post("/v1/events", json={"events": [event]})
            if one.status_code != 200 or EventsOut.model_validate_json(one.content).results[0].status != "duplicate":
                lost += 1
    return lost


def _check_reports(
    client: httpx.Client, reports: ReportLedger, before: Placement, done_before: set[str], trial: KillTrial
) -> None:
    done = read_operations(client, OperationState.DONE)
    failed = read_operations(client, OperationState.FAILED)
    srv = SrvOut.model_validate_json(get(client, "/v1/srv"))
    trial.version_regressed = srv.version < reports.max_srv_version()
    for op, _, lease_id, status in reports.acked:
        held = done if status.value == "done" else failed
        if op.id not in held or held[op.id].lease_id != lease_id:
            trial.reports_lost += 1
            continue
        again = client.post(f"/v1/operations/{op.id}/report", json={"lease_id": lease_id, "status": status.value})
        if again.status_code != 200 or not ReportOut.model_validate_json(again.content).duplicate:
            trial.double_applied += 1
    trial.double_applied += len(reports.resent_not_duplicate)
    if SrvOut.model_validate_json(get(client, "/v1/srv")).version != srv.version:
        trial.double_applied += 1  # a resent report moved the confirmed state
    new = sorted(
        (r for r in done.values() if r.id not in done_before and r.conflict is None),
        key=lambda r: (r.updated_at, r.seq),
    )
    # the limits only matter for the replay's own invariant checks; the comparison is what counts here
    cluster = ClusterOut.model_validate_json(get(client, "/v1/cluster"))
    limits = Limits.of(cluster, MODELS.validate_json(get(client, "/v1/models")), [])
    replayed = replay(before, new, limits)
    trial.double_applied += len(replayed.double_applied)
    trial.placement_differences = replayed.placement.differences(Placement.of(srv.placement))
