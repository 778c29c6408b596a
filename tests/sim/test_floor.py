"""The hand-offs' re-prefill floor: hand-checked, and never beaten by a policy."""

from __future__ import annotations

import pytest
from test_engine import random_trace, tiny_scenario, tiny_trace

from planner_service.domain.demo import demo_scenario
from planner_service.sim.engine import base_problem, simulate
from planner_service.sim.floor import handoff_reprefill_floor
from planner_service.sim.policies import create_policy
from planner_service.sim.report import comparison, replay
from tests.sim.test_one_cost_model import tensor_parallel_scenario


def test_hand_checked_floor_of_the_tiny_trace() -> None:
    # b at 100 s has never seen the session: its 1000-token history at 1 ms/token; a at 200 s covers the
    # history up to its own turn (1000 tokens) and prefills b's 1000
    assert handoff_reprefill_floor(base_problem(tiny_scenario()), tiny_trace()) == pytest.approx([1.0, 1.0])


def test_the_floor_prices_the_all_reduce_and_the_attention() -> None:
    # test_one_cost_model's two cards: 6e-4 s a token on both (1e-3 on one), 1e-7 s an attention pair.
    # b at 100 s: 1000 tokens from the start, 0.6 s + 500,500 pairs (0.05005 s); a at 200 s: b's 1000 tokens
    # after the 1000 a's KV covers, 0.6 s + 1000 * 1000 + 500,500 pairs (0.15005 s)
    problem = base_problem(tensor_parallel_scenario())
    assert handoff_reprefill_floor(problem, tiny_trace()) == pytest.approx([0.65005, 0.75005], abs=1e-9)


def test_the_floor_prices_a_model_on_its_fastest_node() -> None:
    scenario = tiny_scenario().model_dump(mode="json")
    fast = {**scenario["cluster"]["nodes"][0], "id": "n2"}
    fast["gpus"] = [{**fast["gpus"][0], "id": "g9", "bf16_flops": 4e12}]  # 4 x the FLOP/s: 0.25 ms/token
    scenario["cluster"]["nodes"].append(fast)
    problem = base_problem(type(tiny_scenario()).model_validate(scenario))
    assert handoff_reprefill_floor(problem, tiny_trace()) == pytest.approx([0.25, 0.25])


@pytest.mark.parametrize("policy", ["statebudget", "static", "lru", "oracle"])
def test_no_policy_makes_a_hand_off_ready_faster_than_its_floor(policy: str) -> None:
    scenario = demo_scenario()
    records = random_trace([m.id for m in scenario.models], sessions=4, requests=40, seed=5)
    floors = handoff_reprefill_floor(base_problem(scenario), records)
    handoffs = [r for r in simulate(scenario, records, create_policy(policy)).requests if r.handoff]
    assert len(floors) == len(handoffs) > 5
    assert all(r.switch_seconds >= floor - 1e-9 for r, floor in zip(handoffs, floors, strict=True))
    assert any(floor > 0 for floor in floors)


def test_the_replay_report_carries_the_floor() -> None:
    report = replay(tiny_scenario(), tiny_trace(), ["statebudget", "static"]).report
    assert report["trace"]["handoff_reprefill_floor_seconds"] == pytest.approx(
        {"p50": 1.0, "p95": 1.0, "p99": 1.0, "mean": 1.0}
    )
    assert report["policies"]["static"]["switch_latency_seconds"]["handoff"]["p95"] == pytest.approx(1.0, abs=1e-3)
    assert comparison(report)["handoff_p95_vs_floor"] == pytest.approx(1.0, abs=1e-3)  # both at the floor here
