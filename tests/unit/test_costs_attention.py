"""The attention terms of the cost model at long contexts, against numbers worked by hand."""

from __future__ import annotations

import pytest

from planner_service.domain.scenario import CostConstants
from planner_service.planner import costs
from planner_service.sim.engine import Simulator
from planner_service.sim.policies.oracle import OraclePolicy
from planner_service.sim.trace import TraceRequest
from tests.sim.test_engine import GB, tiny_scenario
from tests.unit.test_costs_tensor_parallel import coder, preset_gpus

C = CostConstants()


def test_decode_reads_the_requests_kv_each_token() -> None:
    """Qwen2.5-Coder-32B (KV 262,144 B/token: 2 * 64 layers * 8 KV heads * 128 * 2 B) on 2 x L40, at 30,000
    tokens of context: 7.864e9 B of KV / (0.8 * 2 * 864e9 B/s) = 5.689 ms a token on top of the weights'
    47.40 ms and the all-reduce's 0.060 ms: 12 % more per decoded token."""
    model, pair = coder(), preset_gpus("l40", 2)
    assert model.kv_bytes_per_token == 262_144
    short = costs.decode_seconds_per_token(model, "bf16", pair, 0.0, C)
    long = costs.decode_seconds_per_token(model, "bf16", pair, 0.0, C, context_tokens=30_000)
    assert long - short == pytest.approx(5.689e-3, rel=1e-3)
    assert long == pytest.approx(47.40e-3 + 5.689e-3 + 60.12e-6, rel=1e-3)


def test_the_replay_decodes_at_the_mean_context_of_the_output() -> None:
    """tiny_scenario (one card, 1000 GB/s HBM, 4 GB of weights, 1000 B of KV per token). The second turn
    starts with 1100 tokens of history (1000 in + 100 out), reads 1000 more and writes 100: output token k
    attends to 2100 + k tokens, 2149.5 on average, so
        decode = 100 * (4e9 + 1000 * 2149.5) B / (0.8 * 1e12 B/s) = 0.500268688 s
    (0.5 s without the KV read)."""
    trace = [
        TraceRequest(t=0.0, session="s1", model="a", input_tokens=1000, output_tokens=100),
        TraceRequest(t=100.0, session="s1", model="a", input_tokens=1000, output_tokens=100),
    ]
    second = Simulator(tiny_scenario(10 * GB), trace, OraclePolicy()).run().requests[1]
    assert second.history_tokens == 1100
    decode = second.done_at - (second.admitted_at + second.ttft_seconds)
    assert decode == pytest.approx(0.500268688, abs=1e-9)
