"""Random valid scenarios of a given size, for benchmarks, property tests and gap studies.

Nodes hold four GPUs of one preset type; models cycle through the model
presets; every node keeps every checkpoint on NVMe (so any node can load any
model); some models start warm on GPUs and some sessions' KV sits in host
DRAM. The confirmed residency always fits its capacities.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from planner_service.domain.engines import EngineConstants, EngineKind
from planner_service.domain.hardware import gpu_preset
from planner_service.domain.model_presets import MODEL_PRESETS
from planner_service.domain.problem import resolve_model
from planner_service.domain.scenario import ModelIn, Scenario, parse_scenario
from planner_service.domain.units import GIB

GPU_TYPES = ("rtx-3090", "rtx-4090", "a100-40gb-pcie", "a100-80gb-pcie", "l40", "l40s")
SLOS = ("blocking", "interactive", "background")
GPUS_PER_NODE = 4


def random_scenario(
    rng: np.random.Generator,
    gpus: int,
    models: int,
    sessions: int,
    *,
    active_fraction: float = 0.2,
    max_context_tokens: int = 64_000,
    gpu_types: tuple[str, ...] = GPU_TYPES,
    presets: tuple[str, ...] | None = None,
) -> Scenario:
    presets = presets or tuple(sorted(MODEL_PRESETS))
    n_nodes = max(1, math.ceil(gpus / GPUS_PER_NODE))
    nodes: list[dict[str, Any]] = []
    free: dict[str, int] = {}
    node_gpus: dict[str, list[str]] = {}
    for n in range(n_nodes):
        kind = str(rng.choice(gpu_types))
        count = min(GPUS_PER_NODE, gpus - n * GPUS_PER_NODE)
        node_id = f"n{n}"
        ids = [f"{node_id}-g{i}" for i in range(count)]
        nodes.append(
            {
                "id": node_id,
                "host_dram_bytes": int(rng.choice([256, 512, 1024])) * GIB,
                "nvme_bytes": 16 * 10**12,
                "gpus": [{"id": g, "type": kind, "reserved_bytes": 2 * GIB} for g in ids],
            }
        )
        cap = gpu_preset(kind).hbm_bytes - 2 * GIB
        free.update({g: cap for g in ids})
        node_gpus[node_id] = ids

    model_specs = []
    model_json = []
    for i in range(models):
        preset = presets[i % len(presets)]
        precisions = list(MODEL_PRESETS[preset].default_precisions[: int(rng.integers(1, 3))])
        entry = {"id": f"m{i}-{preset}", "preset": preset, "precisions": precisions}
        model_json.append(entry)
        model_specs.append(resolve_model(ModelIn.model_validate(entry), f"models[{i}]"))

    residency: list[dict[str, Any]] = []

    def put(obj: dict[str, Any], loc: dict[str, str], nbytes: int) -> None:
        residency.append({"object": obj, "location": loc, "bytes": int(nbytes)})

    host_free = {n["id"]: n["host_dram_bytes"] for n in nodes}
    for node_json in nodes:
        for m in model_specs:
            for p in m.precisions:
                put(
                    {"kind": "weights", "model": m.id, "precision": p},
                    {"tier": "nvme", "node": node_json["id"]},
                    m.weights_bytes[p],
                )
            if m.is_moe:
                put({"kind": "experts", "model": m.id}, {"tier": "nvme", "node": node_json["id"]}, m.experts_bytes)

    # some models warm on one GPU (or host) of a random node
    warm: dict[str, tuple[str, str]] = {}
    for m in model_specs:
        node = nodes[int(rng.integers(len(nodes)))]["id"]
        nbytes = m.weights_bytes[m.preferred]
        roll = rng.random()
        if roll < 0.4:
            gpu = max(node_gpus[node], key=lambda g: free[g])
            if free[gpu] >= nbytes:
                free[gpu] -= nbytes
                put({"kind": "weights", "model": m.id, "precision": m.preferred}, {"tier": "gpu", "gpu": gpu}, nbytes)
                warm[m.id] = (node, gpu)
        elif roll < 0.6 and host_free[node] >= nbytes:
            host_free[node] -= nbytes
            put({"kind": "weights", "model": m.id, "precision": m.preferred}, {"tier": "host", "node": node}, nbytes)

    session_json = []
    users = max(1, sessions // 3)
    for s in range(sessions):
        m = model_specs[int(rng.integers(len(model_specs)))]
        tokens = int(rng.integers(500, max_context_tokens))
        sid = f"s{s}"
        session_json.append(
            {
                "id": sid,
                "user": f"u{int(rng.integers(users))}",
                "slo": str(rng.choice(SLOS)),
                "model": m.id,
                "active": bool(rng.random() < active_fraction),
                "context_tokens": tokens,
            }
        )
        kv_bytes = tokens * m.kv_bytes_per_token
        if m.id in warm and rng.random() < 0.5:
            node, gpu = warm[m.id]
            if free[gpu] >= kv_bytes:
                free[gpu] -= kv_bytes
                put({"kind": "kv", "model": m.id, "session": sid}, {"tier": "gpu", "gpu": gpu}, kv_bytes)
                continue
        if rng.random() < 0.3:
            node = warm.get(m.id, (nodes[int(rng.integers(len(nodes)))]["id"], ""))[0]
            if host_free[node] >= kv_bytes:
                host_free[node] -= kv_bytes
                put({"kind": "kv", "model": m.id, "session": sid}, {"tier": "host", "node": node}, kv_bytes)

    return parse_scenario(
        {"cluster": {"nodes": nodes}, "models": model_json, "sessions": session_json, "residency": residency}
    )


def leave_context_room(data: dict[str, Any]) -> None:
    """Evict, newest first, the GPU KV on a card whose vLLM / SGLang engines lack room for their CUDA contexts
    (one each, `engines.holdings`), in a scenario's JSON whose nodes were given engines after it was drawn:
    the engines could not have admitted that KV, and a current state no engine can be in leaves no sound plan."""
    runtime = {EngineKind.VLLM.value, EngineKind.SGLANG.value}
    context = EngineConstants().context_bytes_per_gpu
    gpus = {g["id"]: (node, g) for node in data["cluster"]["nodes"] for g in node["gpus"]}
    on_gpu: dict[str, list[dict[str, Any]]] = {}
    for row in data["residency"]:
        if row["location"]["tier"] == "gpu":
            on_gpu.setdefault(row["location"]["gpu"], []).append(row)
    for gpu_id, rows in sorted(on_gpu.items()):
        node, gpu = gpus[gpu_id]
        served = {e["model"] for e in node.get("engines", []) if e["kind"] in runtime}
        engines = sum(1 for r in rows if r["object"]["kind"] == "weights" and r["object"]["model"] in served)
        if not engines:
            continue
        capacity = gpu_preset(gpu["type"]).hbm_bytes - gpu["reserved_bytes"]
        excess = sum(r["bytes"] for r in rows) + engines * context - capacity
        for row in reversed([r for r in rows if r["object"]["kind"] == "kv"]):
            if excess <= 0:
                break
            data["residency"].remove(row)
            excess -= row["bytes"]
