"""The fault cases of the reliability issue (F2, F3, F5, F6, F7) against a real `statebudget serve`.

Each case sends one bad input (or runs one race), reads the answer, and reads the state the input must not
have changed. A bad number is written into the JSON text as such (`1e400`, `Infinity`, a 401-digit integer):
that is what a client with a bug sends, and what a JSON library would refuse to write.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from pydantic import TypeAdapter

from planner_service.soak.server import CLEARED_ENV, LOOPBACK, ServeOptions, Server, StartupFailed, free_port
from planner_service.wire.cluster import ClusterOut
from planner_service.wire.enums import OperationState, Tier
from planner_service.wire.operations import LeasedOperation, LeaseOut, OperationRecord
from planner_service.wire.state import SrvOut

OPERATIONS = TypeAdapter(list[OperationRecord])
LEASE_SECONDS = 3.0  # the fault server's lease: short, so that F6's expiry is quick, and longer than a case
SETTINGS_ERROR_TIMEOUT_SECONDS = 60.0


@dataclass
class FaultCase:
    issue: str
    name: str
    expected: str
    observed: str
    ok: bool
    open: bool = False  # a known gap still to close: reported, not counted as a regression


def raw_json(data: dict[str, Any], **numbers: str) -> str:
    """`data` as JSON with each string `"@name@"` replaced by the bare text `numbers[name]` (`1e400`, `Infinity`)."""
    text = json.dumps(data)
    for name, number in numbers.items():
        text = text.replace(f'"@{name}@"', number)
    return text


def field_of(response: httpx.Response) -> str | None:
    try:
        body = response.json()
    except ValueError:
        return None
    return body.get("field") if isinstance(body, dict) else None


def answer(response: httpx.Response) -> str:
    where = field_of(response)
    return f"{response.status_code}" + (f" naming `{where}`" if where else "")


class FaultRun:
    """One fault server (operator token, short leases, no timed replans) and the reads the cases compare."""

    def __init__(self, workdir: Path) -> None:
        self.token = f"soak-{secrets.token_hex(8)}"
        env = {
            "STATEBUDGET_OPERATOR_TOKENS": json.dumps([self.token]),
            "STATEBUDGET_LEASE_SECONDS": str(LEASE_SECONDS),
            "STATEBUDGET_REPLAN_INTERVAL_SECONDS": "3600",
        }
        self.workdir = workdir
        self.server = Server(ServeOptions(workdir / "faults.db", workdir / "faults.log", ["--demo"], env, self.token))
        self.cases: list[FaultCase] = []

    def add(self, issue: str, name: str, expected: str, observed: str, ok: bool, *, open: bool = False) -> None:
        self.cases.append(FaultCase(issue, name, expected, observed, ok, open and not ok))

    def c(self) -> httpx.Client:
        return self.server.client()

    # -- reads -----------------------------------------------------------------------------------------

    def srv_version(self) -> int:
        with self.c() as c:
            return SrvOut.model_validate_json(c.get("/v1/srv").content).version

    def cluster(self) -> ClusterOut:
        with self.c() as c:
            return ClusterOut.model_validate_json(c.get("/v1/cluster").content)

    def state_of(self, op_id: str) -> OperationState | None:
        with self.c() as c:
            for state in (OperationState.LEASED, OperationState.DONE, OperationState.QUEUED):
                rows = OPERATIONS.validate_json(c.get("/v1/operations", params={"state": state.value}).content)
                if any(r.id == op_id for r in rows):
                    return state
        return None

    def lease_some(self, wanted: Callable[[LeasedOperation], bool] = lambda op: True) -> tuple[LeasedOperation, str]:
        """A freshly leased operation that `wanted` accepts; the others leased with it run out and go back to
        their queue. Where none fits, plan again once the leases have run out."""
        for _ in range(4):
            with self.c() as c:
                c.post("/v1/plan")
                for node in self.cluster().nodes:
                    out = LeaseOut.model_validate_json(
                        c.post(f"/v1/nodes/{node.id}/lease", json={"max_operations": 4}).content
                    )
                    for op in out.operations:
                        if out.lease_id and wanted(op):
                            return op, out.lease_id
            time.sleep(LEASE_SECONDS + 0.2)
        raise RuntimeError("no leased operation fits the case")

    def report(self, op: LeasedOperation, lease_id: str, **fields: Any) -> httpx.Response:
        with self.c() as c:
            body = {"lease_id": lease_id, "status": "done", **fields}
            return c.post(f"/v1/operations/{op.id}/report", json=body)

    def raw(self, method: str, path: str, text: str) -> httpx.Response:
        with self.c() as c:
            return c.request(method, path, content=text, headers={"Content-Type": "application/json"})


def link_value(cluster: ClusterOut, op: LeasedOperation) -> tuple[str, float] | None:
    """The calibrated bandwidth the copy `op` crosses, by name, and its effective value now."""
    src, dst = op.source, op.dest
    if src is None or dst is None:
        return None
    nodes = {n.id: n for n in cluster.nodes}
    gpus = {g.id: g for n in cluster.nodes for g in n.gpus}
    if src.tier is Tier.NVME:
        return f"{src.id}.nvme_read_bytes_per_s", nodes[src.id].nvme_read_bytes_per_s
    if dst.tier is Tier.NVME:
        return f"{dst.id}.nvme_write_bytes_per_s", nodes[dst.id].nvme_write_bytes_per_s
    if src.tier is Tier.HOST and dst.tier is Tier.GPU:
        return f"{dst.id}.h2d_bytes_per_s", gpus[dst.id].h2d_bytes_per_s
    if src.tier is Tier.GPU and dst.tier is Tier.HOST:
        return f"{src.id}.d2h_bytes_per_s", gpus[src.id].d2h_bytes_per_s
    return None


def run_faults(workdir: Path) -> list[FaultCase]:
    run = FaultRun(workdir)
    try:
        run.server.start()
        _f6(run)  # first: leases other cases leave behind run out later and may start a replan
        _f2(run)
        _f3(run)
        _f5(run)
        _f7(run)
        _f2_kill(run)
    except (StartupFailed, httpx.HTTPError, RuntimeError) as error:
        run.add("-", "the fault run itself", "completes", f"{type(error).__name__}: {error}"[:500], False)
    finally:
        run.server.kill()
    _settings_errors(run, workdir)
    return run.cases


def _f2(run: FaultRun) -> None:
    op, lease_id = run.lease_some()
    version = run.srv_version()
    body = {"lease_id": lease_id, "status": "done", "measured_seconds": 1.0, "measured_bytes": "@n@"}
    text = raw_json(body, n="1" + "0" * 400)  # 10**400, as an integer
    out = run.raw("POST", f"/v1/operations/{op.id}/report", text)
    state, after = run.state_of(op.id), run.srv_version()
    with run.c() as c:
        live = c.get("/livez").status_code
    run.add(
        "F2",
        "a report of 10^400 measured bytes",
        "422 naming `measured_bytes`; the operation stays leased, the SRV version stays",
        f"{answer(out)}; operation {state.value if state else 'gone'}; SRV version {version} -> {after}; /livez {live}",
        out.status_code == 422
        and field_of(out) == "measured_bytes"
        and state is OperationState.LEASED
        and after == version
        and live == 200,
    )
    run.report(op, lease_id, measured_seconds=max(op.estimated_seconds, 1e-3), measured_bytes=op.bytes)


def _f3(run: FaultRun) -> None:
    cluster = run.cluster()
    node, gpu = cluster.nodes[0], cluster.nodes[0].gpus[0]
    cases = [
        (
            "a heartbeat with nvme_read_bytes_per_s Infinity",
            "POST",
            f"/v1/nodes/{node.id}/heartbeat",
            raw_json({"nvme_read_bytes_per_s": "@x@"}, x="Infinity"),
            "nvme_read_bytes_per_s",
        ),
        (
            "a heartbeat with h2d_bytes_per_s 1e308",
            "POST",
            f"/v1/nodes/{node.id}/heartbeat",
            raw_json({"gpus": [{"id": gpu.id, "h2d_bytes_per_s": "@x@"}]}, x="1e308"),
            "gpus.0.h2d_bytes_per_s",
        ),
        (
            "a registration with host_dram_bytes 1e400",
            "POST",
            f"/v1/nodes/{node.id}/register",
            raw_json({"host_dram_bytes": "@x@"}, x="1e400"),
            "host_dram_bytes",
        ),
    ]
    for name, method, path, text, where in cases:
        before = run.cluster().model_dump()
        out = run.raw(method, path, text)
        unchanged = _same_cluster(before, run.cluster().model_dump())
        run.add(
            "F3",
            name,
            f"422 naming `{where}`; the cluster and its calibration unchanged",
            f"{answer(out)}; cluster {'unchanged' if unchanged else 'CHANGED'}",
            out.status_code == 422 and field_of(out) == where and unchanged,
        )
    op, lease_id = run.lease_some()
    text = raw_json({"lease_id": lease_id, "status": "done", "measured_seconds": "@x@"}, x="Infinity")
    version = run.srv_version()
    out = run.raw("POST", f"/v1/operations/{op.id}/report", text)
    state = run.state_of(op.id)
    run.add(
        "F3",
        "a report with measured_seconds Infinity",
        "422 naming `measured_seconds`; the operation stays leased",
        f"{answer(out)}; operation {state.value if state else 'gone'}; SRV version {version} -> {run.srv_version()}",
        out.status_code == 422 and field_of(out) == "measured_seconds" and state is OperationState.LEASED,
    )
    run.report(op, lease_id, measured_seconds=max(op.estimated_seconds, 1e-3), measured_bytes=op.bytes)


def _same_cluster(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same topology, bandwidths and calibration (heartbeat times, telemetry and its reconcile aside, and
    each GPU's used and planned bytes, which a plan or a report landing between the two reads may move)."""

    def gpu(g: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in g.items() if k not in ("used_bytes", "planned_bytes")}

    def strip(cluster: dict[str, Any]) -> Any:
        return [
            {
                **{
                    k: v for k, v in n.items() if k not in ("last_heartbeat", "telemetry", "reconcile", "registered_at")
                },
                "gpus": [gpu(g) for g in n["gpus"]],
            }
            for n in cluster["nodes"]
        ]

    return bool(strip(a) == strip(b))


