"""The gap study's engine scenarios are states engines can be in, so a sound plan exists for each."""

from __future__ import annotations

import pytest
from support import greedy_gap_plan

from planner_service.domain.engines import EngineKind
from planner_service.domain.predictions import problem_from_scenario
from planner_service.domain.state import Kind, Tier
from planner_service.planner.engine_costs import ENGINE_CONSTANTS
from planner_service.solver.gap import random_scenarios

RUNTIME = {EngineKind.VLLM, EngineKind.SGLANG}


def test_every_running_engine_has_room_for_its_cuda_context() -> None:
    for _, scenario in random_scenarios(50, 1, 16, 7, 100, engines=True):
        problem = problem_from_scenario(scenario)
        served = {(n.id, e.model) for n in scenario.cluster.nodes for e in n.engines if e.kind in RUNTIME}
        used: dict[str, int] = {}
        engines_on: dict[str, int] = {}
        for (obj, loc), nbytes in problem.residency.items():
            if loc.tier is Tier.GPU:
                used[loc.id] = used.get(loc.id, 0) + nbytes
                if obj.kind is Kind.WEIGHTS and (problem.gpus[loc.id].node, obj.model) in served:
                    engines_on[loc.id] = engines_on.get(loc.id, 0) + 1
        for gpu, count in engines_on.items():
            assert used[gpu] + count * ENGINE_CONSTANTS.context_bytes_per_gpu <= problem.gpus[gpu].capacity_bytes


@pytest.mark.parametrize("seed", [12, 40])  # seeds whose first draw filled an engine's card to the last GiB
def test_the_greedy_plan_is_sound_where_the_draw_filled_an_engine_card(seed: int) -> None:
    greedy_gap_plan(seed, engines=True)  # checked sound
