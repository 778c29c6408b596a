"""A scaled test run (`statebudget-agent run --executor local --scale 1e-6`, as clients/README shows) moves real
bytes at one millionth of their size: it times its own overheads, not the links. Its registration says so, and
the service calibrates nothing from it: its link figures after the run are the catalog's, sample by sample
refused."""

from __future__ import annotations

import pytest
from clients_helpers import async_client, make_app, served

from clients.agent.config import load_config
from clients.agent.executors.local import LocalExecutor
from clients.agent.runner import Agent
from planner_service.wire.enums import CalibrationScope

pytestmark = pytest.mark.anyio


def readme_config(tmp_path, node: str = "n1"):
    """The flags of clients/README's `statebudget-agent run` line, with this test's directories."""
    flags = {
        "server_url": "http://127.0.0.1:8080",
        "node_id": node,
        "executor": "local",
        "scale": 1e-6,
        "nvme_dir": tmp_path / node / "nvme",
        "host_dir": tmp_path / node / "host",
    }
    quick = {"lease_wait_seconds": 0.2, "heartbeat_seconds": 0.05, "retry_delay_seconds": 0.01}
    return load_config(None, {**flags, **quick})


async def test_a_scaled_run_calibrates_nothing(tmp_path):
    from test_agent_e2e import run_until_idle

    async with served(make_app(tmp_path)) as http:
        sb = async_client(http)
        cluster_before = await sb.get_cluster()
        # registered as the agent registers (a local executor: no engines), so the rules the plan follows on n2
        # are the same before and after the run
        await sb.register_node("n2", scale=1e-6)
        await sb.replan()
        first = await sb.get_plan()
        mine = [o for o in first.operations if o.node == "n2"]
        assert any(o.source is not None and o.source.tier == "nvme" for o in mine)  # NVMe reads: the link item 1 hit
        config = readme_config(tmp_path, "n2")
        agent = Agent(config, sb, LocalExecutor.from_config(config))
        await run_until_idle(agent, sb, "n2")
        assert agent.stats["done"] == len(mine) and agent.stats["heartbeats"] >= 1
        assert any(r.get("measured_seconds") for r in agent.reports)  # the reports did carry measurements

        calibration = await sb.get_calibration()
        n2 = next(n for n in calibration.nodes if n.id == "n2")
        assert n2.scale == 1e-6 and not n2.calibrates
        assert all(not n.calibrated and not any(g.calibrated for g in n.gpus) for n in calibration.nodes)
        after = await sb.get_cluster()
        assert [(n.nvme_read_bytes_per_s, [g.h2d_bytes_per_s for g in n.gpus]) for n in after.nodes] == [
            (n.nvme_read_bytes_per_s, [g.h2d_bytes_per_s for g in n.gpus]) for n in cluster_before.nodes
        ]
        samples_total = {
            outcome: float(line.split()[-1])
            for line in (await sb.metrics()).splitlines()
            for outcome in ("refused", "accepted")
            if line.startswith(f'statebudget_calibration_samples_total{{outcome="{outcome}"}}')
        }
        # every report of a copy between two tiers that measured a duration was a sample, and each was refused,
        # as were the heartbeats' (a copy too small to time at this scale reports 0 s and is no sample at all)
        by_id = {o.id: o for o in mine}
        samples = [
            r
            for r in agent.reports
            if (r.get("measured_seconds") or 0) > 0 and by_id[r["op"]].source and by_id[r["op"]].dest
        ]
        assert samples and samples_total.get("refused", 0) >= len(samples) and not samples_total.get("accepted")


async def test_an_operator_sees_and_resets_calibration_per_node_and_link(tmp_path):
    async with served(make_app(tmp_path)) as http:
        sb = async_client(http)
        catalog = next(n for n in (await sb.get_cluster()).nodes if n.id == "n1")
        gpu = catalog.gpus[0]
        beat = await sb.heartbeat(
            "n1",
            nvme_read_bytes_per_s=catalog.nvme_read_bytes_per_s / 2,
            nvme_write_bytes_per_s=catalog.nvme_write_bytes_per_s / 2,
            gpus=[{"id": gpu.id, "h2d_bytes_per_s": gpu.h2d_bytes_per_s / 2}],
        )
        assert set(beat.calibration) == {"nvme_read_bytes_per_s", "nvme_write_bytes_per_s"}
        n1 = (await sb.get_calibration(node="n1")).nodes
        assert [n.id for n in n1] == ["n1"] and n1[0].calibrates and n1[0].scale == 1.0
        assert set(n1[0].gpus[0].calibrated) == {"h2d_bytes_per_s"}
        learned = n1[0].calibrated["nvme_read_bytes_per_s"].value
        cluster = next(n for n in (await sb.get_cluster()).nodes if n.id == "n1")
        assert cluster.nvme_read_bytes_per_s == learned < catalog.nvme_read_bytes_per_s

        one = await sb.reset_calibration(CalibrationScope.NODES, "n1", "nvme_read_bytes_per_s")
        assert one.forgotten == 1 and set(one.nodes[0].calibrated) == {"nvme_write_bytes_per_s"}
        cluster = next(n for n in (await sb.get_cluster()).nodes if n.id == "n1")
        assert cluster.nvme_read_bytes_per_s == catalog.nvme_read_bytes_per_s  # the catalog figure plans again
        node = await sb.reset_calibration("nodes", "n1")  # the rest of the node, its GPUs with it
        assert node.forgotten == 2 and not node.nodes[0].calibrated and not node.nodes[0].gpus[0].calibrated
        assert (await sb.reset_calibration()).forgotten == 0
        cluster = next(n for n in (await sb.get_cluster()).nodes if n.id == "n1")
        assert cluster.gpus[0].h2d_bytes_per_s == gpu.h2d_bytes_per_s


async def test_a_scaled_node_calibrates_nothing_even_from_plausible_samples(tmp_path):
    """The range and outlier guards refuse the overheads that item 1 measured; a scaled run can also measure
    rates that look like a link's, and those must not count either: the scale alone decides."""
    async with served(make_app(tmp_path)) as http:
        sb = async_client(http)
        catalog = next(n for n in (await sb.get_cluster()).nodes if n.id == "n2")
        registered = await sb.register_node("n2", scale=1e-6)
        assert registered.scale == 1e-6 and any("scale 1e-06" in w for w in registered.warnings)
        plausible = catalog.nvme_read_bytes_per_s * 0.8
        beat = await sb.heartbeat("n2", nvme_read_bytes_per_s=plausible)
        assert beat.calibration == {}
        lease = await sb.lease("n2", max_operations=100)
        read = next(o for o in lease.operations if o.source is not None and o.source.tier == "nvme")
        await sb.report(
            read.id,
            lease_id=lease.lease_id,
            status="done",
            measured_seconds=read.bytes / plausible,
            measured_bytes=read.bytes,
        )
        assert not (await sb.get_calibration(node="n2")).nodes[0].calibrated

        assert (await sb.register_node("n2")).scale == 1.0  # a real agent registers again: its samples count
        beat = await sb.heartbeat("n2", nvme_read_bytes_per_s=plausible)
        assert beat.calibration["nvme_read_bytes_per_s"].samples == 1
        assert (await sb.get_calibration(node="n2")).nodes[0].calibrates
