"""Tiny clusters for the MILP oracle's tests: explicit sizes, so each case states its arithmetic.

Builders return scenario dicts (the shape of a scenario file); `random_tiny`
draws a tiny valid scenario for the brute-force comparison.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.problem import Problem
from planner_service.domain.scenario import parse_scenario
from planner_service.domain.units import GIB, KIB

KV_BYTES_PER_TOKEN = 128 * KIB  # 8,192 tokens = 1 GiB of KV


def gpu(gpu_id: str, hbm_gib: float) -> dict[str, Any]:
    return {
        "id": gpu_id,
        "hbm_bytes": int(hbm_gib * GIB),
        "hbm_bytes_per_s": 1e12,
        "bf16_flops": 100e12,
        "h2d_bytes_per_s": 20e9,
    }


def node(node_id: str, *gpus: dict[str, Any], host_gib: float = 256) -> dict[str, Any]:
    return {"id": node_id, "host_dram_bytes": int(host_gib * GIB), "nvme_bytes": 4096 * GIB, "gpus": list(gpus)}


def model(model_id: str, sizes_gib: dict[str, float], **extra: Any) -> dict[str, Any]:
    return {
        "id": model_id,
        "precisions": list(sizes_gib),
        "weights_bytes": {p: int(g * GIB) for p, g in sizes_gib.items()},
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        **extra,
    }


def session(
    sid: str, model_id: str, *, slo: str = "interactive", active: bool = False, tokens: int = 8192, user: str = "u"
) -> dict[str, Any]:
    return {"id": sid, "user": user, "slo": slo, "model": model_id, "active": active, "context_tokens": tokens}


def held(obj: dict[str, Any], tier: str, where: str, nbytes: int) -> dict[str, Any]:
    location = {"tier": tier, "gpu": where} if tier == "gpu" else {"tier": tier, "node": where}
    return {"object": obj, "location": location, "bytes": int(nbytes)}


def weights(model_id: str, precision: str = "bf16") -> dict[str, Any]:
    return {"kind": "weights", "model": model_id, "precision": precision}


def kv(model_id: str, sid: str) -> dict[str, Any]:
    return {"kind": "kv", "model": model_id, "session": sid}


def experts(model_id: str) -> dict[str, Any]:
    return {"kind": "experts", "model": model_id}


def problem_of(nodes: list, models: list, sessions: list, residency: list) -> Problem:
    data = {"cluster": {"nodes": nodes}, "models": models, "sessions": sessions, "residency": residency}
    return problem_from_scenario(parse_scenario(data))


def random_tiny(rng: np.random.Generator, *, gpus: int = 2, models: int = 3, sessions: int = 4) -> Problem:
    """One node of `gpus` 24 GiB cards; dense models of 4-30 GiB on NVMe, some warm; a few sessions, some with KV."""
    cards = [gpu(f"g{i}", 24) for i in range(gpus)]
    free = {c["id"]: c["hbm_bytes"] for c in cards}
    host_free = 256 * GIB
    model_list, residency = [], []
    for i in range(models):
        size = float(rng.choice([4, 8, 14, 20, 30]))
        sizes = {"bf16": size, "int4": size / 4} if rng.random() < 0.4 else {"bf16": size}
        m = model(f"m{i}", sizes)
        model_list.append(m)
        for p, g in sizes.items():
            residency.append(held(weights(m["id"], p), "nvme", "n0", int(g * GIB)))
    warm: dict[str, str] = {}
    for m in model_list:
        nbytes = m["weights_bytes"]["bf16"]
        card = max(free, key=lambda g: free[g])
        if rng.random() < 0.5 and free[card] >= nbytes:
            free[card] -= nbytes
            residency.append(held(weights(m["id"]), "gpu", card, nbytes))
            warm[m["id"]] = card
        elif rng.random() < 0.3 and host_free >= nbytes:
            host_free -= nbytes
            residency.append(held(weights(m["id"]), "host", "n0", nbytes))
    session_list = []
    for s in range(sessions):
        m = model_list[int(rng.integers(len(model_list)))]
        tokens = int(rng.choice([2048, 8192, 24576]))
        sid = f"s{s}"
        session_list.append(
            session(
                sid,
                m["id"],
                slo=str(rng.choice(["blocking", "interactive", "background"])),
                active=bool(rng.random() < 0.4),
                tokens=tokens,
                user=f"u{s % 2}",
            )
        )
        nbytes = tokens * KV_BYTES_PER_TOKEN
        roll = rng.random()
        if m["id"] in warm and roll < 0.4 and free[warm[m["id"]]] >= nbytes:
            free[warm[m["id"]]] -= nbytes
            residency.append(held(kv(m["id"], sid), "gpu", warm[m["id"]], nbytes))
        elif roll < 0.7 and host_free >= nbytes:
            host_free -= nbytes
            residency.append(held(kv(m["id"], sid), "host", "n0", nbytes))
    return problem_of([node("n0", *cards)], model_list, session_list, residency)
