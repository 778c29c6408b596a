"""The re-prefill floor of a trace's hand-offs: how fast any residency policy could make them ready.

A hand-off to model M has to prefill the history M's KV for the session does
not cover: what came after M's last turn in the session, or the whole history
on M's first visit (`trace.py`'s semantics). No placement avoids that
compute; the fastest any policy could do it is on the node and group of its
GPUs that prefill M fastest, with no queue, no load and every restore free.
More cards add FLOP/s and an all-reduce, so each node's k fastest cards are
tried for every k; the attention, which only gains from FLOP/s, is priced on a
whole node's and follows what M's KV covers. Each part at its own best, the sum
stays a floor. The P95 of
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
    c = problem.constants
    cards = [
        sorted((problem.gpus[g] for g in node.gpus), key=lambda g: -g.bf16_flops)
        for node in problem.nodes.values()
        if node.gpus
    ]
    fastest = {
        model_id: min(
            costs.prefill_seconds_per_token(model, node[:k], c) for node in cards for k in range(1, len(node) + 1)
        )
        for model_id, model in problem.models.items()
    }
    per_pair = {
        model_id: min(costs.attention_seconds_per_pair(model, node, c) for node in cards)
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
            prefix = covered.get((r.session, r.model), 0)
            tokens = seen - prefix
            floors.append(tokens * fastest[r.model] + costs.causal_pairs(tokens, prefix) * per_pair[r.model])
        history[r.session] = seen + r.input_tokens + r.output_tokens
        covered[(r.session, r.model)] = history[r.session]
        last_model[r.session] = r.model
    return floors
