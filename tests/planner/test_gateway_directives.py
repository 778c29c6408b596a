"""The gateway's pins and warm-ups for a scripted state, checked by hand."""

from __future__ import annotations

import pytest

from planner_service.domain.problem import Gpu, ModelSpec
from planner_service.domain.scenario import CostConstants, Slo
from planner_service.planner.gateway_directives import (
    DirectiveLimits,
    InstanceView,
    SessionView,
    WarmupPricing,
    decide_directives,
    warmup_value,
)
from planner_service.wire.routes import PinDirective, WarmupDirective

GIB = 2**30
KV_PER_TOKEN = {"coder": 1 << 17, "reasoner": 1 << 18}  # 128 KiB and 256 KiB per token
LIMITS = DirectiveLimits(max_warmups_per_instance=2, min_probability=0.5, target="top")
PRICED = DirectiveLimits(max_warmups_per_instance=2, min_probability=0.5, target="priced")

# coder on g0; reasoner on g1 and on the tensor-parallel pair g2+g3; a stopped reasoner on g4
INSTANCES = [
    InstanceView("coder@g0", "coder", ("g0",), routable=True),
    InstanceView("reasoner@g1", "reasoner", ("g1",), routable=True),
    InstanceView("reasoner@g2+g3", "reasoner", ("g2", "g3"), routable=True),
    InstanceView("reasoner@g4", "reasoner", ("g4",), routable=False),
]
FREE = {"g0": 4 * GIB, "g1": 1 * GIB, "g2": 4 * GIB, "g3": 4 * GIB, "g4": 40 * GIB}


def session(sid: str, *, tokens: int = 4096, tool: bool = True, busy: bool = False, **kw: object) -> SessionView:
    fields: dict[str, object] = {"model": "coder", "holder": None, "kept": False, **kw}
    return SessionView(sid, busy=busy, in_tool_call=tool, context_tokens=tokens, **fields)  # type: ignore[arg-type]


# every card 1e15 bf16 FLOP/s, at the default prefill efficiency 0.5: 5e14 FLOP/s; prefill takes 2 FLOPs per active
# parameter per token (planner/costs.py): reasoner (1e10) 4e-5 s a token on one card, 2e-5 s on the pair
GPUS = {g: Gpu(g, "n1", "t", 80 * GIB, 3e12, 1e15, 5e10, 5e10) for g in ("g0", "g1", "g2", "g3", "g4")}
MODELS = {
    m: ModelSpec(m, ("bf16",), {"bf16": 10 * GIB}, KV_PER_TOKEN[m], 0, 0, params, 0, {"bf16": 1})
    for m, params in (("coder", 5 * 10**9), ("reasoner", 10**10))
}
PRICING = WarmupPricing(
    MODELS, GPUS, CostConstants()
)  # 0.02 s a GiB held on GPU; weights 4 / 2 / 1; targets 2 / 5 / 30 s


def decide(sessions, next_model, *, kv_holders=None, queued=frozenset(), free=None, limits=LIMITS, pricing=PRICING):
    return decide_directives(
        INSTANCES, sessions, next_model, kv_holders or {}, queued, free or FREE, KV_PER_TOKEN, limits, pricing
    )


