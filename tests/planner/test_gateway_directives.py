"""The gateway's pins and warm-ups for a scripted state, checked by hand."""

from __future__ import annotations

import pytest

from planner_service.domain.problem import Gpu, ModelSpec, Node
from planner_service.domain.scenario import Capability, CostConstants, Slo
from planner_service.domain.state import Tier
from planner_service.planner.gateway_directives import (
    DirectiveLimits,
    InstanceView,
    SessionView,
    WarmupPricing,
    decide_directives,
    handoff_ready_seconds,
    warmup_value,
)
from planner_service.planner.predictor import NextTurn
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
NODE = Node("n1", 512 * GIB, 0, 0.0, 0.0, frozenset({Capability.KV_OFFLOAD}), tuple(GPUS))
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
    """Reasoner prefills 4e-5 s a token on g1, 2e-5 s on the pair; 8,192 tokens: 0.32768 s on g1, KV 8,192 * 256
    KiB = 2 GiB, priced 0.02 s a GiB over the 300 s horizon: 0.04 s when held all of it.

    interactive (weight 2, target 5 s), p 0.25, served on g1 without it: 2 * 0.25 * 0.32768 - 0.04 = 0.12384 s
    interactive, p 0.05: 2 * 0.05 * 0.32768 - 0.04 = -0.007232 s (the saving does not pay for the room)
    the next request comes within the horizon half the time and the KV is held 150 s on average:
        2 * 0.25 * 0.5 * 0.32768 - 0.04 * 150 / 300 = 0.08192 - 0.02 = 0.06192 s
    blocking (weight 4, target 2 s), 65,536 tokens, p 0.1, KV 16 GiB, served on g1 (2.62144 s, over the target)
    or on the pair (1.31072 s) by the gateway's hash, half each: mean 1.96608 s, the penalty 10 s half the time:
        4 * 0.1 * (1.96608 + 0.5 * 10) - 16 * 0.02 = 2.786432 - 0.32 = 2.466432 s
    """
    c = CostConstants()
    assert warmup_value(0.25, Slo.INTERACTIVE, [0.32768], 2 * GIB, c) == pytest.approx(0.12384)
    assert warmup_value(0.05, Slo.INTERACTIVE, [0.32768], 2 * GIB, c) == pytest.approx(-0.007232)
    half = NextTurn(within=0.5, hold_seconds=150.0)
    assert warmup_value(0.25, Slo.INTERACTIVE, [0.32768], 2 * GIB, c, half) == pytest.approx(0.06192)
    assert warmup_value(0.1, Slo.BLOCKING, [2.62144, 1.31072], 16 * GIB, c) == pytest.approx(2.466432)
    # R_j without a copy below is the re-prefill; with one in host DRAM, the restore where that is cheaper
    reasoner, g1 = MODELS["reasoner"], [GPUS["g1"]]
    assert handoff_ready_seconds(8192, reasoner, g1, None, None, c) == pytest.approx(0.32768)
    assert handoff_ready_seconds(8192, reasoner, g1, (Tier.HOST, 2 * GIB), NODE, c) == pytest.approx(2 * GIB / 5e10)


def test_priced_warm_ups_only_where_the_saving_pays_for_the_room():
    """s1, 2,048 reasoner tokens (0.5 GiB: 0.01 s of HBM price), interactive. Without a warm-up its hand-off goes to
    g1 (0.08192 s) or the pair (0.04096 s), by the gateway's hash: 0.06144 s. p 0.05: 2 * 0.05 * 0.06144 = 0.006144 s
    < 0.01: no warm-up. p 0.25: 2 * 0.25 * 0.06144 - 0.01 = 0.02072 s, the same on either: the faster pair. (Its
    KV of coder is on coder@g0: nothing to warm there.)"""
    sessions = [session("s1", tokens=2048, holder="coder@g0")]
    holders = {("s1", "coder"): frozenset({"coder@g0"})}
    assert decide(sessions, {"s1": {"coder": 0.95, "reasoner": 0.05}}, kv_holders=holders, limits=PRICED)[1] == []
    _, [warmup] = decide(sessions, {"s1": {"coder": 0.75, "reasoner": 0.25}}, kv_holders=holders, limits=PRICED)
    assert warmup == WarmupDirective(
        session="s1", model="reasoner", instance="reasoner@g2+g3", tokens=2048, probability=0.25, value_seconds=0.021
    )
    # the fixed target would warm nothing here: the most likely next model is the session's own
    assert decide(sessions, {"s1": {"coder": 0.75, "reasoner": 0.25}}, kv_holders=holders)[1] == []


