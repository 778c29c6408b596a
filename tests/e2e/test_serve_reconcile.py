"""`statebudget serve` as a real process: what a node's heartbeats correct in the confirmed state is
acknowledged only once committed, so a SIGKILL right after keeps it, and the lost state it recorded too."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_serve_crash import start

pytestmark = pytest.mark.slow

CODER = {
    "id": "coder@bf16@n2-g0+n2-g1",
    "node": "n2",
    "kind": "vllm",
    "model": "coder",
    "precision": "bf16",
    "gpus": ["n2-g0", "n2-g1"],
    "kv_pool_bytes_per_gpu": 4 << 30,
}


def on_gpus(srv: dict[str, Any], gpus: set[str]) -> list[dict[str, Any]]:
    return [e for e in srv["placement"] if e["location"].get("gpu") in gpus]


def test_a_reconcile_survives_sigkill(tmp_path: Path) -> None:
    db, log = tmp_path / "state.db", tmp_path / "serve.log"
    proc, client = start(db, log)
    try:
        assert on_gpus(client.get("/v1/srv").json(), {"n2-g0", "n2-g1"})
        stopped = {"instances": [{"instance": CODER, "state": "stopped"}]}
        empty_n1 = {"gpus": [{"id": "n1-g0", "used_bytes": 0, "total_bytes": 48 << 30}]}
        for _ in range(2):
            assert client.post("/v1/nodes/n2/heartbeat", json=stopped).status_code == 200
            assert client.post("/v1/nodes/n1/heartbeat", json=empty_n1).status_code == 200
        srv = client.get("/v1/srv").json()
        assert on_gpus(srv, {"n2-g0", "n2-g1"}) == []
        nodes = {n["id"]: n for n in client.get("/v1/cluster").json()["nodes"]}
        assert len(nodes["n2"]["reconcile"]["corrected"]) == 4
        assert [s["gpu"] for s in nodes["n1"]["reconcile"]["lost"]] == ["n1-g0"]
        metrics = client.get("/metrics").text
        assert 'statebudget_node_state_lost_total{gpu="n1-g0",node="n1"} 1.0' in metrics
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        client.close()

    proc, client = start(db, log)
    try:
        assert client.get("/v1/srv").json() == srv
        again = {n["id"]: n for n in client.get("/v1/cluster").json()["nodes"]}
        assert again["n2"]["reconcile"] == nodes["n2"]["reconcile"]
        assert again["n1"]["reconcile"] == nodes["n1"]["reconcile"]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        client.close()
