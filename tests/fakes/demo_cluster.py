"""The demo cluster on contract fakes, end to end: `statebudget serve --demo`, one `statebudget-agent run` per
demo node with the `vllm` executor, each model a managed fake vLLM process (tests/fakes/run_vllm.py: sleep
mode, dev mode, its own LMCache instance id) whose GPU memory the agent reads through a fake NVML
(tests/fakes/nvml_driver/pynvml.py), and an hour of synthetic traffic (planner_service/sim/synth.py) replayed
time-compressed as session events.

    python tests/fakes/demo_cluster.py [--hour-seconds 30] [--seed 1] [--dir DIR] [--out report.json]
        [--server URL]

With `--server` the agents and their engines work for a planner already running the demo (`make run`'s,
http://127.0.0.1:8080, started afresh), which is left running at the end.

At the start the engines the demo's confirmed state runs (or keeps asleep) are started through the agent's
own process manager (clients/agent/lifecycle.py), so each agent finds them by their launch records as it
would after a restart. At the end, once the service has nothing queued or leased, the report says:

- `operations`: the operations by state (a `superseded` one was replaced by a newer plan before a node
  leased it), the failed ones with their errors, the plan's `held_back`;
- `gpus`: per GPU, the bytes the fake NVML shows in use, the bytes the service's engine view says the
  confirmed state holds there (`GET /v1/engines`: context, shard and KV pool of each engine instance by its
  state, planner_service/domain/engines.py `holdings`), the weights and experts the SRV places there and the
  shards the fake engines hold there, and what the node's last heartbeat said;
- `engines`: each fake engine process's state, and whether each had an LMCache instance id of its own;
- `reconcile`: the state each node lost or had corrected;
- whether the service accepted each node's heartbeats until the end (a refused one leaves the node's
  telemetry as it was).

`problems` lists every disagreement; the run exits 1 when there is one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from clients.sdk import ConnectionError as SdkConnectionError
from clients.sdk import (
    ServerError,
    StateBudgetClient,  # after the path is set
)
from planner_service.domain.demo import demo_scenario
from planner_service.sim.synth import SynthParams, synth_trace
from planner_service.sim.trace import TraceEnd, TraceRecord

BIN = Path(sys.executable).parent
OP_STATES = ("queued", "leased", "done", "failed", "superseded")
RUN_VLLM = ROOT / "tests" / "fakes" / "run_vllm.py"
NVML_DRIVER = ROOT / "tests" / "fakes" / "nvml_driver"
FEATURES = ["dev_mode", "lmcache", "sleep_mode"]
CONTEXT_BYTES = 1 << 30  # the engine model's context_bytes_per_gpu (planner_service/domain/engines.py)
CHECKPOINT_BYTES = 1 << 16  # a stand-in checkpoint file: the fake engines read none, the read-ahead advises it
ROUNDING_BYTES = 8  # a MoE's GPU experts: floor(experts_bytes * fraction) may fall a byte short per GPU
SERVICE_ENV = {  # the planning loop's wall-clock constants, shortened with the hour
    "STATEBUDGET_LOG_LEVEL": "warning",
    "STATEBUDGET_LEASE_SECONDS": "10",
    "STATEBUDGET_REPLAN_INTERVAL_SECONDS": "1",
    "STATEBUDGET_UNPIN_AFTER_SECONDS": "2",
    "STATEBUDGET_MAX_WAIT_SECONDS": "2",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_ports(n: int, rng: random.Random) -> list[int]:
    """`n` distinct ports free now for engines that start later: below the kernel's ephemeral range, so that
    no outgoing connection takes one meanwhile (and not `free_port` n times, which may answer a port twice)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports: list[int] = []
    with contextlib.ExitStack() as held:
        while len(ports) < n:
            port = rng.randrange(10_000, low)
            s = held.enter_context(socket.socket())
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken
            ports.append(port)
    return ports


def total_bytes(gpu: dict[str, Any]) -> int:
    return int(gpu["capacity_bytes"]) + int(gpu.get("reserved_bytes") or 0)