def test_a_slower_instance_is_worth_no_more_than_where_the_hand_off_would_go():
    """The pair is busy (an operation on g2): only g1 is idle. s1's hand-off without a warm-up would go to g1
    (0.16384 s for 4,096 tokens) or the pair (0.08192 s), half each: the warm-up on g1 spares 0.12288 s, not g1's
    own 0.16384 s: 2 * 0.5 * 0.12288 - 0.02 = 0.10288 s (the candidate's re-prefill would say 0.14384 s)."""
    _, [warmup] = decide([session("s1")], {"s1": {"reasoner": 0.5}}, queued=frozenset({"g2"}), limits=PRICED)
    assert (warmup.instance, warmup.value_seconds) == ("reasoner@g1", 0.103)


def test_a_hand_off_that_could_restore_its_kv_credits_the_restore_not_the_re_prefill():
    """s1's 4,096 reasoner tokens (1 GiB) sit in n1's host DRAM, which loads KV back: a hand-off restores them at 50
    GB/s, in 2^30 / 5e10 = 0.021475 s onto g1 and 0.010737 s onto the pair (half a GiB a card), mean 0.016106 s,
    instead of re-prefilling 0.12288 s. Interactive, p 0.5: 2 * 0.5 * 0.016106 - 0.02 < 0: no warm-up (it is worth
    0.10288 s without the copy); blocking: 4 * 0.5 * 0.016106 - 0.02 = 0.012212 s."""
    below = {("s1", "reasoner"): {"n1": (Tier.HOST, GIB)}, ("s2", "reasoner"): {"n1": (Tier.HOST, GIB)}}
    restoring = WarmupPricing(MODELS, GPUS, CostConstants(), nodes={"n1": NODE}, restorable=below)
    next_model = {"s1": {"reasoner": 0.5}}
    assert [w.value_seconds for w in decide([session("s1")], next_model, limits=PRICED)[1]] == [0.103]
    assert decide([session("s1")], next_model, limits=PRICED, pricing=restoring)[1] == []
    _, [warmup] = decide([session("s1", slo=Slo.BLOCKING)], next_model, limits=PRICED, pricing=restoring)
    assert warmup.value_seconds == pytest.approx(0.012, abs=5e-4)


def test_a_warm_up_the_session_may_never_use_is_weighed_by_its_next_request_s_chance_and_charged_while_held():
    """s1 (4,096 tokens, p 0.5, interactive) is worth 2 * 0.5 * 0.12288 - 0.02 = 0.10288 s where its next request
    surely comes. If it comes within the horizon a tenth of the time and the KV is held 280 s on average:
    2 * 0.5 * 0.1 * 0.12288 - 0.02 * 280 / 300 = 0.012288 - 0.018667 < 0: no warm-up. Held 60 s (the next request
    comes soon when it comes): 0.012288 - 0.004 = 0.008288 s."""
    rare = WarmupPricing(MODELS, GPUS, CostConstants(), next_turn={"coder": NextTurn(0.1, 280.0)})
    soon = WarmupPricing(MODELS, GPUS, CostConstants(), next_turn={"coder": NextTurn(0.1, 60.0)})
    next_model = {"s1": {"reasoner": 0.5}}
    assert decide([session("s1")], next_model, limits=PRICED, pricing=rare)[1] == []
    _, [warmup] = decide([session("s1")], next_model, limits=PRICED, pricing=soon)
    assert warmup.value_seconds == pytest.approx(0.008, abs=5e-4)


