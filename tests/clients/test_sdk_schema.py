"""The SDK's methods return the type `schemas/openapi.json` documents for their route, and cover every route."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import pytest
from pydantic import TypeAdapter

from clients.sdk import AsyncStateBudgetClient, StateBudgetClient
from clients.sdk._core import Call, Endpoint
from clients.sdk.client import Endpoints

OPENAPI = json.loads((Path(__file__).resolve().parents[2] / "schemas" / "openapi.json").read_text())
REF = "#/components/schemas/{model}"
ENDPOINTS: dict[str, Endpoint[Any, Any]] = {
    name: value for name, value in vars(Endpoints).items() if isinstance(value, Endpoint)
}


def every_call() -> dict[str, Call[Any]]:
    """SDK method -> its call, path parameters left as the route's placeholders."""
    e = ENDPOINTS
    return {
        "livez": e["livez"].build(),
        "readyz": e["readyz"].build(),
        "metrics": e["metrics"].build(),
        "get_cluster": e["get_cluster"].build(),
        "put_cluster": e["put_cluster"].build({"nodes": []}),
        "list_models": e["list_models"].build(),
        "put_model": e["put_model"].build("{model_id}", {}),
        "delete_model": e["delete_model"].build("{model_id}"),
        "post_events": e["post_events"].build(),
        "list_sessions": e["list_sessions"].build(),
        "get_session": e["get_session"].build("{session_id}"),
        "get_srv": e["get_srv"].build(),
        "get_plan": e["get_plan"].build(),
        "get_routes": e["get_routes"].build(),
        "get_engines": e["get_engines"].build(),
        "replan": e["replan"].build(),
        "whatif": e["whatif"].build([]),
        "pareto": e["pareto"].build(),
        "explain": e["explain"].build(model="m"),
        "register_node": e["register_node"].build("{node_id}"),
        "heartbeat": e["heartbeat"].build("{node_id}"),
        "lease": e["lease"].build("{node_id}"),
        "renew_lease": e["renew_lease"].build("{node_id}", "{lease_id}"),
        "report": e["report"].build("{op_id}", lease_id="l", status="done"),
        "list_operations": e["list_operations"].build(),
        "get_calibration": e["get_calibration"].build(),
        "reset_calibration": e["reset_calibration"].build(),
        "reset_calibration of one node or GPU": e["reset_calibration"].build("{scope}", "{key}"),
        "reset_calibration of one field": e["reset_calibration"].build("{scope}", "{key}", "{field}"),
    }


CALLS = every_call()


def declared(name: str) -> Any:
    """The answer type a method's annotation promises: the `T` of its builder's `-> Call[T]`."""
    (answer,) = get_args(get_type_hints(ENDPOINTS[name].build)["return"])
    return answer


def test_every_method_is_on_both_clients() -> None:
    assert {c.split(" of ")[0] for c in CALLS} == set(ENDPOINTS)
    for name, endpoint in ENDPOINTS.items():
        for client in (StateBudgetClient, AsyncStateBudgetClient):
            assert getattr(client, name) is endpoint, (client, name)
        assert endpoint.__doc__ == endpoint.build.__doc__  # help() on a method shows what it does


@pytest.mark.parametrize("name", sorted(CALLS))
def test_each_method_validates_into_its_declared_type(name: str) -> None:
    """What the annotation says is what `parse` validates into (a `Call` built with the wrong type fails here)."""
    assert CALLS[name].answer == declared(name.split(" of ")[0])


def documented(call: Call) -> dict[str, Any]:
    """The route's success answer in openapi.json."""
    operation = OPENAPI["paths"][call.path][call.method.lower()]
    (status,) = [s for s in operation["responses"] if s in ("200", "204")]
    return operation["responses"][status]


def normal(schema: Any) -> Any:
    """A schema without what FastAPI and pydantic write differently and that does not change what it accepts:
    `title`s (FastAPI names a route's list answer) and `"default": null` (FastAPI leaves it out)."""
    if isinstance(schema, dict):
        return {
            k: normal(v)
            for k, v in schema.items()
            if not (k == "title" and isinstance(v, str)) and not (k == "default" and v is None)
        }
    if isinstance(schema, list):
        return [normal(v) for v in schema]
    return schema


def test_the_sdk_covers_every_route() -> None:
    routes = {(method.upper(), path) for path, item in OPENAPI["paths"].items() for method in item}
    assert {(c.method, c.path) for c in CALLS.values()} == routes


@pytest.mark.parametrize("name", sorted(CALLS))
def test_each_answer_type_is_the_documented_one(name: str) -> None:
    call = CALLS[name]
    answer = documented(call)
    if call.answer in (str, type(None)):  # text (the metrics) or nothing (a delete)
        assert "application/json" not in answer.get("content", {}) or answer["content"]["application/json"][
            "schema"
        ] in ({}, {"type": "object"})
        return
    assert get_origin(call.answer) in (None, list)  # a model or a list of models, as the routes answer
    schema = TypeAdapter(call.answer).json_schema(mode="serialization", ref_template=REF)
    definitions = schema.pop("$defs", {})
    expected = answer["content"]["application/json"]["schema"]
    if "$ref" in expected:  # a model: pydantic writes it in place, FastAPI as a component
        expected = OPENAPI["components"]["schemas"][expected["$ref"].removeprefix(REF.format(model=""))]
    assert normal(schema) == normal(expected)
    for model, definition in definitions.items():
        assert normal(definition) == normal(OPENAPI["components"]["schemas"][model]), model


def test_a_documented_answer_decodes_into_typed_objects() -> None:
    """An answer as the API documents it (the schema's own example shape) comes back typed, not as a dict."""
    lease = TypeAdapter(CALLS["lease"].answer).validate_python(
        {
            "lease_id": "l-1",
            "expires_at": "2026-01-01T00:00:00Z",
            "expires_in_seconds": 30.0,
            "operations": [
                {
                    "id": "3.op-1",
                    "action": "promote",
                    "object": {"kind": "kv", "model": "coder", "session": "s1"},
                    "from": {"tier": "host", "node": "n1"},
                    "to": {"tier": "gpu", "gpu": "n1-g0"},
                    "bytes": 1024,
                    "keep_source": True,
                    "priority": "blocking",
                    "depends_on": ["3.op-0"],
                    "estimated_seconds": 0.01,
                    "reason": "restore",
                    "node": "n1",
                    "epoch": 3,
                }
            ],
        }
    )
    (op,) = lease.operations
    assert op.source.id == "n1" and op.dest.label() == "gpu:n1-g0" and op.object.key() == "kv__coder__s1"
    assert op.frees is None and op.epoch == 3 and op.priority == "blocking"
