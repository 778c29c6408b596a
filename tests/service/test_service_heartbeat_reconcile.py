"""A heartbeat's measurements against the confirmed placement: a GPU that holds less than recorded is lost
state (recorded, replanned), objects an engine reports gone leave the confirmed state, and one heartbeat
alone changes nothing. The demo cluster: n2's coder (bf16, TP 2 on n2-g0 and n2-g1) with s01's KV there,
n1's reasoner (fp8 weights on n1-g0, experts on n1-g1..g3)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from planner_service.planner.engine_costs import instance_now
from planner_service.planner.residency import ResidencyIndex
from planner_service.service.engine import ClusterService
from planner_service.service.errors import InvalidInput
from planner_service.service.inputs import (
    EngineInstanceIn,
    EngineInstanceStateIn,
    GpuTelemetryIn,
    HeartbeatIn,
    RequestEvent,
)
from planner_service.service.reconcile import LOST_TOLERANCE_FRACTION
from planner_service.wire.enums import EngineKind, EngineState
from tests.service.test_service_reconcile import Clock, new_service


@pytest.fixture
def demo(tmp_path):
    svc = new_service(tmp_path / "demo.db", Clock())
    yield svc
    svc.close()


def gpu(svc: ClusterService, gpu_id: str) -> dict[str, Any]:
    return next(g for n in svc.cluster_view()["nodes"] for g in n["gpus"] if g["id"] == gpu_id)


def node(svc: ClusterService, node_id: str) -> dict[str, Any]:
    return next(n for n in svc.cluster_view()["nodes"] if n["id"] == node_id)


def on_gpu(svc: ClusterService, gpu_id: str) -> list[dict[str, Any]]:
    return [e["object"] for e in svc.srv_view()["placement"] if e["location"].get("gpu") == gpu_id]


def metric(svc: ClusterService, name: str, **labels: str) -> float:
    value = svc.live.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def instance(
    state: EngineState,
    *,
    model: str = "coder",
    precision: str = "bf16",
    node_id: str = "n2",
    gpus=None,
    pool: int = 4 << 30,
):
    gpus = list(gpus or ["n2-g0", "n2-g1"])
    return EngineInstanceStateIn(
        instance=EngineInstanceIn(
            id=EngineInstanceIn.instance_id(model, precision, gpus),
            node=node_id,
            kind=EngineKind.VLLM,
            model=model,
            precision=precision,
            gpus=gpus,
            kv_pool_bytes_per_gpu=pool,
        ),
        state=state,
    )


def test_a_gpu_measured_below_its_confirmed_bytes_twice_is_lost_state(demo: ClusterService) -> None:
    held = gpu(demo, "n2-g0")["used_bytes"]
    assert held > 0
    beat = HeartbeatIn(gpus=[GpuTelemetryIn(id="n2-g0", used_bytes=0, total_bytes=held * 2)])
    demo.live.force_replan = False

    demo.heartbeat("n2", beat)  # once: may be telemetry taken before a report it answers
    assert node(demo, "n2")["reconcile"]["lost"] == []
    assert metric(demo, "statebudget_node_state_lost_total", node="n2", gpu="n2-g0") == 0
    assert not demo.live.force_replan

    demo.heartbeat("n2", beat)
    lost = node(demo, "n2")["reconcile"]["lost"]
    assert lost == [{"gpu": "n2-g0", "confirmed_bytes": held, "used_bytes": 0, "missing_bytes": held}]
    assert metric(demo, "statebudget_node_state_lost_total", node="n2", gpu="n2-g0") == 1
    assert demo.live.force_replan

    demo.live.force_replan = False
    demo.heartbeat("n2", beat)  # still lost: counted once, not replanned again
    assert node(demo, "n2")["reconcile"]["lost"] == lost
    assert metric(demo, "statebudget_node_state_lost_total", node="n2", gpu="n2-g0") == 1
    assert not demo.live.force_replan
    assert gpu(demo, "n2-g0")["used_bytes"] == held  # which objects went is unknown: the placement stays

    demo.heartbeat("n2", HeartbeatIn(gpus=[GpuTelemetryIn(id="n2-g0", used_bytes=held)]))
    assert node(demo, "n2")["reconcile"]["lost"] == []


def test_a_shortfall_within_the_tolerance_or_an_excess_is_not_lost_state(demo: ClusterService) -> None:
    g = gpu(demo, "n2-g0")
    slack = int(LOST_TOLERANCE_FRACTION * g["capacity_bytes"])
    for used in (g["used_bytes"] - slack, g["used_bytes"] + (2 << 30)):
        for _ in range(2):
            demo.heartbeat("n2", HeartbeatIn(gpus=[GpuTelemetryIn(id="n2-g0", used_bytes=used)]))
        assert node(demo, "n2")["reconcile"]["lost"] == []
    demo.heartbeat("n2", HeartbeatIn(gpus=[GpuTelemetryIn(id="n2-g0")]))  # unknown use is not judged
    assert node(demo, "n2")["reconcile"]["lost"] == []


def test_a_stopped_engine_takes_its_weights_and_kv_off_its_gpus(demo: ClusterService) -> None:
    before = {g: on_gpu(demo, g) for g in ("n2-g0", "n2-g1")}
    assert all({"kind": "weights", "model": "coder", "precision": "bf16"} in objs for objs in before.values())
    version = demo.srv_view()["version"]
    beat = HeartbeatIn(instances=[instance(EngineState.STOPPED)])
    demo.live.force_replan = False

    demo.heartbeat("n2", beat)
    assert on_gpu(demo, "n2-g0") == before["n2-g0"]
    assert demo.srv_view()["version"] == version

    demo.heartbeat("n2", beat)
    assert on_gpu(demo, "n2-g0") == [] and on_gpu(demo, "n2-g1") == []
    assert demo.srv_view()["version"] > version
    corrected = node(demo, "n2")["reconcile"]["corrected"]
    assert {(c["object"]["kind"], c["location"]["gpu"]) for c in corrected} == {
        ("weights", "n2-g0"),
        ("weights", "n2-g1"),
        ("kv", "n2-g0"),
        ("kv", "n2-g1"),
    }
    assert all(c["why"] == "engine instance coder@bf16@n2-g0+n2-g1 reported stopped" for c in corrected)
    assert metric(demo, "statebudget_reconciled_objects_total", node="n2") == 4
    assert demo.live.force_replan


@pytest.mark.parametrize("state", [EngineState.ASLEEP_HOST, EngineState.ASLEEP_DISCARDED])
def test_a_sleeping_engine_holds_nothing_on_its_gpus(demo: ClusterService, state: EngineState) -> None:
    for _ in range(2):
        demo.heartbeat(
            "n1",
            HeartbeatIn(
                instances=[
                    instance(
                        state,
                        model="reasoner",
                        precision="fp8",
                        node_id="n1",
                        gpus=["n1-g0", "n1-g1", "n1-g2", "n1-g3"],
                    )
                ]
            ),
        )
    assert all(on_gpu(demo, f"n1-g{i}") == [] for i in range(4))


def test_a_running_engine_or_another_precision_changes_nothing(demo: ClusterService) -> None:
    before = demo.srv_view()
    for beat in (
        HeartbeatIn(instances=[instance(EngineState.RUNNING)]),
        HeartbeatIn(instances=[instance(EngineState.STOPPED, precision="int4")]),
    ):
        for _ in range(2):
            demo.heartbeat("n2", beat)
    assert demo.srv_view()["placement"] == before["placement"]
    assert demo.srv_view()["version"] == before["version"]
    assert node(demo, "n2")["reconcile"]["corrected"] == []


def test_a_model_s_bytes_where_none_of_its_reported_instances_runs_leave_the_confirmed_state(
    demo: ClusterService,
) -> None:
    """The demo's reasoner: weights on n1-g0, experts on n1-g1..g3. Its engine reports running on n1-g0 alone
    (as one launched there does): its experts on the other three GPUs are no engine's."""
    assert all(on_gpu(demo, f"n1-g{i}") for i in range(4))
    beat = HeartbeatIn(
        instances=[instance(EngineState.RUNNING, model="reasoner", precision="fp8", node_id="n1", gpus=["n1-g0"])]
    )
    demo.heartbeat("n1", beat)
    assert all(on_gpu(demo, f"n1-g{i}") for i in range(4))  # one heartbeat alone changes nothing
    demo.heartbeat("n1", beat)
    assert on_gpu(demo, "n1-g0") == [{"kind": "weights", "model": "reasoner", "precision": "fp8"}]
    assert all({"kind": "experts", "model": "reasoner"} not in on_gpu(demo, f"n1-g{i}") for i in (1, 2, 3))
    corrected = node(demo, "n1")["reconcile"]["corrected"]
    assert {(c["object"]["kind"], c["location"]["gpu"]) for c in corrected} == {
        ("experts", "n1-g1"),
        ("experts", "n1-g2"),
        ("experts", "n1-g3"),
    }
    assert all(
        c["why"] == "no reported engine instance holds " + c["location"]["gpu"] + " (reasoner@fp8@n1-g0 running)"
        for c in corrected
    )