def test_warmups_go_to_idle_cards_with_room_most_likely_first():
    # s1 (4,096 tokens, p 0.9): 1 GiB of reasoner KV; g1 has 1 GiB free: it fits there (the first by id)
    # s2 (8,192 tokens, p 0.8): 2 GiB; g1 is full now: the pair, 1 GiB a GPU
    # s3 (p 0.4): below the threshold; s4: its next model is its own and coder@g0 holds its KV: nothing to warm
    # s5 (p 0.8, 2,048 tokens) ranks after s2 by its smaller context: 0.5 GiB, on the pair (g1 has 0 left)
    sessions = [
        session("s1"),
        session("s2", tokens=8192),
        session("s3"),
        session("s4", holder="coder@g0"),
        session("s5", tokens=2048),
    ]
    next_model = {
        "s1": {"coder": 0.1, "reasoner": 0.9},
        "s2": {"coder": 0.2, "reasoner": 0.8},
        "s3": {"coder": 0.6 - 0.2, "reasoner": 0.4},
        "s4": {"coder": 0.9, "reasoner": 0.1},
        "s5": {"coder": 0.2, "reasoner": 0.8},
    }
    pins, warmups = decide(sessions, next_model, kv_holders={("s4", "coder"): frozenset({"coder@g0"})})
    assert pins == []
    assert warmups == [
        WarmupDirective(session="s1", model="reasoner", instance="reasoner@g1", tokens=4096, probability=0.9),
        WarmupDirective(session="s2", model="reasoner", instance="reasoner@g2+g3", tokens=8192, probability=0.8),
        WarmupDirective(session="s5", model="reasoner", instance="reasoner@g2+g3", tokens=2048, probability=0.8),
    ]


def test_at_most_the_cap_per_instance():
    sessions = [session(f"s{i}", tokens=16) for i in range(5)]
    next_model = {f"s{i}": {"reasoner": 1.0} for i in range(5)}
    _, warmups = decide(sessions, next_model)
    # two on each routable reasoner (ties by id: g1 first); s4 finds no instance under the cap
    assert [(w.session, w.instance) for w in warmups] == [
        ("s0", "reasoner@g1"),
        ("s1", "reasoner@g1"),
        ("s2", "reasoner@g2+g3"),
        ("s3", "reasoner@g2+g3"),
    ]
    _, none = decide(sessions, next_model, limits=DirectiveLimits(max_warmups_per_instance=0, min_probability=0.5))
    assert none == []


def test_no_warmup_on_a_busy_or_queued_card():
    sessions = [
        session("s1", tokens=16),
        # a request of a reasoner session without a KV holder runs or waits on some reasoner card: all are busy
        session("r1", model="reasoner", tool=False, busy=True),
    ]
    next_model = {"s1": {"reasoner": 1.0}}
    assert decide(sessions, next_model)[1] == []
    # with its KV holder known, only the holder's card is busy
    sessions[1] = session("r1", model="reasoner", tool=False, busy=True, holder="reasoner@g1")
    assert [w.instance for w in decide(sessions, next_model)[1]] == ["reasoner@g2+g3"]
    # an open operation of the plan on g3 makes the pair busy too
    assert decide(sessions, next_model, queued=frozenset({"g3"}))[1] == []


def test_a_session_in_a_request_or_out_of_a_tool_call_gets_no_warmup():
    sessions = [session("busy", tokens=16, busy=True), session("thinking", tokens=16, tool=False)]
    next_model = {"busy": {"reasoner": 1.0}, "thinking": {"reasoner": 1.0}}
    assert decide(sessions, next_model)[1] == []


