"""The load a trial puts on the service: sessions sending events in a realistic order, node agents that
lease and report, and a watcher that checks the confirmed state while they run.

Every loop here stops on a `threading.Event` and on a deadline; every request has a timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from pydantic import TypeAdapter, ValidationError

from planner_service.soak.checks import Limits, Placement, gpu_view_violations, violations
from planner_service.soak.tally import Tally
from planner_service.wire.cluster import ClusterOut, ModelOut
from planner_service.wire.enums import EventType, ReportStatus, Slo
from planner_service.wire.operations import LeasedOperation, LeaseOut, OperationRecord, ReportOut
from planner_service.wire.sessions import EventsOut, SessionOut
from planner_service.wire.state import SrvOut

TOOLS = ("pytest", "grep", "browser", "python", "sql")
STAY_PROBABILITY = 0.6  # a turn keeps its session's model this often, else hands off to another
MAX_LAG_SECONDS = 2.0  # a sender this far behind its schedule skips ahead instead of bursting


SESSIONS = TypeAdapter(list[SessionOut])


class SessionScript:
    """One agent session's events: request, (tool call start, tool call end)*, turn end, again, then the end.

    `next()` returns the session's next event and advances; a session never comes back after its end (the
    next session takes a new id), so a KV object's session context only grows while it lives.
    """

    def __init__(self, sid: str, models: Sequence[str], rng: np.random.Generator) -> None:
        self.sid, self.models, self.rng = sid, list(models), rng
        self.user = f"user-{int(rng.integers(40))}"
        self.slo = str(rng.choice([s.value for s in Slo]))
        self.model = str(rng.choice(self.models))
        self.turns_left = int(rng.integers(2, 12))
        self.state = "idle"  # idle -> in_turn <-> in_tool -> idle ... -> ended
        self.sent = 0

    @property
    def ended(self) -> bool:
        return self.state == "ended"

    def next(self, event_id: str) -> dict[str, Any]:
        rng = self.rng
        base = {"id": event_id, "session": self.sid}
        self.sent += 1
        if self.state == "idle" and self.turns_left <= 0 and self.sent > 1:
            self.state = "ended"
            return {**base, "type": EventType.SESSION_END.value}
        if self.state == "idle":
            if self.sent > 1 and rng.random() > STAY_PROBABILITY:
                self.model = str(rng.choice(self.models))
            self.state, self.turns_left = "in_turn", self.turns_left - 1
            return {
                **base,
                "type": EventType.REQUEST.value,
                "model": self.model,
                "user": self.user,
                "slo": self.slo,
                "input_tokens": int(rng.integers(200, 4000)),
            }
        if self.state == "in_tool":
            self.state = "in_turn"
            return {**base, "type": EventType.TOOL_CALL_END.value, "tool": str(rng.choice(TOOLS))}
        if rng.random() < 0.5:  # in a turn: call a tool, or end the turn
            self.state = "in_tool"
            return {**base, "type": EventType.TOOL_CALL_START.value, "tool": str(rng.choice(TOOLS))}
        self.state = "idle"
        return {**base, "type": EventType.TURN_END.value, "output_tokens": int(rng.integers(50, 1500))}


@dataclass
class EventLedger:
    """Events the service acknowledged (a 200), kept to be resent after a restart."""

    acked: list[dict[str, Any]] = field(default_factory=list)
    sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, events: list[dict[str, Any]]) -> None:
        with self.lock:
            self.acked.extend(events)

    def sent_more(self, n: int) -> None:
        with self.lock:
            self.sent += n


class EventSender(threading.Thread):
    """Sends its own sessions' events at `rate` events/s in batches of up to `batch`, until stopped.

    A session whose event was not acknowledged is retired (the service may not know it; its next event could
    be refused for that) and a new session takes its place.
    """

    def __init__(
        self,
        name: str,
        base_url: str,
        headers: dict[str, str],
        models: Sequence[str],
        sessions: int,
        rate: float,
        batch: int,
        rng: np.random.Generator,
        tally: Tally,
        ledger: EventLedger,
        stop: threading.Event,
        deadline: float,
    ) -> None:
        super().__init__(name=f"events-{name}", daemon=True)
        self.prefix, self.base_url, self.headers = name, base_url, headers
        self.models, self.rate, self.batch, self.rng = models, rate, batch, rng
        self.tally, self.ledger, self.stop, self.deadline = tally, ledger, stop, deadline
        self.counter = 0
        self.generation = 0
        self.scripts = [self._new_session() for _ in range(sessions)]
        self.late = 0  # times the sender fell behind its schedule and skipped ahead

    def _new_session(self) -> SessionScript:
        self.generation += 1
        return SessionScript(f"{self.prefix}-s{self.generation}", self.models, self.rng)

    def _next_batch(self) -> tuple[list[dict[str, Any]], list[int]]:
        size = int(self.rng.integers(1, self.batch + 1))
        slots = [int(i) for i in self.rng.choice(len(self.scripts), size=min(size, len(self.scripts)), replace=False)]
        events = []
        for i in slots:
            self.counter += 1
            events.append(self.scripts[i].next(f"{self.prefix}-e{self.counter}"))
        return events, slots

    def run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=30.0, headers=self.headers) as client:
            next_at = time.monotonic()
            # the first batch goes out whatever the clock says: on a loaded machine the threads can start after
            # the deadline, and a trial that sent nothing checks nothing
            while True:
                events, slots = self._next_batch()
                self.ledger.sent_more(len(events))
                response = self.tally.call(client, "event", "POST", "/v1/events", json={"events": events})
                if response is not None and response.status_code == 200:
                    answer = EventsOut.model_validate_json(response.content)
                    self.tally.count("events", "applied", answer.applied)
                    self.tally.count("events", "duplicate", answer.duplicates)
                    self.ledger.add(events)
                    failed: list[int] = []
                else:
                    self.tally.count("events", "unacknowledged", len(events))
                    failed = slots
                for i in set(slots):
                    if i in failed or self.scripts[i].ended:
                        self.scripts[i] = self._new_session()
                next_at += len(events) / self.rate
                lag = time.monotonic() - next_at
                if lag > MAX_LAG_SECONDS:
                    self.late += 1
                    next_at = time.monotonic()
                elif lag < 0:
                    self.stop.wait(min(-lag, max(0.0, self.deadline - time.monotonic())))
                if self.stop.is_set() or time.monotonic() >= self.deadline:
                    break


@dataclass
class ReportLedger:
    """Reports the service acknowledged, in the order it applied them (its `updated_at`)."""

    acked: list[tuple[LeasedOperation, ReportOut, str, ReportStatus]] = field(default_factory=list)
    resent_not_duplicate: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)  # done reports the service recorded but did not apply
    unanswered: list[str] = field(default_factory=list)  # reports no answer came back for
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, op: LeasedOperation, answer: ReportOut, lease_id: str, status: ReportStatus) -> None:
        with self.lock:
            self.acked.append((op, answer, lease_id, status))
            if answer.operation.conflict:
                self.conflicts.append(f"{op.id}: {answer.operation.conflict}")

    def done_in_order(self) -> list[OperationRecord]:
        """The applied `done` operations (not conflicts), once each, in the order the service applied them.

        A report sent again because its answer was lost answers `duplicate`: its operation still counts once."""
        with self.lock:
            done = {a.operation.id: a.operation for _, a, _, s in self.acked if s is ReportStatus.DONE}
        return sorted((r for r in done.values() if r.conflict is None), key=lambda r: (r.updated_at, r.seq))

    def count(self, status: ReportStatus) -> int:
        """Operations reported `status` and acknowledged, once each."""
        with self.lock:
            return len({op.id for op, _, _, s in self.acked if s is status})

    def max_srv_version(self) -> int:
        with self.lock:
            return max((a.srv_version for _, a, _, _ in self.acked), default=0)


@dataclass(frozen=True)
class AgentOptions:
    max_operations: int = 4
    wait_seconds: float = 1.0
    time_scale: float = 0.01  # an operation runs this share of its estimated time (at most `max_run_seconds`)
    max_run_seconds: float = 0.2
    fail_fraction: float = 0.0  # reports `failed` this often
    resend_fraction: float = 0.05  # sends the same report again this often (it must answer `duplicate`)
    report_attempts: int = 3  # a report without an answer is sent again (reports are idempotent)


class Agent(threading.Thread):
    """A node agent: long-polls its node's queue, "runs" each operation, reports it with plausible figures."""

    def __init__(
        self,
        name: str,
        node: str,
        base_url: str,
        headers: dict[str, str],
        options: AgentOptions,
        rng: np.random.Generator,
        tally: Tally,
        ledger: ReportLedger,
        stop: threading.Event,
        deadline: float,
    ) -> None:
        super().__init__(name=f"agent-{name}", daemon=True)
        self.node, self.base_url, self.headers, self.options, self.rng = node, base_url, headers, options, rng
        self.tally, self.ledger, self.stop, self.deadline = tally, ledger, stop, deadline

    def run(self) -> None:
        o = self.options
        with httpx.Client(base_url=self.base_url, timeout=o.wait_seconds + 30.0, headers=self.headers) as client:
            while not self.stop.is_set() and time.monotonic() < self.deadline:
                body = {"max_operations": o.max_operations, "wait_seconds": o.wait_seconds}
                response = self.tally.call(client, "lease", "POST", f"/v1/nodes/{self.node}/lease", json=body)
                if response is None or response.status_code != 200:
                    self.stop.wait(0.2)  # a refused or lost lease: back off a little, then poll again
                    continue
                lease = LeaseOut.model_validate_json(response.content)
                if lease.lease_id is None:
                    continue
                for op in lease.operations:  # finish what was leased, even when asked to stop
                    self._run(client, op, lease.lease_id)

    def _run(self, client: httpx.Client, op: LeasedOperation, lease_id: str) -> None:
        o, rng = self.options, self.rng
        time.sleep(min(op.estimated_seconds * o.time_scale, o.max_run_seconds))
        failed = rng.random() < o.fail_fraction
        status = ReportStatus.FAILED if failed else ReportStatus.DONE
        body: dict[str, Any] = {"lease_id": lease_id, "status": status.value}
        if failed:
            body["error"] = "soak: the copy failed"
        else:  # a real copy's time within ±20 % of the estimate, and the bytes it planned
            body["measured_seconds"] = max(op.estimated_seconds, 1e-3) * float(rng.uniform(0.85, 1.2))
            body["measured_bytes"] = op.bytes
        answer = self._report(client, op.id, body)
        if answer is None:
            return
        self.ledger.add(op, answer, lease_id, status)
        if rng.random() < o.resend_fraction:
            again = self._report(client, op.id, body, kind="resend")
            if again is not None and not again.duplicate:
                with self.ledger.lock:
                    self.ledger.resent_not_duplicate.append(op.id)

    def _report(self, client: httpx.Client, op_id: str, body: dict[str, Any], kind: str = "report") -> ReportOut | None:
        for _ in range(self.options.report_attempts):
            response = self.tally.call(client, kind, "POST", f"/v1/operations/{op_id}/report", json=body)
            if response is None:
                continue  # no answer: the same report again is harmless
            if response.status_code == 200:
                return ReportOut.model_validate_json(response.content)
            return None  # 409 (superseded, expired, re-leased) or a refusal: counted by the tally
        with self.ledger.lock:
            self.ledger.unanswered.append(op_id)
        return None