def wait_for(predicate: Any, timeout_seconds: float, what: str, every_seconds: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(SdkConnectionError, ServerError):
            if predicate():
                return
        time.sleep(every_seconds)
    raise TimeoutError(f"timed out after {timeout_seconds:g} s waiting for {what}")


@dataclass
class Node:
    id: str
    gpus: list[dict[str, Any]]  # {id, type, capacity_bytes}
    config_path: Path
    driver_dir: Path
    state_dir: Path
    config: dict[str, Any]
    agent: subprocess.Popen[str] | None = None
    log_path: Path | None = None

    @property
    def totals(self) -> str:
        """The devices' memory as NVML counts it: what the planner may use and what it keeps back."""
        return ",".join(str(total_bytes(g)) for g in self.gpus)

    def env(self) -> dict[str, str]:
        path = os.pathsep.join([str(NVML_DRIVER), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return {
            **os.environ,
            "PYTHONPATH": path,
            "STATEBUDGET_FAKE_NVML_DIR": str(self.driver_dir),
            "STATEBUDGET_FAKE_NVML_TOTALS": self.totals,
        }


@dataclass
class DemoCluster:
    """The service, the agents and their fake engines of one run, under `root`."""

    root: Path
    heartbeat_seconds: float = 0.5
    service: subprocess.Popen[str] | None = None
    url: str = ""
    nodes: dict[str, Node] = field(default_factory=dict)
    sb: StateBudgetClient | None = None

    # -- the service -------------------------------------------------------------

    def use_service(self, url: str) -> StateBudgetClient:
        """A planner someone else runs (e.g. `make run`), left running at the end."""
        self.url = url.rstrip("/")
        self.sb = StateBudgetClient(self.url, timeout_seconds=30)
        wait_for(lambda: self.sb is not None and self.sb.readyz().status == "ok", 60, f"the service at {url}")
        return self.sb

    def start_service(self) -> StateBudgetClient:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log = (self.root / "service.log").open("w")
        self.service = subprocess.Popen(
            [str(BIN / "statebudget"), "serve", "--demo", "--port", str(port), "--db", str(self.root / "sb.db")],
            env={**os.environ, **SERVICE_ENV},
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.sb = StateBudgetClient(self.url, timeout_seconds=30)
        wait_for(lambda: self.sb is not None and self.sb.readyz().status == "ok", 60, "the service")
        return self.sb

    # -- the nodes ---------------------------------------------------------------

    def configure(self) -> None:
        """An agent configuration per demo node: every model a managed fake vLLM on its own port."""
        cluster = _get(self.url, "/v1/cluster")
        models = {m["id"]: m["resolved"] for m in _get(self.url, "/v1/models")}
        ports = iter(engine_ports(len(cluster["nodes"]) * len(models), random.Random()))
        for raw in cluster["nodes"]:
            node_id = raw["id"]
            base = self.root / node_id
            driver_dir, state_dir = base / "driver", base / "state"
            driver_dir.mkdir(parents=True, exist_ok=True)
            state_dir.mkdir(parents=True, exist_ok=True)
            fixed = {e["model"]: e["gpus"] for e in raw.get("engines") or [] if e.get("gpus")}
            gpus = [{"id": g["id"], "type": g["type"], "device": i} for i, g in enumerate(raw["gpus"])]
            engines = {}
            for model, sizes in models.items():
                port = next(ports)
                command = [
                    sys.executable,
                    str(RUN_VLLM),
                    "--port",
                    "{port}",
                    "--model",
                    "{model}",
                    "--precision",
                    "{precision}",
                    *(a for p, n in sizes["weights_bytes"].items() for a in ("--weights-bytes", f"{p}={n}")),
                    "--experts-bytes",
                    str(sizes.get("experts_bytes") or 0),
                    "--gpu-expert-fraction",
                    "{gpu_expert_fraction}",
                    "--kv-pool-bytes",
                    "{kv_pool_bytes_per_gpu}",
                    "--context-bytes",
                    str(CONTEXT_BYTES),
                    "--driver-dir",
                    str(driver_dir),
                ]
                checkpoint = base / "checkpoints" / model  # what a read-ahead advises into the page cache
                checkpoint.mkdir(parents=True, exist_ok=True)
                (checkpoint / "model.safetensors").write_bytes(bytes(CHECKPOINT_BYTES))
                engines[model] = {
                    "url": f"http://127.0.0.1:{port}",
                    "model_path": str(checkpoint),
                    "precision": sizes["precisions"][0],
                    "features": FEATURES,
                    "management": "managed",
                    "launch": {
                        "command": command,
                        "env": {"VLLM_SERVER_DEV_MODE": "1"},
                        "port": port,
                        "ready_timeout_seconds": 60,
                        "stop_timeout_seconds": 10,
                    },
                    "drain_timeout_seconds": 10,
                }
            config = {
                "server_url": self.url,
                "node_id": node_id,
                "executor": "vllm",
                "gpus": gpus,
                "engines": engines,
                "engine_gpus": fixed,
                "engine_state_dir": str(state_dir),
                "heartbeat_seconds": self.heartbeat_seconds,
                "lease_wait_seconds": 1,
                "max_parallel": 8,
                "retry_delay_seconds": 0.2,
                "shutdown_grace_seconds": 15,
            }
            path = base / "agent.yaml"
            path.write_text(yaml.safe_dump(config, sort_keys=False))
            self.nodes[node_id] = Node(node_id, raw["gpus"], path, driver_dir, state_dir, config)

    def start_confirmed_engines(self) -> list[str]:
        """Start the engines the confirmed state runs or keeps asleep, as the agent would: a short-lived
        process uses the agent's own process manager (which writes the launch records the agents find) and
        exits, so that the engines are nobody's children, as after an agent's restart."""
        srv = _get(self.url, "/v1/srv")
        experts = {m["id"]: m["resolved"].get("experts_bytes") or 0 for m in _get(self.url, "/v1/models")}
        pools = _launched_pools()
        launches = []
        for row in _get(self.url, "/v1/engines"):
            if row["state"] == "stopped" or not row["gpus"]:
                continue
            node = self.nodes[row["node"]]
            values = {
                "precision": row["precision"],
                "tp": len(row["gpus"]),
                "kv_pool_bytes_per_gpu": pools[(row["node"], row["model"])],
                "gpu_expert_fraction": _expert_fraction(srv, row, experts[row["model"]]),
                "max_context_tokens": "",
            }
            launches.append({"config": node.config, "env": node.env(), "row": row, "values": values, "id": row["id"]})
        spec = self.root / "launches.json"
        spec.write_text(json.dumps(launches))
        subprocess.run([sys.executable, __file__, "--launch", str(spec)], check=True, timeout=120)
        return [f"{launch['id']} ({launch['row']['state']})" for launch in launches]

    def start_agents(self) -> None:
        for node in self.nodes.values():
            self.start_agent(node)

    def start_agent(self, node: Node) -> subprocess.Popen[str]:
        node.log_path = self.root / node.id / "agent.log"
        log = node.log_path.open("a")
        node.agent = subprocess.Popen(
            [str(BIN / "statebudget-agent"), "run", "--config", str(node.config_path), "--log-level", "info"],
            env=node.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        return node.agent

    # -- traffic -----------------------------------------------------------------

    def replay(self, records: list[TraceRecord], hour_seconds: float, *, batch_seconds: float = 0.25) -> int:
        """Post the trace's records as events, its time scaled so that an hour lasts `hour_seconds`."""
        assert self.sb is not None
        scale = hour_seconds / 3600.0
        events = [_event(i, r) for i, r in enumerate(records)]
        started = time.monotonic()
        sent = 0
        while sent < len(events):
            now = (time.monotonic() - started) / scale
            due = next((i for i in range(sent, len(events)) if records[i].t > now), len(events))
            if due > sent:
                self.sb.post_events(*events[sent:due])
                sent = due
            time.sleep(batch_seconds)
        return sent

    def get(self, path: str) -> Any:
        return _get(self.url, path)

    def processes(self, node: str) -> list[dict[str, Any]]:
        """The node's living fake engine processes: pid, model, level, bytes per device, LMCache instance id."""
        return _driver_state(self.nodes[node])[2]

    def leased(self, node: str) -> list[dict[str, Any]]:
        return [o for o in _get(self.url, "/v1/operations?state=leased") if o["node"] == node]

    def settle(
        self, timeout_seconds: float, quiet_seconds: float = 3.0, stall_seconds: float = 90.0, max_plans: int = 60
    ) -> float:
        """Wait until nothing is queued or leased and neither the plan nor the SRV moved for `quiet_seconds`
        (an operation leased and done between two looks is seen by the SRV version it bumped; the engines'
        reported states are compared only once no operation runs). Returns the seconds it waited.

        It waits on the service, not on a wall-clock budget: while operations end, start or are replanned it
        keeps waiting, up to `timeout_seconds` in all; it gives up sooner when nothing at all changed for
        `stall_seconds` with operations open (an operation nobody carries out), or when the service installed
        more than `max_plans` plans meanwhile (plans that undo each other: a settle takes a handful)."""
        started = time.monotonic()
        quiet_since: float | None = None
        changed_at = started
        seen: tuple[Any, ...] | None = None
        first_epoch: int | None = None
        while (now := time.monotonic()) - started < timeout_seconds:
            ready = _get(self.url, "/readyz")
            open_ops = _get(self.url, "/v1/operations?state=queued") + _get(self.url, "/v1/operations?state=leased")
            look = (ready["epoch"], ready["srv_version"], sorted((o["id"], o["state"]) for o in open_ops))
            first_epoch = ready["epoch"] if first_epoch is None else first_epoch
            if ready["epoch"] - first_epoch > max_plans:
                moves = sorted({f"{o['node']} {o['action']} {o['object'].get('model')}" for o in open_ops})
                raise TimeoutError(
                    f"plans still changing: {ready['epoch'] - first_epoch} plans in {now - started:.0f} s; open: {moves}"
                )
            if look != seen:
                seen, changed_at, quiet_since = look, now, None
            elif open_ops:
                quiet_since = None
                if now - changed_at >= stall_seconds:
                    raise TimeoutError(f"operations open and nothing changed for {stall_seconds:g} s: {look[2]}")
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= quiet_seconds:
                return now - started
            time.sleep(0.3)
        raise TimeoutError(f"operations still open, or plans still changing, after {timeout_seconds:g} s")

    # -- the end -----------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        ops = [o for state in OP_STATES for o in _get(self.url, f"/v1/operations?state={state}")]
        plan = _get(self.url, "/v1/plan")
        srv = _get(self.url, "/v1/srv")
        cluster = {n["id"]: n for n in _get(self.url, "/v1/cluster")["nodes"]}
        problems: list[str] = []
        states = Counter(o["state"] for o in ops)
        failed = [{"id": o["id"], "error": o.get("error")} for o in ops if o["state"] == "failed"]
        if failed:
            problems.append(f"{len(failed)} operation(s) failed")
        if states.get("queued") or states.get("leased"):
            problems.append(f"operations still open: {dict(states)}")
        if plan.get("held_back"):
            problems.append(f"{len(plan['held_back'])} move(s) held back")
        placed: dict[str, int] = defaultdict(int)  # GPU -> weights and experts bytes the SRV places there
        for entry in srv["placement"]:
            loc = entry["location"]
            if loc["tier"] == "gpu" and entry["object"]["kind"] in ("weights", "experts"):
                placed[loc["gpu"]] += entry["bytes"]
        gpus: dict[str, dict[str, Any]] = {}
        fakes: list[dict[str, Any]] = []
        for node in self.nodes.values():
            held, shards, records = _driver_state(node)
            fakes += records
            problems += _heartbeat_recent(node.id, cluster[node.id].get("last_heartbeat"), self.heartbeat_seconds)
            telemetry = cluster[node.id].get("telemetry") or {}
            beats = {g["id"]: g for g in telemetry.get("gpus", [])}
            engine_bytes: dict[str, int] = defaultdict(int)  # GPU -> context and KV pools of the reported engines
            for reported in telemetry.get("instances", []):
                inst, state = reported["instance"], reported["state"]
                for g in inst["gpus"]:
                    if state == "running":
                        engine_bytes[g] += CONTEXT_BYTES + inst["kv_pool_bytes_per_gpu"]
                    elif state != "stopped":
                        engine_bytes[g] += CONTEXT_BYTES
            problems += _instances_agree(node, telemetry.get("instances", []), records)
            for i, gpu in enumerate(node.gpus):
                gid = gpu["id"]
                row = {
                    "nvml_used_bytes": held.get(i, 0),
                    "srv_weights_experts_bytes": placed.get(gid, 0),
                    "reported_engines_bytes": engine_bytes.get(gid, 0),
                    "fake_shard_bytes": shards.get(i, 0),
                    "heartbeat_used_bytes": beats.get(gid, {}).get("used_bytes"),
                    "heartbeat_total_bytes": beats.get(gid, {}).get("total_bytes"),
                }
                gpus[gid] = row
                expected = row["srv_weights_experts_bytes"] + row["reported_engines_bytes"]
                if abs(row["nvml_used_bytes"] - expected) > ROUNDING_BYTES:
                    problems.append(
                        f"{gid}: NVML shows {row['nvml_used_bytes']} bytes in use; the SRV's weights and experts "
                        f"there ({row['srv_weights_experts_bytes']}) and the contexts and KV pools of the engines "
                        f"the node reports ({row['reported_engines_bytes']}) make {expected}"
                    )
                if abs(row["srv_weights_experts_bytes"] - row["fake_shard_bytes"]) > ROUNDING_BYTES:
                    problems.append(
                        f"{gid}: the SRV places {row['srv_weights_experts_bytes']} bytes of weights and experts, "
                        f"the engines hold {row['fake_shard_bytes']}"
                    )
                if row["heartbeat_used_bytes"] != row["nvml_used_bytes"]:
                    problems.append(
                        f"{gid}: the last heartbeat said {row['heartbeat_used_bytes']} bytes in use, "
                        f"NVML shows {row['nvml_used_bytes']}"
                    )
                if row["heartbeat_total_bytes"] != total_bytes(gpu):
                    problems.append(f"{gid}: the last heartbeat's total_bytes is {row['heartbeat_total_bytes']}")
        ids = [f["lmcache_instance_id"] for f in fakes]
        if None in ids or len(set(ids)) != len(ids):
            problems.append(f"LMCache instance ids are not one per engine: {ids}")
        reconcile = {
            n: {k: (c.get("reconcile") or {}).get(k) for k in ("lost", "corrected")} for n, c in cluster.items()
        }
        for n, r in reconcile.items():
            if r["lost"]:
                problems.append(f"{n} lost state: {r['lost']}")
        return {
            "operations": {"by_state": dict(states), "failed": failed, "held_back": len(plan.get("held_back", []))},
            "gpus": gpus,
            "engines": fakes,
            "reconcile": reconcile,
            "problems": problems,
        }

    def stop(self) -> None:
        for node in self.nodes.values():
            if node.agent is not None and node.agent.poll() is None:
                node.agent.send_signal(signal.SIGTERM)
        for node in self.nodes.values():
            if node.agent is not None:
                try:
                    node.agent.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    node.agent.kill()
        for node in self.nodes.values():  # the engines outlive their agents: stop them by their launch records
            for record in node.state_dir.glob("*.pid"):
                with contextlib.suppress(OSError, ValueError, KeyError):
                    pid = int(json.loads(record.read_text())["pid"])
                    os.killpg(pid, signal.SIGTERM)
        if self.service is not None and self.service.poll() is None:
            self.service.send_signal(signal.SIGTERM)
            try:
                self.service.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.service.kill()


def _get(url: str, path: str) -> Any:
    import httpx

    response = httpx.get(url + path, timeout=30)
    response.raise_for_status()
    return response.json()


def _expert_fraction(srv: dict[str, Any], row: dict[str, Any], total: int) -> float:
    """The share of the model's routed experts the confirmed state places on the instance's GPUs."""
    on_gpus = sum(
        e["bytes"]
        for e in srv["placement"]
        if e["object"]["kind"] == "experts"
        and e["object"]["model"] == row["model"]
        and e["location"]["tier"] == "gpu"
        and e["location"]["gpu"] in row["gpus"]
    )
    return min(on_gpus / total, 1.0) if total else 1.0


def _launched_pools() -> dict[tuple[str, str], int]:
    """(node, model) -> the KV pool per GPU the demo's confirmed engines were launched with, as the service
    takes them before any heartbeat reports one: a running engine's by the launch rule over the KV it holds
    (engine_holdings.launched_pools), a sleeping one's the least its engine starts with (one request of the model's
    maximum context: vLLM refuses a smaller pool, vllm/v1/core/kv_cache_utils.py
    `check_enough_kv_cache_memory`). Not `GET /v1/engines`' pool, which is the one the plan in force would
    launch (0 for an engine it stops)."""
    from planner_service.domain.problem import compile_problem
    from planner_service.planner import engine_holdings, engine_instances

    problem = compile_problem(demo_scenario(), {})
    states = engine_instances.confirmed_states(problem)
    running = engine_holdings.launched_pools(problem, states)
    return {
        key: running.get(key) or engine_holdings.min_pool_bytes_per_gpu(problem, view.model, max(len(view.gpus), 1))
        for key, view in states.items()
    }


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _driver_state(node: Node) -> tuple[dict[int, int], dict[int, int], list[dict[str, Any]]]:
    """Per device: the bytes living fake engines hold, and their weight shards; and each engine's record."""
    held: dict[int, int] = defaultdict(int)
    shards: dict[int, int] = defaultdict(int)
    records = []
    for path in sorted(node.driver_dir.glob("*.json")):
        record = json.loads(path.read_text())
        if not _alive(int(record["pid"])):
            continue
        records.append({k: record[k] for k in ("pid", "model", "level", "gpu_bytes", "lmcache_instance_id")})
        for device, n in record["gpu_bytes"].items():
            held[int(device)] += n
            if record["level"] == 0:
                shards[int(device)] += record["shard_bytes"]
    return held, shards, records


def _heartbeat_recent(node: str, last: str | None, heartbeat_seconds: float) -> list[str]:
    """Whether the service accepted one of the node's heartbeats lately: a refused heartbeat (422) leaves the
    node's telemetry at the last one accepted, which says nothing of what happened since."""
    if last is None:
        return [f"{node}: the service has accepted no heartbeat"]
    age = time.time() - datetime.fromisoformat(last).timestamp()  # 3.11 reads the Z
    limit = max(10.0, 10 * heartbeat_seconds)  # far above the period: a loaded machine delays a heartbeat or two
    return [f"{node}: the service accepted no heartbeat for {age:.1f} s (last at {last})"] if age > limit else []


_LEVEL_STATES = {0: {"running"}, 1: {"asleep_host", "asleep_discarded"}, 2: {"asleep_discarded"}}


def _instances_agree(node: Node, reported: list[dict[str, Any]], records: list[dict[str, Any]]) -> list[str]:
    """Each living fake engine is reported in the state it is in, on the GPUs it holds; no other is reported
    anything but stopped."""
    problems = []
    devices = {g["id"]: i for i, g in enumerate(node.gpus)}
    by_model = {r["instance"]["model"]: r for r in reported}
    alive = {r["model"] for r in records}
    for record in records:
        seen = by_model.get(record["model"])
        if seen is None:
            problems.append(f"{node.id}: {record['model']} runs (level {record['level']}) but is not reported")
            continue
        on = sorted(devices[g] for g in seen["instance"]["gpus"])
        if seen["state"] not in _LEVEL_STATES[record["level"]] or on != sorted(int(d) for d in record["gpu_bytes"]):
            problems.append(
                f"{node.id}: {record['model']} is at level {record['level']} on devices {sorted(record['gpu_bytes'])}, "
                f"reported {seen['state']} on {seen['instance']['gpus']}"
            )
    for model, seen in by_model.items():
        if model not in alive and seen["state"] != "stopped":
            problems.append(f"{node.id}: {model} is reported {seen['state']} but no engine process runs")
    return problems


def _event(i: int, record: TraceRecord) -> dict[str, Any]:
    if isinstance(record, TraceEnd):
        return {"id": f"h{i}", "type": "session_end", "session": record.session}
    event = {
        "id": f"h{i}",
        "type": "request",
        "session": record.session,
        "model": record.model,
        "slo": record.slo.value,
        "input_tokens": record.input_tokens,
        "output_tokens": record.output_tokens,
    }
    return {**event, "user": record.user} if record.user else event


def hour_trace(seed: int) -> list[TraceRecord]:
    """An hour of the demo team's traffic (planner_service/sim/synth.py, its defaults but the length)."""
    params = SynthParams(hours=1.0, arrival_spread_seconds=300.0, departure_spread_seconds=300.0)
    return synth_trace(demo_scenario(), params, np.random.default_rng(seed))


@contextlib.contextmanager
def demo_cluster(root: Path, *, heartbeat_seconds: float = 0.5, server: str | None = None) -> Iterator[DemoCluster]:
    cluster = DemoCluster(root, heartbeat_seconds=heartbeat_seconds)
    try:
        if server is None:
            cluster.start_service()
        else:
            cluster.use_service(server)
        cluster.configure()
        yield cluster
    finally:
        cluster.stop()


def run(
    root: Path, *, hour_seconds: float, seed: int, settle_seconds: float = 300.0, server: str | None = None
) -> dict[str, Any]:
    records = hour_trace(seed)
    started = time.monotonic()
    with demo_cluster(root, server=server) as cluster:
        engines = cluster.start_confirmed_engines()
        cluster.start_agents()
        sent = cluster.replay(records, hour_seconds)
        settled = cluster.settle(settle_seconds)
        time.sleep(3 * cluster.heartbeat_seconds)  # a heartbeat taken after the last operation
        report = cluster.report()
    report["run"] = {
        "events": sent,
        "hour_seconds": hour_seconds,
        "seed": seed,
        "engines_at_start": engines,
        "settle_seconds": round(settled, 1),
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    return report


def launch(spec_path: Path) -> None:
    """Start the engines `spec_path` lists through the agent's process manager, put the asleep ones to sleep."""
    import asyncio

    import httpx

    from clients.agent.config import AgentConfig
    from clients.agent.executors.vllm import VLLMExecutor

    async def one(item: dict[str, Any]) -> None:
        config = AgentConfig.model_validate(item["config"])
        handle = VLLMExecutor.from_config(config).engines_by_model[item["row"]["model"]]
        assert handle.process is not None
        os.environ.update(item["env"])  # the engine inherits the node's fake NVML
        devices = config.gpu_devices()
        async with httpx.AsyncClient() as http:
            await handle.process.start(
                http, handle.url, devices=[devices[g] for g in item["row"]["gpus"]], **item["values"]
            )
            state = item["row"]["state"]
            if state != "running":  # asleep in the confirmed state: level 1 keeps the weights in host RAM
                level = 1 if state == "asleep_host" else 2
                (await http.post(f"{handle.url}/sleep", params={"level": level, "mode": "wait"})).raise_for_status()

    for item in json.loads(spec_path.read_text()):
        asyncio.run(one(item))


def main() -> None:
    if sys.argv[1:2] == ["--launch"]:
        launch(Path(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hour-seconds", type=float, default=30.0, help="Wall seconds the hour of events takes.")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=None, help="Where the run's files go (default: a temp dir).")
    parser.add_argument("--out", type=Path, default=None, help="Write the report (JSON) here.")
    parser.add_argument(
        "--server", default=None, help="A planner running the demo already (e.g. `make run`'s) instead of a new one."
    )
    parser.add_argument(
        "--settle-seconds",
        type=float,
        default=300.0,
        help="How long the operations may take to end after the hour, at most (DemoCluster.settle).",
    )
    args = parser.parse_args()
    import tempfile

    root = args.dir or Path(tempfile.mkdtemp(prefix="statebudget-demo-cluster-"))
    root.mkdir(parents=True, exist_ok=True)
    report = run(
        root, hour_seconds=args.hour_seconds, seed=args.seed, settle_seconds=args.settle_seconds, server=args.server
    )
    text = json.dumps(report, indent=2)
    if args.out is not None:
        args.out.write_text(text)
    print(text)
    print(f"files: {root}", file=sys.stderr)
    sys.exit(1 if report["problems"] else 0)


if __name__ == "__main__":
    main()
