"""Synthetic-trace distributions fitted to a real trace: turn gaps, tokens, the hand-off share.

`synth.py`'s defaults fit the gaps and tokens to the 17 round-to-round gaps and 19 rounds of the public
TraceLab sample. `fit_trace` fits the same distributions to any trace in the StateBudget format (an
imported public one: `windows.load_trace`), each a lognormal by its log-moments (the maximum-likelihood
fit: mu the mean and sigma the standard deviation of the logs, ddof 1):

- **gaps**: start-to-start gaps between consecutive requests of a session (a workflow: a session and its
  sub-agents), as `synth.py`'s gaps are; they replace the tool-loop lognormal and the human-turn share
  is set to 0 (the fitted lognormal holds both);
- **first input**: the first request's input tokens of each session; **later input**: the input tokens
  each later request appends; **output**: every request's output tokens;
- **hand-off share**: `synth.handoff_share`, reported beside the fit (the study's `--handoff-rate` sets it).
  Azure's and Mooncake's sessions never change model (their importers draw hand-offs from the scenario's
  chain), so only Alibaba's share is the trace's own: 24.9 % of later requests on the demo's seven models
  (27.0 % between its 87 checkpoints themselves, sessions split after 30 idle minutes as the importer does).

A lognormal has no zeros: gaps of 0 s (requests in the same second of a trace of second resolution) and
token counts of 0 (a prompt that appends nothing) are left out of the fit and counted in `zeros`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from planner_service.sim.synth import SynthParams, handoff_share
from planner_service.sim.trace import TraceRecord, by_workflow


@dataclass(frozen=True)
class Lognormal:
    median: float  # exp(mu)
    sigma: float
    n: int  # positive observations fitted
    zeros: int  # observations of 0 left out

    def to_json(self) -> dict[str, float | int]:
        return {"median": round(self.median, 3), "sigma": round(self.sigma, 3), "n": self.n, "zeros": self.zeros}


def fit_lognormal(values: Sequence[float], what: str) -> Lognormal:
    data = np.asarray(values, dtype=float)
    positive = data[data > 0]
    if positive.size < 2:
        raise ValueError(f"{what}: at least two positive values are needed to fit a lognormal, got {positive.size}")
    logs = np.log(positive)
    return Lognormal(
        math.exp(float(logs.mean())), float(logs.std(ddof=1)), int(positive.size), int(data.size - positive.size)
    )


@dataclass(frozen=True)
class TraceFit:
    source: str
    gap_seconds: Lognormal
    first_input_tokens: Lognormal
    turn_input_tokens: Lognormal
    output_tokens: Lognormal
    handoff_share: float

    def apply(self, params: SynthParams) -> SynthParams:
        """The synthetic parameters with these distributions in place of the TraceLab sample's."""
        return replace(
            params,
            tool_gap_median_seconds=self.gap_seconds.median,
            tool_gap_sigma=self.gap_seconds.sigma,
            human_turn_probability=0.0,
            first_input_median_tokens=self.first_input_tokens.median,
            first_input_sigma=self.first_input_tokens.sigma,
            turn_input_median_tokens=self.turn_input_tokens.median,
            turn_input_sigma=self.turn_input_tokens.sigma,
            output_median_tokens=self.output_tokens.median,
            output_sigma=self.output_tokens.sigma,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "gap_seconds": self.gap_seconds.to_json(),
            "first_input_tokens": self.first_input_tokens.to_json(),
            "turn_input_tokens": self.turn_input_tokens.to_json(),
            "output_tokens": self.output_tokens.to_json(),
            "handoff_share": round(self.handoff_share, 4),
        }


def fit_trace(records: Sequence[TraceRecord], source: str) -> TraceFit:
    """The module doc's fits over every request of the trace."""
    last_t: dict[str, float] = {}
    gaps: list[float] = []
    first: list[int] = []
    later: list[int] = []
    output: list[int] = []
    for workflow, r in by_workflow(records):
        if workflow in last_t:
            gaps.append(r.t - last_t[workflow])
            later.append(r.input_tokens)
        else:
            first.append(r.input_tokens)
        last_t[workflow] = r.t
        output.append(r.output_tokens)
    return TraceFit(
        source,
        fit_lognormal(gaps, f"{source}: gaps between a session's requests"),
        fit_lognormal(first, f"{source}: first input tokens"),
        fit_lognormal(later, f"{source}: later input tokens"),
        fit_lognormal(output, f"{source}: output tokens"),
        handoff_share(records),
    )
