"""Residency policies the simulator compares, registered by name (see `base.py`)."""

from __future__ import annotations

from planner_service.sim.policies.base import Policy, PolicyName, PolicyRegistry
from planner_service.sim.policies.clairvoyant import ClairvoyantPolicy
from planner_service.sim.policies.independent import IndependentPolicy
from planner_service.sim.policies.lru import LruNoKvPolicy, LruPolicy
from planner_service.sim.policies.oracle import OraclePolicy
from planner_service.sim.policies.sleep_router import SleepRouterPolicy
from planner_service.sim.policies.statebudget import StatebudgetGroupsPolicy, StatebudgetPolicy
from planner_service.sim.policies.static import StaticNoKvPolicy, StaticPolicy
from planner_service.sim.policies.static_tuned import StaticTunedPolicy
from planner_service.sim.policies.swap_ttl import SwapTtlPolicy

__all__ = ["Policy", "PolicyName", "PolicyRegistry", "create_policy", "default_registry"]


def default_registry() -> PolicyRegistry:
    registry = PolicyRegistry()
    registry.register(PolicyName.STATEBUDGET, StatebudgetPolicy)
    registry.register(PolicyName.STATEBUDGET_GROUPS, StatebudgetGroupsPolicy)
    registry.register(PolicyName.STATIC, StaticPolicy)
    registry.register(PolicyName.LRU, LruPolicy)
    registry.register(PolicyName.INDEPENDENT, IndependentPolicy)
    registry.register(PolicyName.STATIC_NOKV, StaticNoKvPolicy)
    registry.register(PolicyName.LRU_NOKV, LruNoKvPolicy)
    registry.register(PolicyName.SLEEP_ROUTER, SleepRouterPolicy)
    registry.register(PolicyName.SWAP_TTL, SwapTtlPolicy)
    registry.register(PolicyName.STATIC_TUNED, StaticTunedPolicy)
    registry.register(PolicyName.ORACLE, OraclePolicy)
    registry.register(PolicyName.CLAIRVOYANT, ClairvoyantPolicy)
    return registry


def create_policy(name: str, **options: object) -> Policy:
    return default_registry().create(name, **options)