def test_an_engine_of_another_precision_says_nothing_of_the_gpus_it_is_not_on(demo: ClusterService) -> None:
    """n2's coder runs at bf16 on n2-g0 and n2-g1; a report of an int4 coder on n2-g2 alone names no bf16
    engine, so the bf16 weights and the KV beside them stay."""
    before = demo.srv_view()["placement"]
    for _ in range(2):
        demo.heartbeat("n2", HeartbeatIn(instances=[instance(EngineState.RUNNING, precision="int4", gpus=["n2-g2"])]))
    assert demo.srv_view()["placement"] == before
    assert node(demo, "n2")["reconcile"]["corrected"] == []


def test_the_srv_counts_no_gpu_kv_beyond_the_pool_a_running_engine_reports(demo: ClusterService) -> None:
    """n2's coder engine holds s01's KV, 3,145,728,000 bytes on each of its GPUs. Its heartbeat reports a pool of
    512 MiB per GPU: the engine cannot hold more there (its LRU evicted the rest), so the SRV counts 1 GiB of
    coder's KV on GPU, the planner's problem keeps the KV within that pool, the GPUs measured at the weights
    and the pool have lost no state, and the confirmed placement, which operations reported, stays. A pool of
    0 (one the agent does not know) caps nothing: the same measurement is then state lost."""
    pool, kv = 512 << 20, 3_145_728_000

    def gpu_kv() -> int:
        rows = demo.srv_view()["srv"]
        return next(r["bytes"] for r in rows if (r["model"], r["state"], r["tier"]) == ("coder", "kv", "gpu"))

    def beat(pool: int) -> HeartbeatIn:
        used = [GpuTelemetryIn(id=g, used_bytes=gpu(demo, g)["used_bytes"] - kv + pool) for g in ("n2-g0", "n2-g1")]
        assert kv - pool > LOST_TOLERANCE_FRACTION * gpu(demo, "n2-g0")["capacity_bytes"]
        return HeartbeatIn(gpus=used, instances=[instance(EngineState.RUNNING, pool=pool)])

    assert gpu_kv() == 2 * kv
    before = demo.srv_view()
    for _ in range(2):
        demo.heartbeat("n2", beat(pool))
    assert gpu_kv() == 2 * pool
    assert demo.srv_view()["version"] > before["version"]
    assert demo.srv_view()["placement"] == before["placement"]
    assert node(demo, "n2")["reconcile"]["lost"] == []
    assert demo.live.state(demo.live.placement).problem({}).engine_pools == {("n2", "coder"): pool}

    unknown = beat(pool).model_copy(update={"instances": [instance(EngineState.RUNNING, pool=0)]})
    for _ in range(2):
        demo.heartbeat("n2", unknown)
    assert gpu_kv() == 2 * kv
    assert demo.live.state(demo.live.placement).problem({}).engine_pools == {}
    assert {s["gpu"] for s in node(demo, "n2")["reconcile"]["lost"]} == {"n2-g0", "n2-g1"}