def test_priced_warm_ups_best_first_within_room_and_cap():
    """Two sessions alike but for their class, 4,096 reasoner tokens (1 GiB) at p 0.5: the blocking b (weight 4) is
    worth 4 * 0.5 * 0.12288 - 0.02 = 0.22576 s, the interactive a 2 * 0.5 * 0.12288 - 0.02 = 0.10288 s, on either
    instance. With room for one on the pair (half a GiB a card) and one on g1, b takes the faster pair first."""
    sessions = [session("a", tokens=4096), session("b", tokens=4096, slo=Slo.BLOCKING)]
    next_model = {"a": {"reasoner": 0.5}, "b": {"reasoner": 0.5}}
    tight = {**FREE, "g2": GIB // 2, "g3": GIB // 2}
    _, warmups = decide(sessions, next_model, limits=PRICED, free=tight)
    assert [(w.session, w.instance) for w in warmups] == [("a", "reasoner@g1"), ("b", "reasoner@g2+g3")]
    assert [w.value_seconds for w in warmups] == [pytest.approx(0.103, abs=5e-4), pytest.approx(0.226, abs=5e-4)]
    # an engine pool with a quarter GiB left a card of the pair bounds it below its cards' room: b takes g1, a none
    pooled = WarmupPricing(MODELS, GPUS, CostConstants(), {"reasoner@g2+g3": GIB // 4})
    _, warmups = decide(sessions, next_model, limits=PRICED, pricing=pooled, free=tight)
    assert [(w.session, w.instance) for w in warmups] == [("b", "reasoner@g1")]
    # one per instance: b on the pair, a on g1; five sessions of 16 tokens: two on each instance, one left out
    capped = DirectiveLimits(max_warmups_per_instance=1, min_probability=0.0, target="priced")
    assert [w.instance for w in decide(sessions, next_model, limits=capped)[1]] == ["reasoner@g1", "reasoner@g2+g3"]
    many = [session(f"s{i}", tokens=16) for i in range(5)]
    _, warmups = decide(many, {f"s{i}": {"reasoner": 1.0} for i in range(5)}, limits=PRICED)
    assert [(w.session, w.instance) for w in warmups] == [
        ("s0", "reasoner@g2+g3"),
        ("s1", "reasoner@g2+g3"),
        ("s2", "reasoner@g1"),
        ("s3", "reasoner@g1"),
    ]


def test_priced_warm_ups_skip_held_kv_and_warm_the_session_s_own_model_once_evicted():
    """s4's KV of coder sits on coder@g0 (nothing to warm there); once it is gone, the likely stay on coder is
    worth warming too: 4,096 tokens on g0 at 2e-5 s a token, 2 * 0.7 * 0.08192 - 0.5 * 0.02 = 0.104688 s, more
    than reasoner's 2 * 0.3 * 0.12288 - 0.02 = 0.053728 s (on the faster pair)."""
    holders = {("s4", "coder"): frozenset({"coder@g0"})}
    sessions = [session("s4", holder="coder@g0")]
    next_model = {"s4": {"coder": 0.7, "reasoner": 0.3}}
    assert [(w.model, w.instance) for w in decide(sessions, next_model, kv_holders=holders, limits=PRICED)[1]] == [
        ("reasoner", "reasoner@g2+g3")
    ]
    assert [(w.model, w.value_seconds) for w in decide([session("s4")], next_model, limits=PRICED)[1]] == [
        ("coder", 0.105)
    ]


def test_the_priced_target_needs_the_cost_model():
    with pytest.raises(ValueError, match="pricing"):
        decide([session("s1")], {"s1": {"reasoner": 1.0}}, limits=PRICED, pricing=None)