@dataclass
class Snapshot:
    """The confirmed state as one round of reads saw it."""

    srv: SrvOut
    cluster: ClusterOut
    sessions: list[SessionOut]

    def limits(self, models: list[ModelOut]) -> Limits:
        return Limits.of(self.cluster, models, self.sessions)


def read_snapshot(client: httpx.Client, tally: Tally) -> Snapshot | None:
    answers = []
    for path, kind in (("/v1/srv", "read srv"), ("/v1/cluster", "read cluster"), ("/v1/sessions", "read sessions")):
        response = tally.call(client, kind, "GET", path)
        if response is None or response.status_code != 200:
            return None
        answers.append(response.content)
    try:
        return Snapshot(
            SrvOut.model_validate_json(answers[0]),
            ClusterOut.model_validate_json(answers[1]),
            SESSIONS.validate_json(answers[2]),
        )
    except ValidationError:
        tally.count("read", "invalid answer")
        return None


@dataclass
class WatchFindings:
    rounds: int = 0
    violations: list[str] = field(default_factory=list)  # the first few, for the report
    violation_rounds: int = 0
    epochs: list[int] = field(default_factory=list)
    not_ready: int = 0


class Watcher(threading.Thread):
    """Reads the confirmed state every `every_seconds` and checks it against the physical invariants."""

    def __init__(
        self,
        base_url: str,
        headers: dict[str, str],
        models: list[ModelOut],
        every_seconds: float,
        tally: Tally,
        stop: threading.Event,
        deadline: float,
        on_round: Callable[[Snapshot], None] | None = None,
    ) -> None:
        super().__init__(name="watcher", daemon=True)
        self.base_url, self.headers, self.models, self.every_seconds = base_url, headers, models, every_seconds
        self.tally, self.stop, self.deadline, self.on_round = tally, stop, deadline, on_round
        self.findings = WatchFindings()

    def run(self) -> None:
        f = self.findings
        with httpx.Client(base_url=self.base_url, timeout=30.0, headers=self.headers) as client:
            while not self.stop.is_set() and time.monotonic() < self.deadline:
                ready = self.tally.call(client, "read readyz", "GET", "/readyz")
                if ready is not None and ready.status_code == 200 and ready.json().get("epoch") is not None:
                    f.epochs.append(int(ready.json()["epoch"]))
                else:
                    f.not_ready += 1
                snap = read_snapshot(client, self.tally)
                if snap is not None:
                    found = gpu_view_violations(snap.cluster) + violations(
                        Placement.of(snap.srv.placement), snap.limits(self.models)
                    )
                    f.rounds += 1
                    if found:
                        f.violation_rounds += 1
                        f.violations += found[: max(0, 10 - len(f.violations))]
                    if self.on_round is not None:
                        self.on_round(snap)
                self.stop.wait(self.every_seconds)
