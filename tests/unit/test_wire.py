"""The wire package is the one source of the API's vocabulary, and the bottom layer."""

from __future__ import annotations

import ast
import typing
from enum import StrEnum
from pathlib import Path

import pytest

from planner_service.domain import scenario, state
from planner_service.planner import operations, plan, registry
from planner_service.service import inputs, records
from planner_service.sim.policies.base import PolicyName
from planner_service.wire import enums
from planner_service.wire.operations import Operation
from planner_service.wire.state import Location, StateObject

WIRE = Path(__file__).resolve().parents[2] / "planner_service" / "wire"


def test_the_domain_and_the_planner_use_the_wire_enums() -> None:
    assert state.Kind is enums.Kind and state.Tier is enums.Tier
    assert scenario.Slo is enums.Slo and scenario.Capability is enums.Capability
    assert operations.Action is enums.Action and operations.Priority is enums.Priority


def values(enum: type[StrEnum]) -> set[str]:
    return {member.value for member in enum}


def literal(model: type, field: str) -> set[str]:
    annotation = model.model_fields[field].annotation  # type: ignore[attr-defined]  # a pydantic model
    return set(typing.get_args(annotation))


def event_types() -> set[str]:
    """The `type` of every session event the service accepts."""
    (union,) = typing.get_args(inputs.Event)[:1]
    return {typing.get_args(event.model_fields["type"].annotation)[0] for event in typing.get_args(union)}


@pytest.mark.parametrize(
    ("wire", "there"),
    [
        (enums.SolverName, values(registry.SolverName)),
        (enums.SolverName, literal(inputs.WhatIfIn, "solver")),
        (enums.PlanStatus, values(plan.PlanStatus)),
        (enums.ReportStatus, literal(inputs.ReportIn, "status")),
        (enums.EngineKind, literal(inputs.EngineIn, "kind")),
        (enums.EventType, event_types()),
    ],
    ids=["solvers", "what-if solvers", "plan status", "report status", "engine kinds", "event types"],
)
def test_enums_the_service_still_spells_out_agree_with_the_wire(wire: type[StrEnum], there: set[str]) -> None:
    assert values(wire) == there


def test_operation_states_are_the_records_and_the_held_back() -> None:
    assert values(enums.OperationState) == values(records.OpState) | {"held_back"}


def test_policy_names_stay_out_of_the_wire() -> None:
    """Simulator policies are no API word: the wire names none of them."""
    every = set().union(*(values(e) for e in vars(enums).values() if isinstance(e, type) and issubclass(e, StrEnum)))
    assert not values(PolicyName) & every


@pytest.mark.parametrize("path", sorted(WIRE.glob("*.py")), ids=lambda p: p.name)
def test_the_wire_imports_only_itself_the_standard_library_and_pydantic(path: Path) -> None:
    allowed = {"__future__", "dataclasses", "datetime", "enum", "typing", "pydantic", "planner_service"}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            assert node.module.split(".")[0] in allowed, node.module
            if node.module.startswith("planner_service"):
                assert node.module.startswith("planner_service.wire"), node.module
        elif isinstance(node, ast.Import):
            assert all(a.name.split(".")[0] in allowed - {"planner_service"} for a in node.names)


def test_objects_and_locations_say_which_fields_their_kind_needs() -> None:
    with pytest.raises(ValueError, match="precision"):
        StateObject(kind=enums.Kind.WEIGHTS, model="m")
    with pytest.raises(ValueError, match="session"):
        StateObject.model_validate({"kind": "kv", "model": "m"})
    with pytest.raises(ValueError, match="'node'"):
        Location.model_validate({"tier": "host", "gpu": "g"})
    assert Location.at(enums.Tier.GPU, "n1/0") == Location.model_validate({"tier": "gpu", "gpu": "n1/0"})
    assert Location.at(enums.Tier.NVME, "n1").label() == "nvme:n1"
    assert StateObject(kind=enums.Kind.WEIGHTS, model="m", precision="fp8").key() == "weights__m__fp8"


def test_an_operation_reads_and_writes_from_and_to() -> None:
    body = {
        "id": "1.op-2",
        "action": "demote",
        "object": {"kind": "experts", "model": "moe"},
        "from": {"tier": "gpu", "gpu": "g0"},
        "to": {"tier": "host", "node": "n1"},
        "bytes": 7,
        "keep_source": False,
        "priority": "background",
        "depends_on": ["1.op-1"],
        "estimated_seconds": 0.25,
        "reason": "free room",
        "node": "n1",
    }
    op = Operation.model_validate(body)
    assert op.source == Location.at(enums.Tier.GPU, "g0") and op.frees == op.source
    assert op.model_dump(mode="json", exclude_unset=True) == body
    assert op.label() == "1.op-2 demote experts(moe) gpu:g0 -> host:n1 (7 B)"
