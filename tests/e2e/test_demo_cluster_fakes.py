"""The demo cluster on contract fakes (tests/fakes/demo_cluster.py): `statebudget serve --demo`, a real
`statebudget-agent` per demo node driving managed fake vLLM processes, a fake NVML following them.

Over a replayed hour of events every operation ends done (or superseded by a newer plan before a node leased
it): none failed, none left open, no move held back; on every GPU the SRV's weights and experts are the
shards the fake engines hold, and NVML shows those plus the contexts and KV pools of the engines the node
reports; every heartbeat's GPU bytes are what NVML shows; every engine process is reported in the state it is
in, one process and one LMCache instance id per engine; no node lost state; the service accepts every node's
heartbeats to the end (`DemoCluster.report`'s `problems`, each asserted empty). A SIGKILLed agent restarted
reconciles, starts nothing twice and leaves the same clean end; an engine that crashes is reported stopped,
the service takes its model off its GPUs and the planner brings it back, and the end is clean.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from fakes.demo_cluster import ROUNDING_BYTES, DemoCluster, demo_cluster, hour_trace, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

# the most the cluster may take to have nothing open and no new plan for 3 s (about 15 s alone): settling waits
# on the service's operations and SRV, not on the clock, and fails sooner when nothing changes for 90 s
SETTLE_SECONDS = 300.0
AGENT_PROBLEMS = ("heartbeat", "reported", "not reported", "LMCache", "no engine process runs")


def agent_problems(report: dict[str, Any]) -> list[str]:
    return [p for p in report["problems"] if any(word in p for word in AGENT_PROBLEMS)]


def one_process_per_engine(report: dict[str, Any]) -> None:
    ids = Counter(e["lmcache_instance_id"] for e in report["engines"])
    assert all(n == 1 for n in ids.values()), ids


def assert_clean(report: dict[str, Any], root: Path) -> None:
    """Every operation done or superseded, none failed, open or held back; on every GPU the SRV's weights and
    experts are the fake engines' shards and NVML's bytes those plus the reported engines' contexts and pools
    (to the report's rounding); and no other disagreement. The report stays beside the run's logs, in `root`."""
    (root / "report.json").write_text(json.dumps(report, indent=1))
    ops = report["operations"]
    assert ops["failed"] == [] and ops["held_back"] == 0, ops
    assert set(ops["by_state"]) <= {"done", "superseded"}, ops["by_state"]
    for gpu, g in report["gpus"].items():
        assert abs(g["srv_weights_experts_bytes"] - g["fake_shard_bytes"]) <= ROUNDING_BYTES, (gpu, g)
        expected = g["srv_weights_experts_bytes"] + g["reported_engines_bytes"]
        assert abs(g["nvml_used_bytes"] - expected) <= ROUNDING_BYTES, (gpu, g)
    assert report["problems"] == []
    one_process_per_engine(report)


def run_hour(cluster: DemoCluster, hour_seconds: float) -> int:
    cluster.start_confirmed_engines()
    cluster.start_agents()
    return cluster.replay(hour_trace(seed=1), hour_seconds)


# Each run's report.json stays beside its logs.
def test_an_hour_of_demo_traffic_through_agents_and_fake_engines(tmp_path: Path) -> None:
    with demo_cluster(tmp_path) as cluster:
        sent = run_hour(cluster, hour_seconds=20.0)
        cluster.settle(SETTLE_SECONDS)
        time.sleep(3 * cluster.heartbeat_seconds)
        report = cluster.report()
    assert sent > 500 and report["operations"]["by_state"].get("done", 0) > 0  # how many: as often as plans change
    assert all(g["heartbeat_total_bytes"] for g in report["gpus"].values())
    assert_clean(report, tmp_path)


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
    assert agent_problems(report) == []
    assert_clean(report, tmp_path)  # one process per engine: the restarted agent started none twice


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
    # seen dead either by its exit or, when the probe comes while the kill is still landing, by its closed port
    assert log is not None
    assert any(
        f"vllm-{model}: was running, is stopped ({how}: " in log.read_text() for how in ("crashed", "unreachable")
    )
    assert agent_problems(report) == []  # stopped while it was dead, its new process reported as it runs
    back = [e for e in report["engines"] if e["model"] == model and e["level"] == 0]
    assert replanned and back and all(e["pid"] != victim["pid"] for e in back), report["engines"]
    assert_clean(report, tmp_path)