def test_what_an_operation_in_flight_moves_is_left_to_its_report(demo: ClusterService) -> None:
    """An engine between states (its stop leased, not yet reported) may say stopped: the report settles it."""
    demo.apply_events([RequestEvent(id="e1", type="request", session="s9", model="reasoner", input_tokens=2000)])
    demo.replan(force=True)
    leased = [op for n in ("n1", "n2", "n3", "n4") for op in demo.lease(n, 1000)["operations"]]
    moving = next(
        (op for op in leased if op["from"] and op["from"]["tier"] == "gpu" and op["object"]["kind"] != "kv"), None
    )
    assert moving is not None, "the demo's plan for reasoner moves weights or experts off a GPU"
    obj, loc = moving["object"], moving["from"]
    gpus = [loc["gpu"]]
    node_id = next(n["id"] for n in demo.cluster_view()["nodes"] if loc["gpu"] in [g["id"] for g in n["gpus"]])
    precision = (
        obj.get("precision")
        or next(m for m in demo.models_view() if m["id"] == obj["model"])["resolved"]["precisions"][0]
    )
    beat = HeartbeatIn(
        instances=[instance(EngineState.STOPPED, model=obj["model"], precision=precision, node_id=node_id, gpus=gpus)]
    )
    for _ in range(2):
        demo.heartbeat(node_id, beat)
    assert obj in on_gpu(demo, loc["gpu"])


