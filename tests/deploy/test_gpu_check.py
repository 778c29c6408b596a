"""deploy/gpu/check_vllm.py: without a GPU (or vllm) it says why and exits 0; its constants come from the steps."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "gpu" / "check_vllm.py"


def test_without_a_gpu_or_vllm_it_exits_0_saying_why(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if "no GPU check:" not in out.stdout:  # a machine with a GPU and vllm runs the real check
        return
    assert out.returncode == 0 and not (tmp_path / "r.json").exists()


def test_constants_come_from_the_measured_steps() -> None:
    spec = importlib.util.spec_from_file_location("check_vllm", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    steps = [
        {"transition": "start", "seconds": 40.0, "gpu_used_bytes_before": 100},
        {"transition": "sleep_level_1", "seconds": 0.5, "gpu_used_bytes_after": 600},
        {"transition": "wake_from_host", "seconds": 0.3},
        {"transition": "sleep_level_2", "seconds": 0.2},
        {"transition": "wake_with_reload", "seconds": 1.1},
        {"transition": "stop", "error": "boom"},
    ]
    assert module.constants(steps) == {
        "wake_fixed_seconds": 0.3,
        "reload_fixed_seconds": 0.8,
        "sleep_fixed_seconds": 0.2,
        "cold_start_fixed_seconds": 40.0,
        "context_bytes_per_gpu": 500,
    }
