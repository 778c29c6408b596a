"""`statebudget replay` end to end on a small trace: table, JSON report, three PNG plots."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from rich.console import Console
from typer.testing import CliRunner

from planner_service.cli import app, replay_tables
from planner_service.domain.demo import demo_scenario
from planner_service.sim.report import TABLE_COLUMNS
from planner_service.sim.trace import TraceRequest, write_trace


def small_trace(path: Path) -> Path:
    rng = np.random.default_rng(7)
    models = [m.id for m in demo_scenario().models]
    records = [
        TraceRequest(
            t=float(8 * i),
            session=f"s{i % 3}",
            model=str(rng.choice(models)),
            input_tokens=int(rng.integers(100, 2000)),
            output_tokens=int(rng.integers(0, 100)),
        )
        for i in range(15)
    ]
    write_trace(path, records)
    return path


def test_replay_writes_json_and_plots(tmp_path: Path) -> None:
    trace = small_trace(tmp_path / "t.jsonl")
    out = tmp_path / "r.json"
    result = CliRunner().invoke(
        app,
        [
            "replay",
            "--trace",
            str(trace),
            "--policies",
            "statebudget,static,lru,oracle",
            "--json",
            str(out),
            "--plots",
            str(tmp_path / "plots"),
            "--seed",
            "3",
        ],
    )
    assert result.exit_code == 0, result.output
    # the table: a row per metric, a column per policy, whole at the test terminal's 80 columns
    assert "replay of" in result.output and "…" not in result.output
    assert "hand-off P95 s" in result.output and "degraded precision" in result.output
    assert "hand-off card wait P95 s" in result.output
    header = next(line for line in result.output.splitlines() if "policy" in line)
    assert all(name in header for name in ("statebudget", "static", "lru", "oracle"))
    report = json.loads(out.read_text())
    assert report["trace"]["requests"] == 15 and report["trace"]["sessions"] == 3
    assert report["scenario"]["gpus"] == 16
    for name in ("statebudget", "static", "lru", "oracle"):
        m = report["policies"][name]
        assert m["requests"] == 15
        assert set(m["switch_latency_seconds"]) == {"all", "handoff", "stay"}
        assert set(m["switch_latency_seconds"]["handoff"]) == {"p50", "p95", "p99", "mean"}
        assert set(m["ttft_seconds"]) == {"p50", "p95", "p99"}
        assert m["completion_seconds"]["p95"] >= m["ttft_seconds"]["p95"]
        assert set(m["completion_seconds_by_model"]) <= {
            "planner",
            "coder",
            "reasoner",
            "air",
            "summarizer",
            "vision",
            "longctx",
        }
        assert set(m["slo_violation_rate"]) == {"blocking", "interactive", "background", "all"}
        assert 0.0 <= m["degraded_precision_rate"] <= 1.0
        assert {"mean", "peak"} <= set(m["gpu_bytes"])
        assert "mean" in m["warm_idle_gpu_bytes"]
        assert {"bytes_moved", "operations", "planner_seconds"} <= set(m)
        assert m["capacity_or_bandwidth_violations"] == 0
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == ["comparison.png", "gpu_memory.png", "switch_latency_cdf.png"]
    assert all((tmp_path / "plots" / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)


def test_replay_rejects_an_unknown_policy(tmp_path: Path) -> None:
    trace = small_trace(tmp_path / "t.jsonl")
    result = CliRunner().invoke(app, ["replay", "--trace", str(trace), "--policies", "lru,psychic"])
    assert result.exit_code == 2
    assert "choose one of" in result.output


def test_replay_runs_a_scenario_whose_nodes_declare_engines(tmp_path: Path) -> None:
    trace = small_trace(tmp_path / "t.jsonl")
    data = demo_scenario().model_dump(mode="json")
    data["cluster"]["nodes"][1]["engines"] = [
        {"model": "coder", "gpus": ["n2-g0", "n2-g1"], "kind": "vllm", "features": ["sleep_mode", "dev_mode"]}
    ]
    scenario = tmp_path / "fixed.json"
    scenario.write_text(json.dumps(data))
    result = CliRunner().invoke(
        app, ["replay", "--trace", str(trace), "--scenario", str(scenario), "--policies", "lru"]
    )
    assert result.exit_code == 0, result.output


def test_the_replay_table_splits_by_width_and_never_folds_a_figure() -> None:
    names = [
        "statebudget",
        "static",
        "lru",
        "independent",
        "static-nokv",
        "lru-nokv",
        "sleep-router",
        "swap-ttl",
        "oracle",
        "clairvoyant",
    ]
    rows = [[name, *(f"{1000 + k}{i}.25" for k in range(len(TABLE_COLUMNS) - 1))] for i, name in enumerate(names)]
    console = Console(width=80, file=io.StringIO(), record=True)
    tables = replay_tables(TABLE_COLUMNS, rows, "replay", console.width)
    for table in tables:
        console.print(table)
    text = console.export_text()
    assert len(tables) > 1 and max(map(len, text.splitlines())) <= 80
    assert "…" not in text
    for row in rows:
        assert row[0] in text and all(figure in text for figure in row[1:])


def test_replay_runs_behind_the_gateway_and_reports_its_warm_ups(tmp_path: Path) -> None:
    trace = small_trace(tmp_path / "t.jsonl")
    out = tmp_path / "r.json"
    args = ["replay", "--trace", str(trace), "--policies", "sleep-router", "--gateway", "affinity+warmups"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["gateway"] == "affinity+warmups"
    assert report["policies"]["sleep-router"]["gateway"]["mode"] == "affinity+warmups"
    assert {"warmups_started", "warmups_used", "warmups_cancelled"} <= set(
        report["policies"]["sleep-router"]["gateway"]
    )
    wrong = CliRunner().invoke(app, ["replay", "--trace", str(trace), "--policies", "lru", "--gateway", "psychic"])
    assert wrong.exit_code == 2 and "--gateway" in wrong.output


def test_replay_runs_replicas_behind_the_gateway_and_refuses_a_bad_count(tmp_path: Path) -> None:
    trace = small_trace(tmp_path / "t.jsonl")
    out = tmp_path / "r.json"
    args = ["replay", "--trace", str(trace), "--policies", "lru", "--gateway", "affinity", "--replicas", "coder=2"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["replicas"] == {"coder": 2}
    assert report["policies"]["lru"]["gateway"]["routed"] == sum(
        1 for line in trace.read_text().splitlines() if '"coder"' in line
    )
    for bad, says in (("coder=0", "--replicas"), ("coder", "--replicas"), ("poet=2", "'poet' is not a model")):
        wrong = CliRunner().invoke(app, ["replay", "--trace", str(trace), "--policies", "lru", "--replicas", bad])
        assert wrong.exit_code == 2 and says in wrong.output, (bad, wrong.output)
