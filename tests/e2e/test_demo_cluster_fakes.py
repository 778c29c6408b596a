"""The demo cluster on contract fakes (tests/fakes/demo_cluster.py): `statebudget serve --demo`, a real
`statebudget-agent` per demo node driving managed fake vLLM processes, a fake NVML following them.

What the agents answer for is asserted: every heartbeat's GPU bytes are what NVML shows, with its total;
every engine process is reported in the state it is in, on the GPUs it holds; one process per engine and one
LMCache instance id each; a SIGKILLed agent restarted reconciles, starts nothing twice, and its heartbeats
tell the service where the SRV holds more than the GPUs do; an engine that crashes is reported stopped, the
service takes its model off its GPUs and the planner brings it back; the service accepts every node's heartbeats
to the end. What the planner's plans get wrong is printed, not asserted: operations that fail because a plan
does not fit the GPUs (a fake engine's start runs out of memory), and where the SRV and the engines disagree at
the end (on a GPU, the SRV's weights and experts against the fake engines' shards and NVML's bytes; the KV the
SRV counts beyond a running engine's fixed pool, which the service records as state the node lost). Most runs
have none of the first and agree on weights and experts, not all (clients/README.md, "The demo cluster on
contract fakes").
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from fakes.demo_cluster import DemoCluster, demo_cluster, hour_trace, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

# how long the cluster may take to have nothing open and no new plan for 3 s: about 30 s alone, longer when the
# suite's other worker shares the two cores
SETTLE_SECONDS = 180.0
AGENT_PROBLEMS = ("heartbeat", "reported", "not reported", "LMCache", "no engine process runs")


def agent_problems(report: dict[str, Any]) -> list[str]:
    return [p for p in report["problems"] if any(word in p for word in AGENT_PROBLEMS)]


def one_process_per_engine(report: dict[str, Any]) -> None:
    ids = Counter(e["lmcache_instance_id"] for e in report["engines"])
    assert all(n == 1 for n in ids.values()), ids


def run_hour(cluster: DemoCluster, hour_seconds: float) -> int:
    cluster.start_confirmed_engines()
    cluster.start_agents()
    return cluster.replay(hour_trace(seed=1), hour_seconds)


def test_an_hour_of_demo_traffic_through_agents_and_fake_engines(tmp_path: Path) -> None:
    with demo_cluster(tmp_path) as cluster:
        sent = run_hour(cluster, hour_seconds=20.0)
        cluster.settle(SETTLE_SECONDS)
        time.sleep(3 * cluster.heartbeat_seconds)
        report = cluster.report()
    print(report["operations"], report["problems"])  # the run's findings, beside the assertions
    assert sent > 500 and report["operations"]["by_state"].get("done", 0) > 50
    assert agent_problems(report) == []
    one_process_per_engine(report)
    assert all(g["heartbeat_total_bytes"] for g in report["gpus"].values())


def test_a_sigkilled_agent_restarts_reconciles_and_double_applies_nothing(tmp_path: Path) -> None:
    with demo_cluster(tmp_path) as cluster:
        cluster.start_confirmed_engines()
        cluster.start_agents()
        node = cluster.nodes["n1"]  # the first plan moves the reasoner there (a restart, or a sleep)
        deadline = time.monotonic() + 60
        leased: list[dict[str, Any]] = []
        while time.monotonic() < deadline and not (leased := cluster.leased("n1")):
            time.sleep(0.05)
        assert leased, "n1 leased nothing"  # (asked once: a sleep is done before a second look)
        assert node.agent is not None
        node.agent.send_signal(signal.SIGKILL)  # mid-operation
        node.agent.wait(timeout=10)
        cluster.start_agent(node)  # it remembers nothing: the launch records and the engines tell it
        cluster.replay(hour_trace(seed=2)[:200], 5.0)
        cluster.settle(SETTLE_SECONDS)
        time.sleep(3 * cluster.heartbeat_seconds)
        report = cluster.report()
    print(report["operations"], report["problems"])
    assert agent_problems(report) == []
    one_process_per_engine(report)
    # where the SRV still disagrees with the engines on n1 (a plan that did not fit: the engine's start ran out
    # of memory), the restarted agent's heartbeats told the service: it records the state lost there
    lost = {entry["gpu"] for entry in report["reconcile"]["n1"]["lost"] or []}
    differ = {
        gpu
        for gpu, g in report["gpus"].items()
        if gpu.startswith("n1-") and g["srv_weights_experts_bytes"] > g["nvml_used_bytes"]
    }
    assert differ <= lost, (differ, lost)


def test_an_engine_crash_is_reported_corrected_and_replanned_around(tmp_path: Path) -> None:
    with demo_cluster(tmp_path) as cluster:
        cluster.start_confirmed_engines()
        cluster.start_agents()
        cluster.replay(hour_trace(seed=3)[:300], 5.0)
        cluster.settle(SETTLE_SECONDS)
        running = [(n, r) for n in cluster.nodes for r in cluster.processes(n) if r["level"] == 0]
        assert running, "no engine runs after the traffic"
        node, victim = running[0]
        model, epoch = victim["model"], cluster.get("/v1/plan")["epoch"]
        os.kill(victim["pid"], signal.SIGKILL)

        def corrected() -> list[dict[str, Any]]:
            (raw,) = [n for n in cluster.get("/v1/cluster")["nodes"] if n["id"] == node]
            return [c for c in (raw["reconcile"] or {}).get("corrected") or [] if c["object"]["model"] == model]

        wait_for(corrected, 30, "the service to take the crashed engine's model off its GPUs")
        assert all("reported stopped" in c["why"] for c in corrected())
        assert cluster.sb is not None
        cluster.sb.post_events(  # sessions keep asking for the model
            *(
                {"id": f"after-crash-{i}", "type": "request", "session": f"after-crash-{i}", "model": model}
                | {"slo": "interactive", "input_tokens": 2000, "output_tokens": 200}
                for i in range(3)
            )
        )
        cluster.settle(SETTLE_SECONDS)
        time.sleep(3 * cluster.heartbeat_seconds)
        replanned = cluster.get("/v1/plan")["epoch"] > epoch
        report = cluster.report()
        log = cluster.nodes[node].log_path
    print(model, report["operations"], report["problems"])
    # seen dead either by its exit or, when the probe comes while the kill is still landing, by its closed port
    assert log is not None
    assert any(
        f"vllm-{model}: was running, is stopped ({how}: " in log.read_text() for how in ("crashed", "unreachable")
    )
    assert agent_problems(report) == []  # stopped while it was dead, its new process reported as it runs
    back = [e for e in report["engines"] if e["model"] == model and e["level"] == 0]
    assert replanned and back and all(e["pid"] != victim["pid"] for e in back), report["engines"]