def test_corrections_are_committed(tmp_path) -> None:
    svc = new_service(tmp_path / "demo.db", Clock())
    for _ in range(2):
        svc.heartbeat("n2", HeartbeatIn(instances=[instance(EngineState.STOPPED)]))
    placement, status = svc.srv_view()["placement"], node(svc, "n2")["reconcile"]
    svc.close()
    again = new_service(tmp_path / "demo.db", Clock())
    try:
        assert again.srv_view()["placement"] == placement
        assert node(again, "n2")["reconcile"] == status
    finally:
        again.close()


@pytest.mark.parametrize(
    ("beat", "field"),
    [
        (HeartbeatIn(instances=[instance(EngineState.STOPPED, node_id="n1")]), "instances.0.instance.node"),
        (HeartbeatIn(instances=[instance(EngineState.STOPPED, gpus=["n1-g0"])]), "instances.0.instance.gpus"),
        (HeartbeatIn(instances=[instance(EngineState.STOPPED, model="nope")]), "instances.0.instance.model"),
        (HeartbeatIn(instances=[instance(EngineState.STOPPED, precision="fp4")]), "instances.0.instance.precision"),
    ],
)
def test_an_instance_the_node_cannot_have_is_refused(demo: ClusterService, beat: HeartbeatIn, field: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        demo.heartbeat("n2", beat)
    assert refused.value.field == field


def test_telemetry_out_of_physical_bounds_is_refused() -> None:
    with pytest.raises(ValidationError, match="more than the GPU's total_bytes"):
        GpuTelemetryIn(id="g", used_bytes=2 << 30, total_bytes=1 << 30)
    with pytest.raises(ValidationError, match="more than the GPU's total_bytes"):
        GpuTelemetryIn(id="g", free_bytes=2 << 30, total_bytes=1 << 30)
    with pytest.raises(ValidationError):
        GpuTelemetryIn(id="g", total_bytes=1 << 60)
    with pytest.raises(ValidationError, match="reported once"):
        HeartbeatIn(instances=[instance(EngineState.RUNNING), instance(EngineState.STOPPED)])
    with pytest.raises(ValidationError):
        HeartbeatIn.model_validate(
            {
                "instances": [
                    {
                        "instance": {**instance(EngineState.RUNNING).instance.model_dump(), "extra": 1},
                        "state": "running",
                    }
                ]
            }
        )
    with pytest.raises(ValidationError):
        HeartbeatIn.model_validate(
            {"instances": [{"instance": instance(EngineState.RUNNING).instance.model_dump(), "state": "dozing"}]}
        )
    good = instance(EngineState.RUNNING).instance.model_dump()
    for bad, why in (
        ({"id": "coder@bf16@n2-g1+n2-g0"}, "is not the instance's id"),
        ({"gpus": ["n2-g0", "n2-g0"], "id": "coder@bf16@n2-g0+n2-g0"}, "names a GPU twice"),
        ({"gpus": []}, "at least 1 item"),
        ({"max_context_tokens": 10**400}, "less than or equal to 100000000"),
        ({"kv_pool_bytes_per_gpu": -1}, "greater than or equal to 0"),
        ({"gpu_expert_fraction": 1.5}, "less than or equal to 1"),
    ):
        with pytest.raises(ValidationError, match=why):
            EngineInstanceIn.model_validate({**good, **bad})


def test_bytes_an_operation_in_flight_takes_off_a_gpu_are_not_missing(demo: ClusterService) -> None:
    """An engine frees what it demotes before its report lands: a GPU measured short by those bytes is fine."""
    demo.apply_events([RequestEvent(id="e1", type="request", session="s9", model="reasoner", input_tokens=2000)])
    demo.replan(force=True)
    leases = [demo.lease(n, 1000) for n in ("n1", "n2", "n3", "n4")]
    leased = [(lease["lease_id"], op) for lease in leases for op in lease["operations"]]
    off = next(op for _, op in leased if op["from"] and op["from"]["tier"] == "gpu" and not op["keep_source"])
    gpu_id, node_id = off["from"]["gpu"], off["node"]
    freed = sum(op["bytes"] for _, op in leased if op["from"] == off["from"] and not op["keep_source"])
    assert freed > LOST_TOLERANCE_FRACTION * gpu(demo, gpu_id)["capacity_bytes"]  # lost, were it not in flight
    measured = max(gpu(demo, gpu_id)["used_bytes"] - freed, 0)
    for _ in range(2):
        demo.heartbeat(node_id, HeartbeatIn(gpus=[GpuTelemetryIn(id=gpu_id, used_bytes=measured)]))
    assert node(demo, node_id)["reconcile"]["lost"] == []


def test_a_sleeping_engine_s_reported_pool_is_the_one_its_wake_keeps(demo: ClusterService) -> None:
    """n4's vision engine sleeps at level 1 on n4-g1. Its heartbeat reports the pool it was launched with: the
    planner's problem takes that pool for its wake (a wake maps the pool back at its launched size); a stopped
    engine's last launch says nothing of the next one."""
    pool = 3 << 30

    def beat(state: EngineState) -> HeartbeatIn:
        vision = instance(state, model="vision", node_id="n4", gpus=["n4-g1"], pool=pool)
        return HeartbeatIn(gpus=[GpuTelemetryIn(id="n4-g1")], instances=[vision])

    demo.heartbeat("n4", beat(EngineState.ASLEEP_HOST))
    assert demo.live.state(demo.live.placement).problem({}).engine_pools == {("n4", "vision"): pool}
    demo.heartbeat("n4", beat(EngineState.STOPPED))
    assert demo.live.state(demo.live.placement).problem({}).engine_pools == {}


def test_a_sleeping_engine_s_reported_state_is_the_one_the_planner_prices(demo: ClusterService) -> None:
    """The confirmed placement cannot tell a sleeping engine from a stopped one: n4's vision engine, whose
    host copy says level 1, is priced as the heartbeat reports it (here a level-2 sleep, its wake a reload),
    and as the placement says once the node reports it stopped."""

    def planned(state: EngineState) -> tuple[EngineState, tuple[str, ...]]:
        vision = instance(state, model="vision", node_id="n4", gpus=["n4-g1"])
        demo.heartbeat("n4", HeartbeatIn(gpus=[GpuTelemetryIn(id="n4-g1")], instances=[vision]))
        problem = demo.live.state(demo.live.placement).problem({})
        seen, _, group = instance_now(problem, ResidencyIndex.build(problem, problem.residency), "n4", "vision")
        return seen, group

    assert planned(EngineState.ASLEEP_DISCARDED) == (EngineState.ASLEEP_DISCARDED, ("n4-g1",))
    assert demo.live.state(demo.live.placement).problem({}).observed_engines == {
        ("n4", "vision"): (EngineState.ASLEEP_DISCARDED, ("n4-g1",))
    }
    assert planned(EngineState.STOPPED)[0] is not EngineState.ASLEEP_DISCARDED
    assert demo.live.state(demo.live.placement).problem({}).observed_engines == {}


def test_a_restart_in_flight_empties_its_gpus_without_lost_state(demo: ClusterService) -> None:
    """The demo's first plan restarts n1's reasoner onto all four cards: while the agent holds the lease the
    engine is stopped and started again, so every GPU of its groups reads empty and the engine stopped for a
    while. Neither is lost state nor a correction: the confirmed placement stays as it is until the reports."""
    demo.replan(force=True)
    lease = demo.lease("n1", 1000)
    restart = next(
        op["engine"] for op in lease["operations"] if (op.get("engine") or {}).get("transition") == "restart"
    )
    gpus = sorted(set(restart["instance"]["gpus"]) | set(restart["previous"]["gpus"]))
    held = {g: gpu(demo, g)["used_bytes"] for g in gpus}
    assert sum(held.values()) > 0
    stopped = instance(
        EngineState.STOPPED, model="reasoner", precision="fp8", node_id="n1", gpus=restart["previous"]["gpus"]
    )
    beat = HeartbeatIn(gpus=[GpuTelemetryIn(id=g, used_bytes=0) for g in gpus], instances=[stopped])
    for _ in range(3):
        demo.heartbeat("n1", beat)
    status = node(demo, "n1")["reconcile"]
    assert status["lost"] == [] and status["corrected"] == []
    assert {g: gpu(demo, g)["used_bytes"] for g in gpus} == held


def test_a_sleeping_moe_engine_s_launched_expert_share_reaches_the_planner(demo: ClusterService) -> None:
    """n1's reasoner (a MoE) reported asleep with the quarter of its experts it was launched with on GPU: the
    planner's problem takes that share for its wake (a wake maps the experts back); a dense model's engine, or
    a running or stopped one, gives none."""
    asleep = instance(EngineState.ASLEEP_HOST, model="reasoner", precision="fp8", node_id="n1", gpus=["n1-g1"])
    asleep = asleep.model_copy(update={"instance": asleep.instance.model_copy(update={"gpu_expert_fraction": 0.25})})
    dense = instance(EngineState.ASLEEP_HOST, model="vision", node_id="n4", gpus=["n4-g1"])
    demo.heartbeat("n1", HeartbeatIn(gpus=[GpuTelemetryIn(id="n1-g1")], instances=[asleep]))
    demo.heartbeat("n4", HeartbeatIn(gpus=[GpuTelemetryIn(id="n4-g1")], instances=[dense]))
    assert demo.live.state(demo.live.placement).problem({}).asleep_expert_fractions == {("n1", "reasoner"): 0.25}
    demo.heartbeat("n1", HeartbeatIn(gpus=[GpuTelemetryIn(id="n1-g1")], instances=[]))
    assert demo.live.state(demo.live.placement).problem({}).asleep_expert_fractions == {}
