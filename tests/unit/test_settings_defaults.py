"""The service's planning defaults are the simulator's: a replay measures the rules the service runs.

`settings.py` imports nothing of the planner (any layer that takes a `Settings` can import it without
loading the planner), so these defaults are written on both sides; this test keeps them equal.
"""

import inspect

import pytest

from planner_service.planner.online import DEBOUNCE_SECONDS, REPLAN_SECONDS
from planner_service.settings import Settings
from planner_service.sim.policies.statebudget import StatebudgetPolicy

# setting -> the statebudget policy's parameter for the same rule
SAME_RULE = {
    "replan_debounce_seconds": "min_interval_seconds",
    "replan_interval_seconds": "replan_seconds",
    "demand_window_seconds": "demand_window_seconds",
    "demand_seats": "demand_seats",
    "demand_min_requests": "demand_min_requests",
    "unpin_after_seconds": "unpin_after_seconds",
}


@pytest.mark.parametrize(("setting", "parameter"), SAME_RULE.items())
def test_setting_default_is_the_replayed_policys(setting: str, parameter: str) -> None:
    policy_default = inspect.signature(StatebudgetPolicy.__init__).parameters[parameter].default
    assert Settings.model_fields[setting].default == policy_default


def test_planning_cadence_is_the_online_planners() -> None:
    fields = Settings.model_fields
    assert (fields["replan_debounce_seconds"].default, fields["replan_interval_seconds"].default) == (
        DEBOUNCE_SECONDS,
        REPLAN_SECONDS,
    )
