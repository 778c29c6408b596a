"""The nodes' records (registration, telemetry, reconcile status) are typed in memory and stored as the JSON
the `nodes` meta row has always held: a row in that form reads back as the views it describes, is written
back unchanged, and what a live service stores reads back as the same views after a restart."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from planner_service.service.engine import ClusterService
from planner_service.service.inputs import HeartbeatIn, RegisterIn
from planner_service.service.live import iso
from planner_service.service.nodes import NodeRecord, nodes_to_json
from planner_service.wire.enums import EngineState
from tests.service.test_service_heartbeat_reconcile import instance
from tests.service.test_service_reconcile import Clock, new_service

STOPPED_CODER = {
    "instance": {
        "features": [],
        "gpu_expert_fraction": 1.0,
        "gpus": ["n2-g0", "n2-g1"],
        "id": "coder@bf16@n2-g0+n2-g1",
        "kind": "vllm",
        "kv_pool_bytes_per_gpu": 4294967296,
        "kv_pool_tokens": 0,
        "management": "managed",
        "max_context_tokens": None,
        "model": "coder",
        "node": "n2",
        "precision": "bf16",
    },
    "state": "stopped",
}

# the `nodes` row as the service writes it (keys in the order it writes them): n1 registered at a
# test scale and found short on n1-g0; n2 registered two engines with URLs and a third without, reported its
# coder instance stopped, and one heartbeat saw the coder's weights gone (pending: the next one decides)
STORED_NODES_ROW: dict[str, Any] = {
    "n1": {
        "registration": {
            "capabilities": ["kv_offload", "weights_offload"],
            "gpus": [],
            "host_dram_bytes": None,
            "nvme_bytes": None,
            "engines": [],
            "agent_version": None,
            "scale": 1e-06,
        },
        "registered_at": "1970-01-01T00:16:40Z",
        "reconcile": {
            "checked_at": "1970-01-01T00:17:05Z",
            "lost": [{"gpu": "n1-g0", "confirmed_bytes": 17117648384, "used_bytes": 0, "missing_bytes": 17117648384}],
            "corrected": [],
            "pending": {"gpus": ["n1-g0"], "gone": []},
        },
        "telemetry": {
            "gpus": [
                {
                    "id": "n1-g0",
                    "used_bytes": 0,
                    "free_bytes": 1073741824,
                    "total_bytes": None,
                    "h2d_bytes_per_s": None,
                    "d2h_bytes_per_s": None,
                    "processes": [],
                }
            ],
            "nvme_read_bytes_per_s": None,
            "nvme_write_bytes_per_s": None,
            "engines": {},
            "instances": [],
            "expert_hit_rates": {},
        },
        "last_heartbeat": "1970-01-01T00:17:05Z",
    },
    "n2": {
        "registration": {
            "capabilities": None,
            "gpus": [
                {"id": "n2-g0", "type": "h100", "hbm_bytes": None},
                {"id": "n2-g1", "type": None, "hbm_bytes": None},
            ],
            "host_dram_bytes": 1099511627776,
            "nvme_bytes": None,
            "engines": [
                {
                    "name": "vllm-coder",
                    "kind": "vllm",
                    "models": ["coder"],
                    "url": "http://n2:8000",
                    "gpus": ["n2-g0", "n2-g1"],
                    "features": None,
                    "management": None,
                },
                {
                    "name": "vllm-air",
                    "kind": "vllm",
                    "models": ["air"],
                    "url": "http://n2:8001",
                    "gpus": [],
                    "features": None,
                    "management": None,
                },
                {
                    "name": "other",
                    "kind": "other",
                    "models": ["planner"],
                    "url": None,
                    "gpus": [],
                    "features": None,
                    "management": None,
                },
            ],
            "agent_version": "0.1.0",
            "scale": 1.0,
        },
        "registered_at": "1970-01-01T00:16:40Z",
        "reconcile": {
            "checked_at": "1970-01-01T00:16:45Z",
            "lost": [],
            "corrected": [
                {
                    "object": {"kind": "kv", "model": "coder", "session": "s01"},
                    "location": {"tier": "gpu", "gpu": "n2-g0"},
                    "bytes": 3145728000,
                    "why": "engine instance coder@bf16@n2-g0+n2-g1 reported stopped",
                    "at": "1970-01-01T00:16:30Z",
                }
            ],
            "pending": {
                "gpus": [],
                "gone": ["weights(coder, bf16)@gpu:n2-g0", "weights(coder, bf16)@gpu:n2-g1"],
            },
        },
        "telemetry": {
            "gpus": [
                {
                    "id": "n2-g2",
                    "used_bytes": 0,
                    "free_bytes": None,
                    "total_bytes": 85899345920,
                    "h2d_bytes_per_s": 20000000000.0,
                    "d2h_bytes_per_s": None,
                    "processes": [],
                }
            ],
            "nvme_read_bytes_per_s": 3000000000.0,
            "nvme_write_bytes_per_s": None,
            "engines": {"vllm-coder": "stopped"},
            "instances": [STOPPED_CODER],
            "expert_hit_rates": {"reasoner": 0.5},
        },
        "last_heartbeat": "1970-01-01T00:16:45Z",
    },
}


def stored_nodes_row(db: Path) -> Any:
    with sqlite3.connect(db) as conn:
        return json.loads(conn.execute("SELECT value FROM meta WHERE key = 'nodes'").fetchone()[0])


def write_nodes_row(db: Path, row: dict[str, Any]) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE meta SET value = ? WHERE key = 'nodes'", (json.dumps(row),))


def views(svc: ClusterService) -> dict[str, Any]:
    return {"cluster": svc.cluster_view(), "routes": svc.routes_view(), "calibration": svc.calibration_view()}


def test_a_stored_nodes_row_reads_back_as_the_views_it_describes(tmp_path):
    db, clock = tmp_path / "s.db", Clock()
    new_service(db, clock).close()
    write_nodes_row(db, STORED_NODES_ROW)
    svc = new_service(db, clock)
    try:
        nodes = {n["id"]: n for n in svc.cluster_view()["nodes"]}
        for node_id, stored in STORED_NODES_ROW.items():
            shown = nodes[node_id]
            assert shown["registered_at"] == stored["registered_at"]
            assert shown["last_heartbeat"] == stored["last_heartbeat"]
            assert shown["telemetry"] == stored["telemetry"]
            assert shown["reconcile"] == {k: v for k, v in stored["reconcile"].items() if k != "pending"}
        assert nodes["n3"]["registered_at"] is None and nodes["n3"]["telemetry"] is None
        assert nodes["n3"]["reconcile"] is None
        coder = next(e for e in nodes["n2"]["engines"] if e["model"] == "coder")
        assert coder["url"] == "http://n2:8000" and coder["gpus"] == ["n2-g0", "n2-g1"]
        assert [n["scale"] for n in svc.calibration_view()["nodes"]] == [1e-06, 1.0, 1.0, 1.0]

        routes = {m["model"]: m["instances"] for m in svc.routes_view()["models"]}
        assert routes["coder"] == [
            {
                "id": "coder@bf16@n2-g0+n2-g1",
                "node": "n2",
                "gpus": ["n2-g0", "n2-g1"],
                "state": "stopped",
                "url": "http://n2:8000",
                "engine": "vllm",
            }
        ]
        assert routes["air"] == [
            {
                "id": "n2/vllm-air",
                "node": "n2",
                "gpus": [],
                "state": "stopped",
                "url": "http://n2:8001",
                "engine": "vllm",
            }
        ]
        assert "planner" not in routes  # an engine registered without a URL routes nothing

        assert nodes_to_json(svc.live.node_records) == STORED_NODES_ROW  # the records store as they were read
        svc.heartbeat("n3", HeartbeatIn())
        row = stored_nodes_row(db)
        assert {k: row[k] for k in ("n1", "n2")} == STORED_NODES_ROW
        assert row["n3"] == {
            "reconcile": {"checked_at": iso(clock.t), "lost": [], "corrected": [], "pending": {"gpus": [], "gone": []}},
            "telemetry": HeartbeatIn().model_dump(mode="json"),
            "last_heartbeat": iso(clock.t),
        }
    finally:
        svc.close()


def test_a_pending_finding_read_back_counts_at_the_next_heartbeat(tmp_path):
    db, clock = tmp_path / "s.db", Clock()
    new_service(db, clock).close()
    write_nodes_row(db, STORED_NODES_ROW)
    svc = new_service(db, clock)
    try:
        on_gpu = {e["location"].get("gpu") for e in svc.srv_view()["placement"] if e["object"]["model"] == "coder"}
        assert {"n2-g0", "n2-g1"} <= on_gpu
        svc.heartbeat("n2", HeartbeatIn(instances=[instance(EngineState.STOPPED)]))
        corrected = svc.cluster_view()["nodes"][1]["reconcile"]["corrected"]
        assert [(c["object"]["kind"], c["location"]["gpu"]) for c in corrected] == [
            ("kv", "n2-g0"),  # the stored one
            ("weights", "n2-g0"),
            ("weights", "n2-g1"),
        ]
    finally:
        svc.close()


def test_what_a_service_stores_of_its_nodes_reads_back_as_the_same_views(tmp_path):
    db, clock = tmp_path / "s.db", Clock()
    svc = new_service(db, clock)
    registration = RegisterIn.model_validate(
        {
            "engines": [
                {
                    "name": "vllm-coder",
                    "kind": "vllm",
                    "models": ["coder"],
                    "url": "http://n2:8000",
                    "gpus": ["n2-g0", "n2-g1"],
                }
            ],
            "agent_version": "0.1.0",
        }
    )
    beat = HeartbeatIn.model_validate(
        {"gpus": [{"id": "n2-g0", "used_bytes": 0, "total_bytes": 80 << 30}], "instances": [STOPPED_CODER]}
    )
    try:
        svc.register_node("n2", registration)
        registered_at = iso(clock.t)
        for _ in range(2):
            clock.t += 5
            svc.heartbeat("n2", beat)
        before = views(svc)
    finally:
        svc.close()
    row = stored_nodes_row(db)
    assert row["n2"]["registration"] == registration.model_dump(mode="json")
    assert row["n2"]["registered_at"] == registered_at
    assert row["n2"]["telemetry"] == beat.model_dump(mode="json")
    assert row["n2"]["last_heartbeat"] == iso(clock.t)
    assert row["n2"]["reconcile"]["checked_at"] == iso(clock.t) and len(row["n2"]["reconcile"]["corrected"]) == 4
    assert set(row["n2"]) == {"registration", "registered_at", "telemetry", "last_heartbeat", "reconcile"}

    svc = new_service(db, clock)
    try:
        assert views(svc) == before
        assert svc.live.node_record("n2") == NodeRecord.from_json("n2", row["n2"])
    finally:
        svc.close()
