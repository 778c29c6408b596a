"""The State Residency Vector: how much of each model's state sits on each tier.

For model m, state kind s and tier t:

    bytes[m,s,t]    = sum of the bytes of m's objects of kind s held at tier t (all devices, all nodes)
    fraction[m,s,t] = min(1, resident / full)

where, per kind,
    weights  resident / full = max over precisions p of  bytes(weights(m,p) at t) / size(weights(m,p))
             (a model is as resident as its most resident precision)
    experts  bytes(experts(m) at t) / size(experts(m))      (all routed experts)
    kv       sum over sessions of bytes(kv(m,s) at t) / sum over those sessions of context * kv_bytes_per_token

Several full copies (e.g. one per node's NVMe) still count as fraction 1.
The per-device detail is the placement itself, except on engine nodes (vLLM, SGLang): there a running
engine holds no more KV on a GPU than its launched pool (engines.kv_held_in_pool), so the GPU KV counted
is at most that pool.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from planner_service.domain.engines import EngineState, kv_held_in_pool
from planner_service.domain.problem import Problem
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.planner.engine_holdings import kv_per_gpu, launched_pools
from planner_service.planner.engine_instances import instance_states


@dataclass(frozen=True, slots=True)
class SrvRow:
    """fraction[m,s,t] and bytes[m,s,t] of one model `m`, state kind `s` and tier `t`."""

    model: str
    state: Kind
    tier: Tier
    fraction: float
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "state": self.state.value,
            "tier": self.tier.value,
            "fraction": self.fraction,
            "bytes": self.bytes,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SrvRow:
        return cls(
            str(data["model"]), Kind(data["state"]), Tier(data["tier"]), float(data["fraction"]), int(data["bytes"])
        )


def srv_rows(problem: Problem, placement: Mapping[tuple[StateObject, Location], int]) -> tuple[SrvRow, ...]:
    """The SRV, sorted, one row per (model, kind, tier) with bytes > 0."""
    held: dict[tuple[StateObject, Tier], int] = defaultdict(int)
    for (obj, loc), nbytes in placement.items():
        if nbytes > 0 and obj.model in problem.models:
            held[(obj, loc.tier)] += nbytes
    total_bytes: dict[tuple[str, Kind, Tier], int] = defaultdict(int)
    weight_fraction: dict[tuple[str, Tier], float] = defaultdict(float)
    kv_full: dict[tuple[str, Tier], int] = defaultdict(int)
    for (obj, tier), nbytes in held.items():
        total_bytes[(obj.model, obj.kind, tier)] += nbytes
        if obj.kind is Kind.WEIGHTS:
            size = problem.size_of(obj)
            share = nbytes / size if size else 1.0
            weight_fraction[(obj.model, tier)] = max(weight_fraction[(obj.model, tier)], share)
        elif obj.kind is Kind.KV and obj.session in problem.sessions:
            kv_full[(obj.model, tier)] += problem.size_of(obj)
    for (model, _), beyond in kv_beyond_pools(problem, placement).items():
        total_bytes[(model, Kind.KV, Tier.GPU)] -= beyond
    rows = []
    for (model, kind, tier), nbytes in sorted(total_bytes.items()):
        if nbytes <= 0:
            continue
        if kind is Kind.WEIGHTS:
            fraction = weight_fraction[(model, tier)]
        elif kind is Kind.EXPERTS:
            size = problem.models[model].experts_bytes
            fraction = nbytes / size if size else 1.0
        else:
            full = kv_full[(model, tier)]
            fraction = nbytes / full if full else 1.0
        rows.append(SrvRow(model, kind, tier, round(min(1.0, fraction), 6), int(nbytes)))
    return tuple(rows)


def kv_beyond_pools(
    problem: Problem, placement: Mapping[tuple[StateObject, Location], int]
) -> dict[tuple[str, str], int]:
    """(model, GPU) -> the KV bytes the placement puts on a GPU of a running engine beyond that engine's pool."""
    states = instance_states(problem, placement, problem.observed_engines)
    if not states:
        return {}
    running = {key: view for key, view in states.items() if view.state is EngineState.RUNNING}
    on = kv_per_gpu(placement)
    pools = launched_pools(problem, running, on)  # reported, else the launch rule over this placement
    out: dict[tuple[str, str], int] = {}
    for key, view in running.items():
        pool = pools.get(key)
        if pool is None:
            continue
        for g in view.gpus:
            held = on.get((view.model, g), 0)
            if held > kv_held_in_pool(pool, held):
                out[(view.model, g)] = held - kv_held_in_pool(pool, held)
    return out
