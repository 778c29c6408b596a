"""The harness's own checks (`planner_service/soak/checks.py`) find what they are there to find."""

from __future__ import annotations

from planner_service.soak.checks import Limits, Placement, replay, violations
from planner_service.wire.enums import Action, Kind, Priority, Tier
from planner_service.wire.operations import Operation
from planner_service.wire.state import Location, PlacementEntry, StateObject

GIB = 1 << 30
EXPERTS = StateObject(kind=Kind.EXPERTS, model="reasoner")
WEIGHTS = StateObject(kind=Kind.WEIGHTS, model="reasoner", precision="fp8")
KV = StateObject(kind=Kind.KV, model="reasoner", session="s1")
NVME, GPU, HOST = Location.at(Tier.NVME, "n1"), Location.at(Tier.GPU, "n1-g1"), Location.at(Tier.HOST, "n1")
LIMITS = Limits(
    capacity={NVME.label(): 1000 * GIB, GPU.label(): 40 * GIB, HOST.label(): 100 * GIB},
    weights_bytes={("reasoner", "fp8"): 16 * GIB},
    experts_bytes={"reasoner": 600 * GIB},
    kv_bytes_per_token={"reasoner": 1024},
    context_tokens={"s1": 1000},
)


def op(i: int, obj: StateObject, src: Location | None, dst: Location | None, nbytes: int, *, keep: bool) -> Operation:
    return Operation(
        id=f"1.op-{i}",
        action=Action.PROMOTE if dst is not None and dst.tier is Tier.GPU else Action.DEMOTE if dst else Action.DROP,
        object=obj,
        source=src,
        dest=dst,
        bytes=nbytes,
        keep_source=keep,
        priority=Priority.BACKGROUND,
        depends_on=[],
        estimated_seconds=1.0,
        reason="test",
        node="n1",
    )


def seed() -> Placement:
    return Placement.of(
        [
            PlacementEntry(object=EXPERTS, location=NVME, bytes=600 * GIB),
            PlacementEntry(object=WEIGHTS, location=NVME, bytes=16 * GIB),
        ]
    )


def test_a_clean_replay_matches_and_breaks_nothing() -> None:
    ops = [
        op(1, WEIGHTS, NVME, GPU, 16 * GIB, keep=True),
        op(2, EXPERTS, NVME, GPU, 15 * GIB, keep=True),
        op(3, KV, None, GPU, 1000 * 1024, keep=False),
        op(4, WEIGHTS, GPU, None, 16 * GIB, keep=False),
    ]
    r = replay(seed(), ops, LIMITS)
    assert (r.applied, r.violations, r.double_applied, r.source_short) == (4, [], [], [])
    expected = Placement.of(
        [
            PlacementEntry(object=EXPERTS, location=NVME, bytes=600 * GIB),
            PlacementEntry(object=WEIGHTS, location=NVME, bytes=16 * GIB),
            PlacementEntry(object=EXPERTS, location=GPU, bytes=15 * GIB),
            PlacementEntry(object=KV, location=GPU, bytes=1000 * 1024),
        ]
    )
    assert r.placement.differences(expected) == []


def test_the_same_move_applied_three_times_is_an_over_capacity_gpu() -> None:
    """F1: three epochs each promoted the same 15 GiB of experts to one GPU and all were applied."""
    r = replay(seed(), [op(i, EXPERTS, NVME, GPU, 15 * GIB, keep=True) for i in range(3)], LIMITS)
    assert r.violations == [f"after 1.op-2: gpu:n1-g1 holds {45 * GIB} B, over its capacity {40 * GIB} B"]


def test_weights_landing_where_they_are_held_in_full_are_double_applied() -> None:
    r = replay(seed(), [op(i, WEIGHTS, NVME, GPU, 16 * GIB, keep=True) for i in range(2)], LIMITS)
    assert r.double_applied == ["1.op-1: gpu:n1-g1 already held all 17179869184 B of it"]
    assert r.violations == [
        f"after 1.op-1: gpu:n1-g1 holds {32 * GIB} B of weights(reasoner, fp8), over its full size {16 * GIB} B"
    ]


def test_a_source_that_gives_more_than_it_holds_is_found() -> None:
    r = replay(seed(), [op(1, WEIGHTS, HOST, GPU, 16 * GIB, keep=False)], LIMITS)
    assert r.source_short == [f"1.op-1: host:n1 held 0 B, gave {16 * GIB} B"]


def test_a_kv_object_over_its_session_context_is_a_violation() -> None:
    p = seed()
    p.add(KV, HOST, 1001 * 1024)
    assert violations(p, LIMITS) == [
        f"host:n1 holds {1001 * 1024} B of kv(reasoner, s1), over its full size {1000 * 1024} B"
    ]


def test_differences_name_the_object_and_both_sizes() -> None:
    other = seed()
    other.take(WEIGHTS, NVME, GIB)
    assert seed().differences(other) == [f"weights__reasoner__fp8 at nvme:n1: {16 * GIB} B here, {15 * GIB} B there"]
