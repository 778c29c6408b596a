"""Tiny hand-built clusters for the planner's unit tests.

Sizes are explicit (GiB, bytes per token) instead of presets, so each test
can state its arithmetic. Builders return plain scenario dicts, the same
shape as a scenario file.
"""

from __future__ import annotations

from typing import Any

from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.problem import Problem
from planner_service.domain.scenario import parse_scenario
from planner_service.domain.units import GIB, KIB
from planner_service.planner.plan import Plan
from planner_service.solver.registry import solve

H2D_BYTES_PER_S = 20e9
BF16_FLOPS = 100e12
KV_BYTES_PER_TOKEN = 128 * KIB  # 8,192 tokens of history = 1 GiB of KV


def gpu(gpu_id: str, hbm_gib: float) -> dict[str, Any]:
    return {
        "id": gpu_id,
        "hbm_bytes": int(hbm_gib * GIB),
        "hbm_bytes_per_s": 1e12,
        "bf16_flops": BF16_FLOPS,
        "h2d_bytes_per_s": H2D_BYTES_PER_S,
    }


def node(
    node_id: str, *gpus: dict[str, Any], host_gib: float = 256, capabilities: list[str] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": node_id,
        "host_dram_bytes": int(host_gib * GIB),
        "nvme_bytes": 4096 * GIB,
        "gpus": list(gpus),
    }
    if capabilities is not None:
        out["capabilities"] = capabilities
    return out


def model(model_id: str, weights_gib: float | dict[str, float], **extra: Any) -> dict[str, Any]:
    """A dense model (or a MoE with `experts_bytes`/`expert_bytes` in `extra`); one precision unless a dict is given."""
    sizes = weights_gib if isinstance(weights_gib, dict) else {"bf16": weights_gib}
    return {
        "id": model_id,
        "precisions": list(sizes),
        "weights_bytes": {p: int(g * GIB) for p, g in sizes.items()},
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        **extra,
    }


def session(
    session_id: str,
    model_id: str,
    *,
    user: str = "u",
    slo: str = "interactive",
    active: bool = False,
    tokens: int = 8192,
) -> dict[str, Any]:
    return {"id": session_id, "user": user, "slo": slo, "model": model_id, "active": active, "context_tokens": tokens}


def weights(model_id: str, precision: str = "bf16") -> dict[str, Any]:
    return {"kind": "weights", "model": model_id, "precision": precision}


def kv(model_id: str, session_id: str) -> dict[str, Any]:
    return {"kind": "kv", "model": model_id, "session": session_id}


def experts(model_id: str) -> dict[str, Any]:
    return {"kind": "experts", "model": model_id}


def on_gpu(gpu_id: str) -> dict[str, str]:
    return {"tier": "gpu", "gpu": gpu_id}


def on_host(node_id: str) -> dict[str, str]:
    return {"tier": "host", "node": node_id}


def on_nvme(node_id: str) -> dict[str, str]:
    return {"tier": "nvme", "node": node_id}


def held(obj: dict[str, Any], location: dict[str, str], nbytes: int) -> dict[str, Any]:
    return {"object": obj, "location": location, "bytes": int(nbytes)}


def scenario(nodes: list, models: list, sessions: list = (), residency: list = (), **extra: Any) -> dict[str, Any]:
    return {
        "cluster": {"nodes": list(nodes)},
        "models": list(models),
        "sessions": list(sessions),
        "residency": list(residency),
        **extra,
    }


def plan_for(data: dict[str, Any]) -> tuple[Problem, Plan]:
    problem = problem_from_scenario(parse_scenario(data))
    return problem, solve(problem)
