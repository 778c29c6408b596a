"""`statebudget study h1|h3|pareto` on a small case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner_service.cli import app
from planner_service.domain.demo import demo_scenario
from planner_service.domain.scenario import parse_scenario
from planner_service.sim.studies import study_h1, study_h3, study_pareto
from planner_service.sim.trace import TraceEnd, TraceRequest, write_trace


def trace():
    return [
        TraceRequest(t=0.0, session="s1", model="coder", input_tokens=10_000, output_tokens=1000),
        TraceRequest(t=10.0, session="s2", model="planner", input_tokens=4000, output_tokens=0),
        TraceRequest(t=20.0, session="s1", model="reasoner", input_tokens=1000, output_tokens=0),
        TraceEnd(t=30.0, session="s2", event="end"),
        TraceRequest(t=40.0, session="s1", model="coder", input_tokens=1000, output_tokens=0),
    ]


def test_h1_pooling_never_needs_more_than_per_model_pools(tmp_path: Path) -> None:
    result = study_h1(demo_scenario(), trace(), tmp_path)
    data = result.data
    assert data["pooling_gain"] >= 1.0
    assert data["pooled_peak_bytes"] <= data["sum_of_peaks_bytes"]
    # a session's KV on its model is its whole history including the current turn:
    # coder at 40 s: 11000 + 1000 + 1000 tokens * 262144 B; planner: 4000 * 131072 B
    assert data["per_model_peak_kv_bytes"]["coder"] == 13_000 * 262_144
    assert data["per_model_peak_kv_bytes"]["planner"] == 4000 * 131_072
    assert result.plot.read_bytes()[:4] == b"\x89PNG"


GB = 10**9


def tiny(hbm_bytes: int) -> dict:
    """One GPU of `hbm_bytes`, three 4 GB models (a, b, c) on a 0.5 GB/s NVMe, 1000 KV bytes a token."""
    model = {"weights_bytes": {"bf16": 4 * GB}, "kv_bytes_per_token": 1000, "active_params": 250_000_000}
    gpu = {"id": "g0", "hbm_bytes": hbm_bytes, "hbm_bytes_per_s": 1000 * GB, "bf16_flops": 1e12, "h2d_bytes_per_s": GB}
    return {
        "cluster": {"nodes": [{"id": "n1", "nvme_read_bytes_per_s": 0.5 * GB, "gpus": [gpu]}]},
        "models": [{"id": m, **model} for m in ("a", "b", "c")],
        "residency": [
            {
                "object": {"kind": "weights", "model": m, "precision": "bf16"},
                "location": {"tier": "nvme", "node": "n1"},
                "bytes": 4 * GB,
            }
            for m in ("a", "b", "c")
        ],
    }


def tiny_trace():
    """a is asked twice, b once, c never: the warm order is a, b, c. KV (1000 B a token): s1 1.0 GB on b,
    s2 0.5 and s3 0.1 GB on a; both models hold it all at t=2 (1.6 GB); s1 ends, then s4 adds 2 GB on a."""
    return [
        TraceRequest(t=0.0, session="s1", model="b", input_tokens=1_000_000, output_tokens=0),
        TraceRequest(t=1.0, session="s2", model="a", input_tokens=400_000, output_tokens=100_000),
        TraceRequest(t=2.0, session="s3", model="a", input_tokens=100_000, output_tokens=0),
        TraceEnd(t=3.0, session="s1", event="end"),
        TraceRequest(t=4.0, session="s4", model="a", input_tokens=2_000_000, output_tokens=0),
    ]


def h3_rows(hbm: int) -> list[dict]:
    """By hand: weights 4, 8, 12 GB as a, b, c are warmed; the warm models' peak KV is 2.6 GB each time (a
    alone: s2 + s3 + s4 at t=4; a + b: 1.6 GB at t=2 but 2.6 GB at t=4, s1 gone; c adds none); the next
    model's cold load is a cold start of its engine: 4 GB over the 0.5 GB/s NVMe (below the 1 GB/s PCIe) +
    cold_start_fixed_seconds (30 s, domain/engines.py) = 38 s."""
    peaks = [int(2.6 * GB)] * 3
    return [
        {
            "warm_models": k,
            "added": added,
            "weights_bytes": 4 * GB * k,
            "peak_kv_bytes": peaks[k - 1],
            "free_bytes": hbm - 4 * GB * k - peaks[k - 1],
            "next_model": nxt,
            "next_cold_load_seconds": 38.0 if nxt else None,
        }
        for k, added, nxt in ((1, "a", "b"), (2, "b", "c"), (3, "c", None))
    ]


@pytest.mark.parametrize(
    ("hbm", "killer"),
    [
        pytest.param(11 * GB, "weights", id="11GB: c's weights (12 GB) outgrow it, KV fits until then"),
        pytest.param(10 * GB, "kv", id="10GB: a and b fit (8 GB) but not with their 2.6 GB of KV"),
        pytest.param(15 * GB, None, id="15GB: all three and their KV fit"),
    ],
)
def test_h3_names_the_first_killer(tmp_path: Path, hbm: int, killer: str | None) -> None:
    result = study_h3(parse_scenario(tiny(hbm)), tiny_trace(), tmp_path)
    assert result.data["hbm_bytes"] == hbm
    assert result.data["rows"] == h3_rows(hbm)
    assert result.data["first_killer"] == killer
    assert result.plot.read_bytes()[:4] == b"\x89PNG"


def test_h3_on_the_demo_warms_the_most_requested_model_first(tmp_path: Path) -> None:
    result = study_h3(demo_scenario(), trace(), tmp_path)
    assert [r["added"] for r in result.data["rows"]][:3] == ["coder", "planner", "reasoner"]  # 2, 1, 1 requests
    weights = [r["weights_bytes"] for r in result.data["rows"]]
    assert weights == sorted(weights) and len(weights) == len(demo_scenario().models)
    hbm = result.data["hbm_bytes"]
    first = next(r for r in result.data["rows"] if r["weights_bytes"] > hbm or r["free_bytes"] < 0)
    assert result.data["first_killer"] == ("weights" if first["weights_bytes"] > hbm else "kv")


def test_h1_pooling_gain_on_a_hand_worked_trace(tmp_path: Path) -> None:
    data = study_h1(parse_scenario(tiny(10 * GB)), tiny_trace(), tmp_path).data
    # a peaks at 2.6 GB (s2, s3, s4 at t=4), b at 1.0 GB (s1); together they never hold more than 2.6 GB
    assert data["per_model_peak_kv_bytes"] == {"a": int(2.6 * GB), "b": GB, "c": 0}
    assert data["sum_of_peaks_bytes"] == int(3.6 * GB)
    assert data["pooled_peak_bytes"] == int(2.6 * GB)
    assert data["pooling_gain"] == round(3.6 / 2.6, 4)


def test_pareto_trades_gpu_bytes_for_latency(tmp_path: Path) -> None:
    result = study_pareto(demo_scenario(), trace(), tmp_path, prices=(0.0, 5.0))
    cheap, dear = result.data["points"]
    assert cheap["gpu_bytes_mean"] >= dear["gpu_bytes_mean"]
    assert result.plot.read_bytes()[:4] == b"\x89PNG"


def test_study_cli_prints_the_study_as_json_and_as_a_table(tmp_path: Path) -> None:
    trace_path, scenario_path = tmp_path / "t.jsonl", tmp_path / "tiny.json"
    write_trace(trace_path, tiny_trace())
    scenario_path.write_text(json.dumps(tiny(10 * GB)))
    runner = CliRunner()
    args = ["--trace", str(trace_path), "--scenario", str(scenario_path), "--out", str(tmp_path)]
    result = runner.invoke(app, ["study", "h3", *args, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"hbm_bytes": 10 * GB, "rows": h3_rows(10 * GB), "first_killer": "kv"}
    result = runner.invoke(app, ["study", "h1", *args, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["pooled_peak_bytes"] == int(2.6 * GB)
    assert (tmp_path / "h1.png").read_bytes()[:4] == (tmp_path / "h3.png").read_bytes()[:4] == b"\x89PNG"
    table = runner.invoke(app, ["study", "h3", *args])
    assert table.exit_code == 0, table.output
    text = " ".join(table.stdout.split())  # rich wraps long lines
    assert "first to run out: kv when warm model 2 (b) is added" in text
    assert "cluster HBM 9 GiB" in text  # 10 GB