def _f5(run: FaultRun) -> None:
    for factor, label in ((1000, "1,000 times the planned bytes"), (None, "1 byte")):
        op, lease_id = run.lease_some(lambda o: link_value(run.cluster(), o) is not None)
        link = link_value(run.cluster(), op)
        assert link is not None
        measured = op.bytes * factor if factor else 1
        out = run.report(op, lease_id, measured_seconds=max(op.estimated_seconds, 1e-3), measured_bytes=measured)
        after = link_value(run.cluster(), op)
        assert after is not None
        run.add(
            "F5",
            f"a done report of {label} ({op.action.value} {op.source.label() if op.source else '-'} -> "
            f"{op.dest.label() if op.dest else '-'})",
            f"accepted as done; {link[0]} keeps its value",
            f"{answer(out)}; {link[0]} {link[1]:.4g} -> {after[1]:.4g} B/s",
            out.status_code == 200 and after[1] == link[1],
        )


def _f6(run: FaultRun) -> None:
    op, first_lease = run.lease_some()
    with run.c() as c:
        paths = list(c.get("/openapi.json").json().get("paths", {}))
    renewals = [p for p in paths if "renew" in p or "extend" in p]
    time.sleep(LEASE_SECONDS + 0.5)  # the first lease runs out while its agent is still "running" the copy
    with run.c() as c:
        out = LeaseOut.model_validate_json(c.post(f"/v1/nodes/{op.node}/lease", json={"max_operations": 50}).content)
    second = out.lease_id if any(o.id == op.id for o in out.operations) else None
    state = run.state_of(op.id)  # leased again, or superseded by a plan made when the lease ran out
    seconds = max(op.estimated_seconds, 1e-3)
    late = run.report(op, first_lease, measured_seconds=seconds, measured_bytes=op.bytes)
    current = run.report(op, second, measured_seconds=seconds, measured_bytes=op.bytes) if second else None
    after = run.state_of(op.id)
    run.add(
        "F6",
        "a report under a lease that ran out (the operation then leased to another agent)",
        "the late report answers 409; the operation is done once, under the current lease",
        f"after the lease ran out: {'leased again' if second else (state.value if state else 'superseded')}; "
        f"late report {answer(late)}; current report {answer(current) if current is not None else '-'}; "
        f"operation {after.value if after else 'superseded'}",
        late.status_code == 409 and (current is None or (current.status_code == 200 and after is OperationState.DONE)),
    )
    run.add(
        "F6",
        "lease renewal: an agent extends the lease of an operation it still runs",
        "an endpoint that renews a live lease and refuses a superseded one",
        f"renewal endpoint: {', '.join(renewals)} (not exercised here)" if renewals else "no renewal endpoint",
        bool(renewals),
        open=True,
    )


