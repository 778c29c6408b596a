"""The gateway's pins and warm-ups for a scripted state, checked by hand."""

from __future__ import annotations

from planner_service.planner.gateway_directives import (
    DirectiveLimits,
    InstanceView,
    SessionView,
    decide_directives,
)
from planner_service.wire.routes import PinDirective, WarmupDirective

GIB = 2**30
KV_PER_TOKEN = {"coder": 1 << 17, "reasoner": 1 << 18}  # 128 KiB and 256 KiB per token
LIMITS = DirectiveLimits(max_warmups_per_instance=2, min_probability=0.5)

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


def decide(sessions, next_model, *, kv_holders=None, queued=frozenset(), free=None, limits=LIMITS):
    return decide_directives(
        INSTANCES, sessions, next_model, kv_holders or {}, queued, free or FREE, KV_PER_TOKEN, limits
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
