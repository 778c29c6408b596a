"""The re-prefill floor of a trace's hand-offs: how fast any residency policy could make them ready.

A hand-off to model M has to prefill the history M's KV for the session does
not cover: what came after M's last turn in the session, or the whole history
on M's first visit (`trace.py`'s semantics). No placement avoids that
compute; the fastest any policy could do it is on the node whose GPUs together
prefill M fastest, with no queue, no load and every restore free. The P95 of
that floor bounds from below the hand-off P95 any policy can reach on the
cluster, so a report can tell the tail residency decisions can remove from the
tail they cannot.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner_service.domain.problem import Problem
from planner_service.planner import costs
from planner_service.sim.trace import TraceRecord, TraceRequest


def handoff_reprefill_floor(problem: Problem, records: Sequence[TraceRecord]) -> list[float]:
    """Seconds of unavoidable re-prefill of each hand-off (model changed within the session), in trace order."""
    fastest = {
        model_id: min(
            costs.prefill_seconds_per_token(model, [problem.gpus[g] for g in node.gpus], problem.constants)
            for node in problem.nodes.values()
            if node.gpus
        )
        for model_id, model in problem.models.items()
    }
    history: dict[str, int] = {}  # session -> tokens so far
    last_model: dict[str, str] = {}  # session -> the model of its latest turn
    covered: dict[tuple[str, str], int] = {}  # (session, model) -> the history up to that model's last turn
    floors = []
    for r in records:
        if not isinstance(r, TraceRequest):
            continue
        seen = history.get(r.session, 0)
        if r.session in last_model and last_model[r.session] != r.model:
            floors.append((seen - covered.get((r.session, r.model), 0)) * fastest[r.model])
        history[r.session] = seen + r.input_tokens + r.output_tokens
        covered[(r.session, r.model)] = history[r.session]
        last_model[r.session] = r.model
    return floors