def _f7(run: FaultRun) -> None:
    for at, label in ((0.0, "1970"), (253402300799.0, "9999")):
        sid = f"soak-skew-{label}"
        event = {"id": f"{sid}-e1", "type": "request", "session": sid, "model": "planner", "at": at}
        with run.c() as c:
            out = c.post("/v1/events", json={"events": [event]})
            session = c.get(f"/v1/sessions/{sid}").status_code
        run.add(
            "F7",
            f"an event dated {label} (`at` {at:.0f})",
            "422 naming `events.0.at`; no session created",
            f"{answer(out)}; GET the session: {session}",
            out.status_code == 422 and field_of(out) == "events.0.at" and session == 404,
        )
    with httpx.Client(base_url=run.server.base_url, timeout=30.0) as bare:  # the token only in the URL
        out = bare.get("/v1/srv", params={"token": run.token})
        bare.get("/v1/srv", params={"access_token": run.token})
    time.sleep(0.5)  # the access log line is written after the answer
    logged = run.token in run.server.log_text()
    run.add(
        "F7",
        "a token in the query string (`?token=`, `?access_token=`)",
        "the access log never shows the token",
        f"{answer(out)}; token in the log: {'YES' if logged else 'no'}",
        not logged,
    )


def _f2_kill(run: FaultRun) -> None:
    version = run.srv_version()
    run.server.kill()
    try:
        run.server.start()
    except StartupFailed as error:
        run.add("F2", "SIGKILL after the refused reports", "starts; the same SRV version", str(error)[-300:], False)
        return
    after = run.srv_version()
    run.add(
        "F2",
        "SIGKILL after the refused and accepted reports, then a restart",
        "starts; the SRV version is the last one acknowledged",
        f"SRV version {version} -> {after}",
        after == version,
    )


