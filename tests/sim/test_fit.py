"""Synthetic-trace distributions fitted to a real trace: lognormals by log-moments, applied to SynthParams."""

from __future__ import annotations

import math

import numpy as np
import pytest

from planner_service.domain.demo import demo_scenario
from planner_service.sim.fit import fit_lognormal, fit_trace
from planner_service.sim.synth import SynthParams, synth_trace


def test_a_lognormal_by_hand_and_zeros_left_out() -> None:
    fit = fit_lognormal([1.0, math.e**2, 0.0], "x")  # logs 0 and 2: mu 1, sd sqrt(2)
    assert fit.median == pytest.approx(math.e) and fit.sigma == pytest.approx(math.sqrt(2))
    assert (fit.n, fit.zeros) == (2, 1)
    with pytest.raises(ValueError, match="x: at least two positive"):
        fit_lognormal([0.0, 3.0], "x")


def test_fitting_a_synthetic_trace_recovers_its_own_parameters() -> None:
    params = SynthParams(sessions=8, hours=4.0, human_turn_probability=0.0, handoff_rate=0.2)
    records = synth_trace(demo_scenario(), params, np.random.default_rng(2))
    fit = fit_trace(records, "synthetic")
    # gaps are clipped at the trace's end and contexts compact, so allow a few per cent
    assert fit.gap_seconds.median == pytest.approx(params.tool_gap_median_seconds, rel=0.05)
    assert fit.gap_seconds.sigma == pytest.approx(params.tool_gap_sigma, rel=0.05)
    assert fit.turn_input_tokens.median == pytest.approx(params.turn_input_median_tokens, rel=0.05)
    assert fit.output_tokens.sigma == pytest.approx(params.output_sigma, rel=0.05)
    assert fit.handoff_share == pytest.approx(0.2, abs=0.02)
    applied = fit.apply(SynthParams())
    assert applied.human_turn_probability == 0 and applied.tool_gap_median_seconds == fit.gap_seconds.median