def test_no_room_no_warmup():
    # 16,384 tokens of reasoner KV: 4 GiB, 2 GiB a GPU of the pair; g1 has 1 GiB, the pair 1.5 GiB each
    sessions = [session("s1", tokens=16384)]
    free = {**FREE, "g2": 3 * GIB // 2, "g3": 3 * GIB // 2}
    assert decide(sessions, {"s1": {"reasoner": 1.0}}, free=free)[1] == []
    free["g2"] = free["g3"] = 2 * GIB
    assert [w.instance for w in decide(sessions, {"s1": {"reasoner": 1.0}}, free=free)[1]] == ["reasoner@g2+g3"]


def test_pins_where_the_plan_keeps_the_kv_on_a_routable_holder():
    sessions = [
        session("kept", tool=False, holder="coder@g0", kept=True, tokens=900),
        session("dropped", tool=False, holder="coder@g0", kept=False),
        session("asleep", tool=False, model="reasoner", holder="reasoner@g4", kept=True),
        session("nowhere", tool=False, kept=True),
    ]
    pins, warmups = decide(sessions, {})
    assert pins == [PinDirective(session="kept", instance="coder@g0", tokens=900)]
    assert warmups == []


def test_the_handoff_target_warms_the_most_likely_model_that_holds_none_of_the_session_s_kv():
    # s4's most likely next model is its own (coder@g0 holds its KV): "top" warms nothing for it; "handoff" warms
    # the likeliest model without its KV, reasoner (0.3 >= 0.2), on the first idle instance with room
    sessions = [session("s4", holder="coder@g0")]
    next_model = {"s4": {"coder": 0.7, "reasoner": 0.3}}
    holders = {("s4", "coder"): frozenset({"coder@g0"})}
    assert decide(sessions, next_model, kv_holders=holders)[1] == []
    handoff = DirectiveLimits(max_warmups_per_instance=2, min_probability=0.2, target="handoff")
    assert decide(sessions, next_model, kv_holders=holders, limits=handoff)[1] == [
        WarmupDirective(session="s4", model="reasoner", instance="reasoner@g1", tokens=4096, probability=0.3)
    ]
    # below its threshold, or already held by a reasoner instance: nothing
    strict = DirectiveLimits(max_warmups_per_instance=2, min_probability=0.5, target="handoff")
    assert decide(sessions, next_model, kv_holders=holders, limits=strict)[1] == []
    held = {**holders, ("s4", "reasoner"): frozenset({"reasoner@g2+g3"})}
    assert decide(sessions, next_model, kv_holders=held, limits=handoff)[1] == []


def test_the_value_of_a_warm_up_by_hand():
    """Reasoner on g1 prefills 4e-5 s a token; 8,192 tokens: L = 0.32768 s, KV 8,192 * 256 KiB = 2 GiB, priced
    0.02 s a GiB: 0.04 s.

    interactive (weight 2, target 5 s), p 0.25: 2 * 0.25 * 0.32768 - 0.04 = 0.12384 s
    interactive, p 0.05: 2 * 0.05 * 0.32768 - 0.04 = -0.007232 s (the saving does not pay for the room)
    blocking (weight 4, target 2 s), 65,536 tokens (L 2.62144 s > 2 s: the penalty 10 s), p 0.1, KV 16 GiB:
        4 * 0.1 * (2.62144 + 10) - 16 * 0.02 = 5.048576 - 0.32 = 4.728576 s
    """
    reasoner, g1 = MODELS["reasoner"], [GPUS["g1"]]
    c = CostConstants()
    assert warmup_value(8192, 0.25, Slo.INTERACTIVE, reasoner, g1, c) == pytest.approx(0.12384)
    assert warmup_value(8192, 0.05, Slo.INTERACTIVE, reasoner, g1, c) == pytest.approx(-0.007232)
    assert warmup_value(65536, 0.1, Slo.BLOCKING, reasoner, g1, c) == pytest.approx(4.728576)


def test_priced_warm_ups_only_where_the_saving_pays_for_the_room():
    """s1, 2,048 reasoner tokens (0.5 GiB: 0.01 s of HBM price), interactive. On g1: L = 0.08192 s, on the pair
    0.04096 s. p 0.05: 2 * 0.05 * 0.08192 = 0.008192 s < 0.01 on g1, less on the pair: no warm-up. p 0.25:
    2 * 0.25 * 0.08192 - 0.01 = 0.03096 s on g1, more than the pair's 0.01048 s: g1. (Its KV of coder is on
    coder@g0: nothing to warm there.)"""
    sessions = [session("s1", tokens=2048, holder="coder@g0")]
    holders = {("s1", "coder"): frozenset({"coder@g0"})}
    assert decide(sessions, {"s1": {"coder": 0.95, "reasoner": 0.05}}, kv_holders=holders, limits=PRICED)[1] == []
    _, [warmup] = decide(sessions, {"s1": {"coder": 0.75, "reasoner": 0.25}}, kv_holders=holders, limits=PRICED)
    assert warmup == WarmupDirective(
        session="s1", model="reasoner", instance="reasoner@g1", tokens=2048, probability=0.25, value_seconds=0.031
    )
    # the fixed target would warm nothing here: the most likely next model is the session's own
    assert decide(sessions, {"s1": {"coder": 0.75, "reasoner": 0.25}}, kv_holders=holders)[1] == []


def test_priced_warm_ups_best_first_within_room_and_cap():
    """g1 has 1 GiB free: room for one 4,096-token reasoner warm-up (1 GiB). Two sessions alike but for their
    class want it: the blocking one (weight 4) is worth twice the interactive one (weight 2) and takes g1; the
    other goes to the pair, which it is worth less on but still more than its price."""
    sessions = [session("a", tokens=4096), session("b", tokens=4096, slo=Slo.BLOCKING)]
    next_model = {"a": {"reasoner": 0.5}, "b": {"reasoner": 0.5}}
    _, warmups = decide(sessions, next_model, limits=PRICED)
    assert [(w.session, w.instance) for w in warmups] == [("a", "reasoner@g2+g3"), ("b", "reasoner@g1")]
    # b: 4 * 0.5 * 0.16384 - 0.02; a on the pair: 2 * 0.5 * 0.08192 - 0.02
    assert [w.value_seconds for w in warmups] == [pytest.approx(0.062, abs=5e-4), pytest.approx(0.308, abs=5e-4)]
    # an engine pool with 0.5 GiB left on g1 bounds it below its card's free room: b goes to the pair as well
    pooled = WarmupPricing(MODELS, GPUS, CostConstants(), {"reasoner@g1": GIB // 2})
    _, warmups = decide(sessions, next_model, limits=PRICED, pricing=pooled)
    assert [(w.session, w.instance) for w in warmups] == [("a", "reasoner@g2+g3"), ("b", "reasoner@g2+g3")]
    # one per instance: b on g1, a on the pair; five sessions of 16 tokens: two on each instance, one left out
    capped = DirectiveLimits(max_warmups_per_instance=1, min_probability=0.0, target="priced")
    assert [w.instance for w in decide(sessions, next_model, limits=capped)[1]] == ["reasoner@g2+g3", "reasoner@g1"]
    many = [session(f"s{i}", tokens=16) for i in range(5)]
    _, warmups = decide(many, {f"s{i}": {"reasoner": 1.0} for i in range(5)}, limits=PRICED)
    assert [(w.session, w.instance) for w in warmups] == [
        ("s0", "reasoner@g1"),
        ("s1", "reasoner@g1"),
        ("s2", "reasoner@g2+g3"),
        ("s3", "reasoner@g2+g3"),
    ]


def test_priced_warm_ups_skip_held_kv_and_warm_the_session_s_own_model_once_evicted():
    """s4's KV of coder sits on coder@g0 (nothing to warm there); once it is gone, the likely stay on coder is
    worth warming too: 4,096 tokens on g0 at 2e-5 s a token, 2 * 0.7 * 0.08192 - 0.5 * 0.02 = 0.104688 s, more
    than reasoner's 2 * 0.3 * 0.16384 - 0.02 = 0.078304 s on g1."""
    holders = {("s4", "coder"): frozenset({"coder@g0"})}
    sessions = [session("s4", holder="coder@g0")]
    next_model = {"s4": {"coder": 0.7, "reasoner": 0.3}}
    assert [(w.model, w.instance) for w in decide(sessions, next_model, kv_holders=holders, limits=PRICED)[1]] == [
        ("reasoner", "reasoner@g1")
    ]
    assert [(w.model, w.value_seconds) for w in decide([session("s4")], next_model, limits=PRICED)[1]] == [
        ("coder", 0.105)
    ]


def test_the_priced_target_needs_the_cost_model():
    with pytest.raises(ValueError, match="pricing"):
        decide([session("s1")], {"s1": {"reasoner": 1.0}}, limits=PRICED, pricing=None)