def _settings_errors(run: FaultRun, workdir: Path) -> None:
    secret = f"soak-secret-{secrets.token_hex(6)}"
    cases = [
        ("an operator token list with an empty token", {"STATEBUDGET_OPERATOR_TOKENS": json.dumps([secret, ""])}),
        ("a node token map that is not JSON", {"STATEBUDGET_NODE_TOKENS": json.dumps({"n1": secret})[:-1]}),
    ]
    for name, env in cases:
        environ = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV} | env
        command = [sys.executable, "-m", "planner_service.cli", "serve", "--db", str(workdir / "settings.db")]
        command += ["--host", LOOPBACK, "--port", str(free_port())]
        try:
            done = subprocess.run(
                command,
                check=False,
                env=environ,
                capture_output=True,
                text=True,
                timeout=SETTINGS_ERROR_TIMEOUT_SECONDS,
            )
        except subprocess.TimeoutExpired:
            run.add("F7", f"a settings error: {name}", "refuses to start", "still running after 60 s", False)
            continue
        printed = done.stdout + done.stderr
        run.add(
            "F7",
            f"a settings error: {name}",
            "refuses to start, naming the setting, without printing the token",
            f"exit {done.returncode}; token printed: {'YES' if secret in printed else 'no'}",
            done.returncode != 0 and secret not in printed,
        )
